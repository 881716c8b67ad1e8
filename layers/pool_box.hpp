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
  /// Where outputs (and their gradients) lie: plane p's output (d, h, w) at p * out_planes +
  /// out_first + d * out_rows + h * out_row + w (dense: out_plane(), 0, out[1] * out[2], out[2]).
  std::int64_t out_planes = 0, out_first = 0, out_rows = 0, out_row = 0;
  std::int64_t in_plane() const { return in[0] * in[1] * in[2]; }
  std::int64_t out_plane() const { return out[0] * out[1] * out[2]; }
  /// Where plane p's output row (d, h) starts.
  std::int64_t out_at(std::int64_t p, std::int64_t d, std::int64_t h) const {
    return p * out_planes + out_first + d * out_rows + h * out_row;
  }
  bool dense_output() const {
    return out_planes == out_plane() && out_first == 0 && out_rows == out[1] * out[2] && out_row == out[2];
  }
};

PoolBox pool_box(const PoolingGeometry& geometry);

/// Bytes of the pooling kernels' workspace (host and CUDA alike): the position of each maximum
/// within its input plane as an int32 for max pooling, nothing for average pooling.
std::size_t pooling_workspace_bytes(const PoolingGeometry& geometry);

}  // namespace tessera
