// The one kernel the core level needs: filling device memory with a value.
#include <cuda_runtime.h>

#include <algorithm>

#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"

namespace tessera::cuda {
namespace {
__global__ void fill_kernel(float* destination, std::int64_t count, float value) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    destination[i] = value;
}
}  // namespace

void fill(float* destination, std::int64_t count, float value) {
  if (count <= 0) return;
  auto* s = static_cast<cudaStream_t>(stream());
  if (value == 0.0f) {
    const cudaError_t status = cudaMemsetAsync(destination, 0, static_cast<std::size_t>(count) * sizeof(float), s);
    if (status != cudaSuccess) fail("CUDA: cudaMemsetAsync failed: {}", cudaGetErrorString(status));
    return;
  }
  const std::int64_t blocks = std::min<std::int64_t>((count + 255) / 256, 4096);
  fill_kernel<<<static_cast<unsigned>(blocks), 256, 0, s>>>(destination, count, value);
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) fail("CUDA: fill kernel launch failed: {}", cudaGetErrorString(status));
}

}  // namespace tessera::cuda
