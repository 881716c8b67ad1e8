// Tile geometry by hand: the grid of a split, the blocks a rank holds and the windows it reads.
// The invariant tests (every plan equals the 1-rank run) and the planner's exact memory estimate
// are the proof that the executor and the cost model read the same boxes.
#include <gtest/gtest.h>

#include <set>

#include "tessera/parallel/tile_geometry.hpp"
#include "tessera/tensor/grid.hpp"

namespace tessera {
namespace {

LayerSplit split_of(int sample, int filter, int channel, std::vector<int> spatial) {
  LayerSplit s;
  s.sample = sample;
  s.filter = filter;
  s.channel = channel;
  s.spatial = std::move(spatial);
  return s;
}

std::int64_t cells(const Box& b) {
  std::int64_t n = 1;
  for (std::int64_t e : b.extent) n *= e;
  return n;
}

TEST(TileGeometry, AGridHasSixAxesWithTheSpatialPartsLast) {
  EXPECT_EQ(layer_grid(split_of(2, 3, 1, {4, 5})), (std::vector<int>{2, 3, 1, 1, 4, 5}));
  EXPECT_EQ(layer_grid(split_of(1, 1, 2, {})), (std::vector<int>{1, 1, 2, 1, 1, 1}));
  EXPECT_EQ(spatial_axis(0, 2), 4);
  EXPECT_EQ(spatial_axis(0, 3), kFirstSpatialAxis);
}

TEST(TileGeometry, OutputBoxesTileTheOutputOnceUnderEverySplit) {
  const Shape out = Shape::image(5, 6, {7, 9});
  for (const LayerSplit& s : {split_of(2, 1, 1, {}), split_of(1, 2, 2, {}), split_of(1, 1, 1, {3, 2}),
                              split_of(2, 3, 1, {2, 1}), split_of(1, 2, 3, {})}) {
    SCOPED_TRACE(s.to_string());
    const std::vector<int> grid = layer_grid(s);
    std::set<std::vector<std::int64_t>> seen;
    std::int64_t total = 0;
    for (int r = 0; r < s.product(); ++r) {
      const Box b = output_box(s, out, grid_coords(grid, r));
      total += cells(b);
      seen.insert(b.begin);
      // Under a channel split, each rank's box lies in the partial box its channel group shares.
      const Box p = partial_box(s, out, grid_coords(grid, r));
      EXPECT_GE(b.begin[1], p.begin[1]);
      EXPECT_LE(b.begin[1] + b.extent[1], p.begin[1] + p.extent[1]);
    }
    EXPECT_EQ(total, out.numel()) << "every element held once";
    EXPECT_EQ(static_cast<int>(seen.size()), s.product());
  }
}

TEST(TileGeometry, UnevenBlocksAndSpatialWindowsWithHalos) {
  // 5 samples over 2 ranks: [0, 2) and [2, 5); 16 rows over 2 slabs read by a 3 x 3 convolution
  // with padding 1: rows [-1, 9) and [7, 17), the padding included.
  const LayerSplit s = split_of(2, 1, 1, {2, 1});
  const Shape in = Shape::image(5, 3, {16, 8}), out = Shape::image(5, 4, {16, 8});
  const std::vector<SpatialWindow> windows{{3, 1, 1}, {3, 1, 1}};
  const std::vector<int> grid = layer_grid(s);
  const Box first = input_box(s, true, in, out, windows, grid_coords(grid, 0));
  const Box last = input_box(s, true, in, out, windows, grid_coords(grid, 3));
  EXPECT_EQ(first.begin, (std::vector<std::int64_t>{0, 0, -1, -1}));
  EXPECT_EQ(first.extent, (std::vector<std::int64_t>{2, 3, 10, 10}));
  EXPECT_EQ(last.begin, (std::vector<std::int64_t>{2, 0, 7, -1}));
  EXPECT_EQ(last.extent, (std::vector<std::int64_t>{3, 3, 10, 10}));
  // Not split spatially: the whole extent, no window.
  const Box whole = input_box(split_of(2, 1, 1, {}), true, in, out, windows, {1, 0, 0, 0, 0, 0});
  EXPECT_EQ(whole.begin, (std::vector<std::int64_t>{2, 0, 0, 0}));
  EXPECT_EQ(whole.extent, (std::vector<std::int64_t>{3, 3, 16, 8}));
  // An empty range reads nothing.
  EXPECT_EQ(SpatialWindow({3, 2, 1}).inputs(4, 4), (std::pair<std::int64_t, std::int64_t>{7, 7}));
}

TEST(TileGeometry, ChannelAndFilterSplitsReadTheirChannels) {
  const Shape in = Shape::flat(4, 10), out = Shape::flat(4, 6);
  const LayerSplit s = split_of(1, 2, 2, {});
  const std::vector<int> grid = layer_grid(s);
  // Rank (filter 1, channel 1): input channels [5, 10), partial sums of filters [3, 6), of which it
  // holds [3 + 1, 6) once reduced (the filter block [3, 6) split over 2 channel ranks: 1 and 2).
  const std::vector<int> c = grid_coords(grid, 3);
  EXPECT_EQ(input_box(s, true, in, out, {}, c).begin[1], 5);
  EXPECT_EQ(input_box(s, true, in, out, {}, c).extent[1], 5);
  EXPECT_EQ(partial_box(s, out, c).begin[1], 3);
  EXPECT_EQ(partial_box(s, out, c).extent[1], 3);
  EXPECT_EQ(output_box(s, out, c).begin[1], 4);
  EXPECT_EQ(output_box(s, out, c).extent[1], 2);
  // A point-wise layer split by filter reads the channels it writes; a weight layer reads all.
  const LayerSplit f = split_of(1, 2, 1, {});
  EXPECT_EQ(input_box(f, false, out, out, {}, grid_coords(layer_grid(f), 1)).begin[1], 3);
  EXPECT_EQ(input_box(f, true, in, out, {}, grid_coords(layer_grid(f), 1)).extent[1], 10);
}

}  // namespace
}  // namespace tessera
