#pragma once
// Tile geometry: the box of each tensor a rank holds or reads under a layer's split. Pure
// functions of (split, shapes, spatial windows, grid coordinates), shared by the executor, the
// planner's cost model and the layers, so that what runs and what is priced are the same tiles.
#include <cstdint>
#include <utility>
#include <vector>

#include "tessera/parallel/plan.hpp"
#include "tessera/tensor/box.hpp"
#include "tessera/tensor/shape.hpp"

namespace tessera {

/// Axes of a layer's processor grid [sample, filter, channel, D, H, W] (row-major: W varies fastest).
constexpr int kSampleAxis = 0, kFilterAxis = 1, kChannelAxis = 2, kFirstSpatialAxis = 3;

/// The grid axis of spatial dimension `j` of a tensor with `dims` spatial dimensions.
constexpr int spatial_axis(int j, int dims) { return kFirstSpatialAxis + (3 - dims) + j; }

/// The split with its spatial parts as three entries (D, H, W); 2-D layers have D = 1.
LayerSplit normalised(LayerSplit split);

/// A layer's processor grid [sample, filter, channel, D, H, W] under `split`.
std::vector<int> layer_grid(const LayerSplit& split);

/// The footprint of a layer's output positions along one spatial dimension: output i reads
/// inputs [i * stride - pad, i * stride - pad + kernel).
struct SpatialWindow {
  std::int64_t kernel = 1, stride = 1, pad = 0;
  /// The inputs [first, last) that outputs [begin, end) read (may reach into the padding).
  std::pair<std::int64_t, std::int64_t> inputs(std::int64_t begin, std::int64_t end) const {
    const std::int64_t first = begin * stride - pad;
    return {first, end <= begin ? first : (end - 1) * stride - pad + kernel};
  }
  bool operator==(const SpatialWindow&) const = default;
};

/// The block of a tensor of `shape` (dimension 0: the batch) held at grid coordinates `coords`
/// under the sample and spatial parts of `split`; the other dimensions whole.
Box sample_spatial_block(const LayerSplit& split, const Shape& shape, const std::vector<int>& coords);

/// The box of a layer's output it computes at `coords`: its sample and spatial block, and its
/// filter block of the channels (under a channel split, partial sums of that box).
Box partial_box(const LayerSplit& split, const Shape& output, const std::vector<int>& coords);

/// The box of a layer's output held at `coords`: partial_box, and under a channel split the
/// channel rank's sub-block of its channels (where the reduce-scatter of the partial sums puts it).
Box output_box(const LayerSplit& split, const Shape& output, const std::vector<int>& coords);

/// The box of an input of shape `input` a layer reads at `coords`: the samples of its output box;
/// its block of the input channels under a channel split, the channels it writes for a layer
/// that is not model-splittable under a filter split (point-wise), else all; along each spatial
/// dimension of a layer split spatially its window (`windows`), padding included, else all.
Box input_box(const LayerSplit& split, bool model_splittable, const Shape& input, const Shape& output,
              const std::vector<SpatialWindow>& windows, const std::vector<int>& coords);

}  // namespace tessera
