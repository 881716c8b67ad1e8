#pragma once
// Tensors copied into one flat host buffer and back: one collective carries all of them.
#include <vector>

#include "tessera/tensor/tensor.hpp"

namespace tessera {

/// A tensor's values in host memory for the length of a scope: the tensor itself on the host,
/// else a copy that is written back at the end.
class OnHost {
 public:
  explicit OnHost(Tensor& tensor);
  ~OnHost();
  OnHost(const OnHost&) = delete;
  OnHost& operator=(const OnHost&) = delete;
  float* data() { return host_.data(); }
  std::size_t size() const { return static_cast<std::size_t>(host_.numel()); }
  Tensor& host() { return host_; }

 private:
  Tensor& tensor_;
  Tensor host_;
};

/// The elements of `tensors`, in order, in one new host buffer.
Tensor pack_flat(const std::vector<Tensor*>& tensors);
/// The same into `flat`, reallocated only when its size differs.
void pack_flat_into(const std::vector<Tensor*>& tensors, Tensor& flat);
/// The same into `out`, which holds total_elements(tensors) floats at least.
void pack_flat_into(const std::vector<Tensor*>& tensors, float* out);
/// Copies a packed buffer back into `tensors`.
void unpack_flat(const float* flat, const std::vector<Tensor*>& tensors);
inline void unpack_flat(const Tensor& flat, const std::vector<Tensor*>& tensors) { unpack_flat(flat.data(), tensors); }
/// How many elements `tensors` hold together.
std::int64_t total_elements(const std::vector<Tensor*>& tensors);

}  // namespace tessera
