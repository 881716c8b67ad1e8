#pragma once
// A pooling problem as the kernels (host and CUDA) see it: 2-D problems as 3-D ones of depth 1,
// so one loop nest serves both; a spatial tile gives the global position of local input and
// output element 0 and the global input extent, to which windows are clipped.
// Plain data, no library types: CUDA sources include it too.
#include <cstddef>
#include <cstdint>

namespace tessera {

struct PoolingGeometry;

struct PoolBox {
  std::int64_t planes = 0;  ///< samples x channels
  std::int64_t in[3], out[3], kernel[3], stride[3], padding[3];
  std::int64_t in_origin[3], limit[3], out_origin[3];
  std::int64_t in_plane() const { return in[0] * in[1] * in[2]; }
  std::int64_t out_plane() const { return out[0] * out[1] * out[2]; }
};

PoolBox pool_box(const PoolingGeometry& geometry);

/// Bytes of the pooling kernels' workspace (host and CUDA alike): the position of each maximum
/// within its input plane as an int32 for max pooling, nothing for average pooling.
std::size_t pooling_workspace_bytes(const PoolingGeometry& geometry);

}  // namespace tessera
