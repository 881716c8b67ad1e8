#include "tessera/parallel/flat_pack.hpp"

#include <algorithm>

#include "tessera/core/error.hpp"

namespace tessera {

OnHost::OnHost(Tensor& tensor) : tensor_(tensor), host_(tensor.to(Device::host())) {
  if (!host_.is_contiguous()) fail("tensor of shape {} is not contiguous", host_.shape().to_string());
}

OnHost::~OnHost() {
  if (!tensor_.device().is_host()) tensor_.copy_from(host_);
}

std::int64_t total_elements(const std::vector<Tensor*>& tensors) {
  std::int64_t total = 0;
  for (const Tensor* t : tensors) total += t->numel();
  return total;
}

Tensor pack_flat(const std::vector<Tensor*>& tensors) {
  Tensor flat;
  pack_flat_into(tensors, flat);
  return flat;
}

void pack_flat_into(const std::vector<Tensor*>& tensors, Tensor& flat) {
  const std::int64_t total = total_elements(tensors);
  if (!flat.defined() || flat.numel() != total) flat = Tensor(Shape({total}));
  pack_flat_into(tensors, flat.data());
}

void pack_flat_into(const std::vector<Tensor*>& tensors, float* out) {
  std::int64_t at = 0;
  for (const Tensor* t : tensors) {
    const Tensor host = t->to(Device::host());
    const Tensor contiguous = host.is_contiguous() ? host : host.clone();
    std::copy(contiguous.data(), contiguous.data() + contiguous.numel(), out + at);
    at += t->numel();
  }
}

void unpack_flat(const float* flat, const std::vector<Tensor*>& tensors) {
  std::int64_t at = 0;
  for (Tensor* t : tensors) {
    OnHost v(*t);
    std::copy(flat + at, flat + at + t->numel(), v.data());
    at += t->numel();
  }
}

}  // namespace tessera
