#include "tessera/parallel/tile_geometry.hpp"

namespace tessera {

LayerSplit normalised(LayerSplit split) {
  while (split.spatial.size() < 3) split.spatial.insert(split.spatial.begin(), 1);
  return split;
}

std::vector<int> layer_grid(const LayerSplit& split) {
  const LayerSplit s = normalised(split);
  return {s.sample, s.filter, s.channel, s.spatial[0], s.spatial[1], s.spatial[2]};
}

namespace {

/// Sets dimension `d` of `box` to part `part` of `parts` of `extent`.
void take_block(Box& box, std::size_t d, std::int64_t extent, int parts, int part) {
  box.begin[d] += block_begin(extent, parts, part);
  box.extent[d] = block_extent(extent, parts, part);
}

}  // namespace

Box sample_spatial_block(const LayerSplit& split, const Shape& shape, const std::vector<int>& coords) {
  const std::vector<int> grid = layer_grid(split);
  Box box;
  box.begin.assign(static_cast<std::size_t>(shape.rank()), 0);
  box.extent = shape.dims();
  take_block(box, 0, shape[0], grid[kSampleAxis], coords[kSampleAxis]);
  const int dims = shape.rank() - 2;
  for (int j = 0; j < dims; ++j) {
    const auto axis = static_cast<std::size_t>(spatial_axis(j, dims));
    take_block(box, static_cast<std::size_t>(j + 2), shape[j + 2], grid[axis], coords[axis]);
  }
  return box;
}

Box partial_box(const LayerSplit& split, const Shape& output, const std::vector<int>& coords) {
  Box box = sample_spatial_block(split, output, coords);
  if (split.filter > 1) take_block(box, 1, box.extent[1], split.filter, coords[kFilterAxis]);
  return box;
}

Box output_box(const LayerSplit& split, const Shape& output, const std::vector<int>& coords) {
  Box box = partial_box(split, output, coords);
  if (split.channel > 1) take_block(box, 1, box.extent[1], split.channel, coords[kChannelAxis]);
  return box;
}

Box input_box(const LayerSplit& split, bool model_splittable, const Shape& input, const Shape& output,
              const std::vector<SpatialWindow>& windows, const std::vector<int>& coords) {
  const Box out = partial_box(split, output, coords);
  Box box;
  box.begin.assign(static_cast<std::size_t>(input.rank()), 0);
  box.extent = input.dims();
  box.begin[0] = out.begin[0];
  box.extent[0] = out.extent[0];
  if (split.channel > 1) take_block(box, 1, input[1], split.channel, coords[kChannelAxis]);
  if (split.filter > 1 && !model_splittable) {
    box.begin[1] = out.begin[1];
    box.extent[1] = out.extent[1];
  }
  if (split.spatial_product() > 1) {
    for (int j = 0; j < input.rank() - 2; ++j) {
      const auto u = static_cast<std::size_t>(j + 2);
      const auto [first, last] = windows.at(static_cast<std::size_t>(j)).inputs(out.begin[u], out.begin[u] + out.extent[u]);
      box.begin[u] = first;
      box.extent[u] = last - first;
    }
  }
  return box;
}

}  // namespace tessera
