#pragma once
// The GPU side of the box operations (tessera/tensor/box_ops.hpp): a region inside two tiles as
// flat offsets and per-dimension strides, which a kernel walks one element per thread. Free of
// C++20 so that nvcc compiles it in cuda_box_ops.cu.
#include <cstdint>

#if defined(__CUDACC__)
#define TESSERA_BOX_HOST_DEVICE __host__ __device__
#else
#define TESSERA_BOX_HOST_DEVICE
#endif

namespace tessera {
struct Box;
}

namespace tessera::detail {

constexpr int kBoxWalkRank = 6;

struct BoxWalk {
  int rank = 0;  ///< after merging the trailing dimensions that every box spans whole
  std::int64_t extent[kBoxWalkRank] = {};
  std::int64_t src_stride[kBoxWalkRank] = {};
  std::int64_t dst_stride[kBoxWalkRank] = {};
  std::int64_t src_offset = 0, dst_offset = 0, count = 0;
};

/// The walk of `region` inside dense tiles of `src_box` and `dst_box` (box_ops.cpp).
BoxWalk box_walk(const Box& region, const Box& src_box, const Box& dst_box);

/// Element `i` (row-major in the region) of a walk: its offsets in the source and destination.
TESSERA_BOX_HOST_DEVICE inline void walk_offsets(const BoxWalk& walk, std::int64_t i, std::int64_t& s,
                                                 std::int64_t& t) {
  s = walk.src_offset;
  t = walk.dst_offset;
  for (int d = walk.rank - 1; d >= 0; --d) {
    const std::int64_t index = i % walk.extent[d];
    i /= walk.extent[d];
    s += index * walk.src_stride[d];
    t += index * walk.dst_stride[d];
  }
}

enum class BoxOp { Copy, Add, Fill };

/// Queues `op` over `walk` on `device`'s stream (cuda_box_ops.cu; a build without CUDA refuses).
void cuda_box_op(BoxOp op, const BoxWalk& walk, const float* src, float* dst, float value, int device);

}  // namespace tessera::detail
