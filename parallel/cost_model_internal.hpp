#pragma once
// What the cost model's sources share: element size, intervals and blocks, allreduce time.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "tessera/parallel/machine.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/tile_geometry.hpp"
#include "tessera/tensor/box.hpp"

namespace tessera::cost_detail {

inline constexpr double kBytes = 4;  // fp32
/// Of a leaky ReLU running in place, the forward's share of its forward + backward time: 2 of the
/// 5 passes over its tensor (forward reads and writes it; backward reads the output and its
/// gradient and writes the input gradient).
inline constexpr double kFusedForwardShare = 2.0 / 5.0;
/// Of a max pooling of 2-wide windows (with the leaky ReLU before it fused into its backward) whose
/// forward and backward the convolution it reads does, the share of its forward + backward time
/// that goes: measured 0.8 (CosmoFlow 128^3's pool1 on the 2-core Zen 5 VM, 1 rank: 8.2 ms
/// forward and 5.8 ms backward; the convolution's forward pooling its rows 2.7 ms longer, its
/// backward-weights no longer).
inline constexpr double kPooledByConvolutionShare = 0.8;
/// Up to this many source tiles per rank an exchange is priced message by message (each on or
/// off the node); above, in aggregate.
inline constexpr double kListSources = 64;

/// A split's spatial parts, one per spatial dimension of a tensor with `dims` of them.
inline std::vector<int> spatial_parts(const LayerSplit& split, int dims) {
  const std::vector<int> grid = layer_grid(split);
  std::vector<int> parts;
  for (int j = 0; j < dims; ++j) parts.push_back(grid[static_cast<std::size_t>(spatial_axis(j, dims))]);
  return parts;
}

struct Interval {
  std::int64_t begin = 0, end = 0;
  std::int64_t size() const { return std::max<std::int64_t>(0, end - begin); }
};

inline Interval intersect(Interval a, Interval b) { return {std::max(a.begin, b.begin), std::min(a.end, b.end)}; }

inline Interval block(std::int64_t extent, int parts, int part) {
  const std::int64_t b = block_begin(extent, parts, part);
  return {b, b + block_extent(extent, parts, part)};
}

inline std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

/// allreduce of `bytes` over `p` ranks at one level.
inline double allreduce_time(const AlphaBeta& ab, int p, double bytes) {
  if (p <= 1) return 0;
  return 2.0 * std::ceil(std::log2(static_cast<double>(p))) * ab.alpha +
         2.0 * (p - 1.0) / p * bytes * ab.beta;
}

}  // namespace tessera::cost_detail
