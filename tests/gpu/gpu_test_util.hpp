#pragma once
// Shared by the GPU tests: the comparison of a GPU result with the host's.
#include <algorithm>
#include <cmath>

#include "tessera/tensor/tensor.hpp"

namespace tessera {

/// Largest |host - gpu| relative to the largest magnitude of the host result: two correct fp32
/// backends sum in different orders, so an entry near zero of a long sum differs by ~1e-7 of the
/// sum's terms, not of itself.
inline double gpu_difference(const Tensor& reference, const Tensor& gpu) {
  const Tensor back = gpu.to(Device::host());
  float largest = 0.0f;
  for (std::int64_t i = 0; i < reference.numel(); ++i) largest = std::max(largest, std::fabs(reference.data()[i]));
  return max_relative_difference(reference, back, std::max<double>(largest, 1e-6));
}

}  // namespace tessera
