// The GPU side of the box operations (tessera/tensor/box_ops.hpp): one thread per element of the
// region, its multi-index decomposed against the region's extents.
#include <cuda_runtime.h>

#include <algorithm>

#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "box_walk.hpp"

namespace tessera::detail {
namespace {

__global__ void box_kernel(BoxOp op, BoxWalk walk, const float* src, float* dst, float value) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < walk.count;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::int64_t s, t;
    walk_offsets(walk, i, s, t);
    if (op == BoxOp::Copy) dst[t] = src[s];
    else if (op == BoxOp::Add) dst[t] += src[s];
    else dst[t] = value;
  }
}

}  // namespace

void cuda_box_op(BoxOp op, const BoxWalk& walk, const float* src, float* dst, float value, int device) {
  if (walk.count == 0) return;
  cuda::set_device(device);
  constexpr int kThreads = 256;
  const std::int64_t blocks = std::min<std::int64_t>((walk.count + kThreads - 1) / kThreads, 65535 * 16);
  box_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(cuda::stream())>>>(op, walk, src,
                                                                                                     dst, value);
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) fail("CUDA: launch of the box kernel failed: {}", cudaGetErrorString(status));
}

}  // namespace tessera::detail
