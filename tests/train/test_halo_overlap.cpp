// split_at_halos: which outputs of a spatial tile read halo positions. Checked against a brute
// force over every output of tiles of 2-D and 3-D convolutions (stride, dilation, padding,
// asymmetric kernels) for ready ranges on either side, both sides and neither.
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/train/executor.hpp"
#include "tessera/train/halo_overlap.hpp"
#include "tessera/train/model.hpp"

namespace tessera {
namespace {

constexpr std::int64_t kLowest = std::numeric_limits<std::int64_t>::min();
constexpr std::int64_t kHighest = std::numeric_limits<std::int64_t>::max();

Model conv_model(const std::string& input, const std::string& conv) {
  return Model::parse("input: {shape: " + input + "}\nlayers:\n  - " + conv +
                          "\n  - {name: flatten, type: flatten}\n  - {name: fc, type: linear, out: 2}\n"
                          "loss: softmax_cross_entropy\n",
                      "halo_overlap_test");
}

/// Brute force: does output `o` (global, per dimension) read a position outside the ready ranges?
bool reads_halo(const Layer& layer, const std::vector<std::int64_t>& o, const std::vector<std::int64_t>& ready_begin,
                const std::vector<std::int64_t>& ready_end) {
  for (std::size_t d = 0; d < o.size(); ++d) {
    const auto [lo, hi] = layer.input_range(static_cast<int>(d), o[d], o[d] + 1);
    if (lo < ready_begin[d] || hi > ready_end[d]) return true;
  }
  return false;
}

/// Checks the split of tile [begin, begin + extent) against the brute force: the boundary boxes lie
/// in the tile, are disjoint and hold exactly the outputs that read a halo.
void check_split(const Layer& layer, const std::vector<std::int64_t>& ready_begin,
                 const std::vector<std::int64_t>& ready_end, const std::vector<std::int64_t>& begin,
                 const std::vector<std::int64_t>& extent) {
  const HaloSplit split = split_at_halos(layer, ready_begin, ready_end, begin, extent);
  const std::size_t dims = begin.size();
  std::int64_t total = 1;
  for (auto e : extent) total *= e;
  std::vector<int> covered(static_cast<std::size_t>(total), 0);
  for (const OutputRegion& r : split.boundary) {
    ASSERT_EQ(r.begin.size(), dims);
    std::int64_t count = 1;
    for (std::size_t d = 0; d < dims; ++d) {
      ASSERT_GE(r.begin[d], 0);
      ASSERT_GT(r.extent[d], 0);
      ASSERT_LE(r.begin[d] + r.extent[d], extent[d]);
      count *= r.extent[d];
    }
    for (std::int64_t i = 0; i < count; ++i) {
      std::int64_t rest = i, flat = 0;
      std::vector<std::int64_t> local(dims);
      for (std::size_t d = dims; d-- > 0;) {
        local[d] = r.begin[d] + rest % r.extent[d];
        rest /= r.extent[d];
      }
      for (std::size_t d = 0; d < dims; ++d) flat = flat * extent[d] + local[d];
      ++covered[static_cast<std::size_t>(flat)];
    }
  }
  std::int64_t halo_outputs = 0;
  for (std::int64_t flat = 0; flat < total; ++flat) {
    std::vector<std::int64_t> o(dims);
    std::int64_t rest = flat;
    for (std::size_t d = dims; d-- > 0;) {
      o[d] = begin[d] + rest % extent[d];
      rest /= extent[d];
    }
    const bool halo = reads_halo(layer, o, ready_begin, ready_end);
    halo_outputs += halo;
    if (split.interior) {
      EXPECT_EQ(covered[static_cast<std::size_t>(flat)], halo ? 1 : 0) << "output " << flat;
    }
  }
  EXPECT_EQ(split.interior, halo_outputs < total) << "halo outputs " << halo_outputs << " of " << total;
  if (split.interior) {
    EXPECT_NEAR(split.boundary_share, static_cast<double>(halo_outputs) / static_cast<double>(total), 1e-12);
  }
}

TEST(HaloSplit, MatchesTheBruteForceIn3d) {
  Model model = conv_model("[2, 20, 18, 17]", "{name: c, type: conv, filters: 2, kernel: [3, 5, 2], stride: [1, 2, 1], "
                                               "padding: [1, 2, 0], dilation: [2, 1, 1]}");
  const Layer& conv = *model.nodes()[0].layer;
  const Shape out = model.nodes()[0].output;  // [N, 2, D, H, W]
  // Tiles with their own input blocks: the ranges [lo, hi) per dimension, at the edges open.
  for (std::int64_t d0 : {0, 3, 7}) {
    for (std::int64_t h0 : {0, 2}) {
      const std::vector<std::int64_t> begin{d0, h0, 0};
      const std::vector<std::int64_t> extent{std::min<std::int64_t>(8, out[2] - d0), std::min<std::int64_t>(4, out[3] - h0),
                                             out[4]};
      for (int edges = 0; edges < 4; ++edges) {
        // The tile's own input block along D and H: what its outputs would read without halos.
        std::vector<std::int64_t> rb(3), re(3);
        for (std::size_t d = 0; d < 3; ++d) {
          const auto [lo, hi] = conv.input_range(static_cast<int>(d), begin[d], begin[d] + extent[d]);
          rb[d] = lo + 1;  // one position short on each side: the neighbours hold those
          re[d] = hi - 1;
        }
        rb[2] = kLowest;  // W is not split: all of it is ready
        re[2] = kHighest;
        if (edges & 1) rb[0] = kLowest;  // the global boundary: padding is ready
        if (edges & 2) re[1] = kHighest;
        SCOPED_TRACE(testing::Message() << "tile at D " << d0 << ", H " << h0 << ", edges " << edges);
        check_split(conv, rb, re, begin, extent);
      }
    }
  }
}

TEST(HaloSplit, MatchesTheBruteForceIn2dAndFindsNoInteriorInThinTiles) {
  Model model = conv_model("[1, 12, 9]", "{name: c, type: conv, filters: 2, kernel: 5, padding: 2}");
  const Layer& conv = *model.nodes()[0].layer;
  // A block of 4 rows whose outputs read 2 rows on each side: no output reads only its own rows.
  const HaloSplit thin = split_at_halos(conv, {4, kLowest}, {8, kHighest}, {4, 0}, {4, 9});
  EXPECT_FALSE(thin.interior);
  check_split(conv, {4, kLowest}, {8, kHighest}, {4, 0}, {4, 9});
  // At the top edge the same block has an interior of two rows.
  const HaloSplit edge = split_at_halos(conv, {kLowest, kLowest}, {4, kHighest}, {0, 0}, {4, 9});
  ASSERT_TRUE(edge.interior);
  ASSERT_EQ(edge.boundary.size(), 1u);
  EXPECT_EQ(edge.boundary[0].begin, (std::vector<std::int64_t>{2, 0}));
  EXPECT_EQ(edge.boundary[0].extent, (std::vector<std::int64_t>{2, 9}));
  EXPECT_DOUBLE_EQ(edge.boundary_share, 0.5);
  // Everything ready: no boundary.
  const HaloSplit all = split_at_halos(conv, {kLowest, kLowest}, {kHighest, kHighest}, {0, 0}, {12, 9});
  EXPECT_TRUE(all.interior);
  EXPECT_TRUE(all.boundary.empty());
  check_split(conv, {3, 2}, {10, 7}, {3, 2}, {7, 5});
}

TEST(HaloOverlapMode, ParsesItsNamesAndRefusesOthers) {
  EXPECT_EQ(parse_halo_overlap("auto"), HaloOverlap::Automatic);
  EXPECT_EQ(parse_halo_overlap("always"), HaloOverlap::Always);
  EXPECT_EQ(parse_halo_overlap("never"), HaloOverlap::Never);
  for (auto mode : {HaloOverlap::Automatic, HaloOverlap::Always, HaloOverlap::Never})
    EXPECT_EQ(parse_halo_overlap(to_string(mode)), mode);
  try {
    parse_halo_overlap("sometimes");
    FAIL() << "accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("auto, always or never"), std::string::npos) << e.what();
  }
}

TEST(GpuCommMode, ParsesItsNamesAndRefusesOthers) {
  EXPECT_EQ(parse_gpu_comm("auto"), ExecutorOptions::GpuComm::Automatic);
  EXPECT_EQ(parse_gpu_comm("nccl"), ExecutorOptions::GpuComm::Nccl);
  EXPECT_EQ(parse_gpu_comm("mpi"), ExecutorOptions::GpuComm::Mpi);
  try {
    parse_gpu_comm("gloo");
    FAIL() << "accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("auto, nccl or mpi"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera
