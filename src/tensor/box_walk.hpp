#pragma once
// The GPU side of the box operations (tessera/tensor/box_ops.hpp): a region inside two tiles as
// flat offsets and per-dimension strides, which a kernel walks. Free of C++20 so that nvcc
// compiles it in cuda_box_ops.cu.
#include <cstdint>

namespace tessera::detail {

constexpr int kBoxWalkRank = 6;

struct BoxWalk {
  int rank = 0;
  std::int64_t extent[kBoxWalkRank] = {};
  std::int64_t src_stride[kBoxWalkRank] = {};
  std::int64_t dst_stride[kBoxWalkRank] = {};
  std::int64_t src_offset = 0, dst_offset = 0, count = 0;
};

enum class BoxOp { Copy, Add, Fill };

/// Queues `op` over `walk` on `device`'s stream (cuda_box_ops.cu; a build without CUDA refuses).
void cuda_box_op(BoxOp op, const BoxWalk& walk, const float* src, float* dst, float value, int device);

}  // namespace tessera::detail
