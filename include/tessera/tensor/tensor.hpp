#pragma once
// A local (single-rank) dense float32 tensor: shape, strides, and a shared device buffer.
// Views (slices of the leading dimension) share the buffer.
#include <cstdint>
#include <memory>
#include <vector>

#include "tessera/core/device.hpp"
#include "tessera/tensor/shape.hpp"

namespace tessera {

class Tensor {
 public:
  Tensor() = default;
  /// Allocates a zero-filled contiguous tensor (GPU memory from the caching allocator for a
  /// CUDA device; a build without CUDA refuses one with a clear error).
  explicit Tensor(Shape shape, Device device = Device::host());

  const Shape& shape() const { return shape_; }
  int rank() const { return shape_.rank(); }
  std::int64_t dim(int i) const { return shape_[i]; }
  std::int64_t numel() const { return shape_.numel(); }
  bool empty() const { return numel() == 0; }
  bool defined() const { return buffer_ != nullptr || shape_.rank() > 0; }
  const std::vector<std::int64_t>& strides() const { return strides_; }
  bool is_contiguous() const;
  Device device() const { return device_; }

  float* data() { return buffer_ ? buffer_.get() + offset_ : nullptr; }
  const float* data() const { return buffer_ ? buffer_.get() + offset_ : nullptr; }
  /// Identifies the buffer (shared by views and copies of this tensor; null when none).
  const void* buffer_id() const { return buffer_.get(); }
  /// Bytes this tensor's buffer holds (whole buffer, shared by views).
  std::int64_t allocated_bytes() const { return capacity_ * static_cast<std::int64_t>(sizeof(float)); }

  /// Rows [begin, end) of the leading dimension, sharing memory.
  Tensor slice(std::int64_t begin, std::int64_t end) const;
  /// Same memory, another shape with the same number of elements (contiguous only).
  Tensor reshape(Shape shape) const;
  /// Deep copy.
  Tensor clone() const;
  /// This tensor on another device (a copy; the tensor itself when it is there already).
  Tensor to(Device device) const;
  void fill(float value);
  void zero() { fill(0.0f); }
  /// Copies another tensor of the same shape into this one.
  void copy_from(const Tensor& other);
  /// Ensures shape: the same element count keeps the memory (and any aliasing view); another
  /// count reallocates when it grows beyond capacity, and always for a slice (or a reshape of
  /// one), which never reaches past its own elements into the rest of the buffer.
  void resize(const Shape& shape);
  /// Ensures shape and device (a tensor on another device is replaced by a new one there).
  void resize(const Shape& shape, Device device);

  /// Element at a multi-index (for tests and small tools, not for kernels; host tensors only).
  float at(const std::vector<std::int64_t>& index) const;
  float& at(const std::vector<std::int64_t>& index);

 private:
  Shape shape_;
  std::vector<std::int64_t> strides_;
  std::shared_ptr<float[]> buffer_;
  std::int64_t capacity_ = 0;
  std::int64_t offset_ = 0;
  bool slice_ = false;  ///< a slice of a larger buffer (or a reshape of one)
  Device device_;
};

/// Largest |a - b| / max(|a|, |b|, floor) over the elements; shapes must agree.
double max_relative_difference(const Tensor& a, const Tensor& b, double floor = 1e-6);

}  // namespace tessera
