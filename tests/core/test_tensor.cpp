// Tensor level, without MPI: Shape, the local Tensor, uneven blocks and grid arithmetic.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tensor/box_walk.hpp"
#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/tensor/box_ops.hpp"
#include "tessera/tensor/box.hpp"
#include "tessera/tensor/grid.hpp"
#include "tessera/tensor/shape.hpp"
#include "tessera/tensor/tensor.hpp"

namespace tessera {
namespace {

using Dims = std::vector<std::int64_t>;

/// Runs `body`, expects it to throw exactly an `E` (or subclass) whose message contains `needle`.
template <typename E>
void expect_throw_containing(const std::function<void()>& body, const std::string& needle) {
  try {
    body();
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message '" << e.what() << "' lacks '" << needle << "'";
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw another type: " << e.what();
    return;
  }
  ADD_FAILURE() << "did not throw (expected a message with '" << needle << "')";
}

// ---------------------------------------------------------------------------------------------
// Shape

TEST(Shape, ImageKindsAndCounts) {
  const Shape s = Shape::image(4, 3, {5, 6});
  EXPECT_EQ(s.rank(), 4);
  EXPECT_EQ(s.dims(), (Dims{4, 3, 5, 6}));
  EXPECT_EQ(s.kinds(),
            (std::vector<DimKind>{DimKind::Sample, DimKind::Channel, DimKind::Spatial, DimKind::Spatial}));
  EXPECT_EQ(s.numel(), 4 * 3 * 5 * 6);
  EXPECT_EQ(s.sample_numel(), 3 * 5 * 6);
  EXPECT_EQ(s.spatial_dims(), 2);
  EXPECT_EQ(s.to_string(), "[4, 3, 5, 6]");

  const Shape volume = Shape::image(2, 1, {8, 8, 8});
  EXPECT_EQ(volume.spatial_dims(), 3);
  EXPECT_EQ(volume.kind(4), DimKind::Spatial);
  EXPECT_EQ(volume.numel(), 2 * 512);
}

TEST(Shape, FlatAndPlain) {
  const Shape f = Shape::flat(16, 10);
  EXPECT_EQ(f.kinds(), (std::vector<DimKind>{DimKind::Sample, DimKind::Feature}));
  EXPECT_EQ(f.numel(), 160);
  EXPECT_EQ(f.sample_numel(), 10);
  EXPECT_EQ(f.spatial_dims(), 0);

  const Shape plain{2, 3, 4};
  EXPECT_EQ(plain.kinds(), (std::vector<DimKind>(3, DimKind::Any)));
  EXPECT_EQ(plain.numel(), 24);
  EXPECT_EQ(plain.spatial_dims(), 0);

  EXPECT_EQ(Shape().rank(), 0);
  EXPECT_EQ(Shape().numel(), 1);  // the empty product: a scalar
  EXPECT_EQ(Shape({5, 0, 2}).numel(), 0);
  EXPECT_STREQ(dim_kind_name(DimKind::Spatial), "spatial");
  EXPECT_STREQ(dim_kind_name(DimKind::Sample), "sample");
}

TEST(Shape, WithChangesOneDimensionAndKeepsKinds) {
  const Shape s = Shape::image(8, 3, {32, 32});
  const Shape t = s.with(0, 2);
  EXPECT_EQ(t.dims(), (Dims{2, 3, 32, 32}));
  EXPECT_EQ(t.kinds(), s.kinds());
  EXPECT_EQ(s.dims(), (Dims{8, 3, 32, 32}));  // the original is untouched
  EXPECT_EQ(s.with(3, 7)[3], 7);
  EXPECT_THROW((void)s.with(4, 1), std::out_of_range);
}

TEST(Shape, BadConstructions) {
  expect_throw_containing<Error>([] { (void)Shape({2, 3}, {DimKind::Sample}); }, "2 extents but 1 dimension kinds");
  expect_throw_containing<Error>([] { (void)Shape({2, -1}); }, "negative extent -1");
}

// ---------------------------------------------------------------------------------------------
// Tensor

Tensor iota(const Shape& shape) {
  Tensor t(shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data()[i] = static_cast<float>(i);
  return t;
}

TEST(Tensor, ZeroInitializedAndContiguous) {
  Tensor t(Shape({3, 4, 5}));
  EXPECT_TRUE(t.defined());
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.strides(), (Dims{20, 5, 1}));
  EXPECT_EQ(t.numel(), 60);
  EXPECT_EQ(t.allocated_bytes(), 60 * 4);
  for (std::int64_t i = 0; i < t.numel(); ++i) ASSERT_EQ(t.data()[i], 0.0f) << i;
  EXPECT_FALSE(Tensor().defined());
  EXPECT_EQ(Tensor().data(), nullptr);
}

TEST(Tensor, AtUsesRowMajorStrides) {
  Tensor t = iota(Shape({2, 3, 4}));
  EXPECT_EQ(t.at({0, 0, 0}), 0.0f);
  EXPECT_EQ(t.at({1, 2, 3}), 23.0f);
  EXPECT_EQ(t.at({1, 0, 2}), 14.0f);
  t.at({0, 1, 1}) = -7.0f;
  EXPECT_EQ(t.data()[5], -7.0f);
  EXPECT_THROW((void)t.at({2, 0, 0}), Error);
  EXPECT_THROW((void)t.at({0, 0}), Error);
  EXPECT_THROW((void)t.at({0, -1, 0}), Error);
}

TEST(Tensor, SliceSharesMemory) {
  Tensor t = iota(Shape({4, 3}));
  Tensor s = t.slice(1, 3);
  EXPECT_EQ(s.shape().dims(), (Dims{2, 3}));
  EXPECT_EQ(s.data(), t.data() + 3);
  EXPECT_EQ(s.at({0, 0}), 3.0f);
  EXPECT_EQ(s.at({1, 2}), 8.0f);
  s.at({1, 1}) = 100.0f;
  EXPECT_EQ(t.at({2, 1}), 100.0f);
  s.fill(-1.0f);
  EXPECT_EQ(t.at({0, 2}), 2.0f);  // rows outside the slice are untouched
  EXPECT_EQ(t.at({1, 0}), -1.0f);
  EXPECT_EQ(t.at({2, 2}), -1.0f);
  EXPECT_EQ(t.at({3, 0}), 9.0f);
  // A slice of a slice.
  Tensor ss = s.slice(1, 2);
  EXPECT_EQ(ss.data(), t.data() + 6);
  EXPECT_EQ(t.slice(4, 4).numel(), 0);
  EXPECT_THROW((void)t.slice(2, 5), Error);
  EXPECT_THROW((void)t.slice(3, 2), Error);
}

TEST(Tensor, ReshapeSharesMemory) {
  Tensor t = iota(Shape({2, 6}));
  Tensor r = t.reshape(Shape::image(2, 1, {2, 3}));
  EXPECT_EQ(r.data(), t.data());
  EXPECT_EQ(r.shape().kind(2), DimKind::Spatial);
  EXPECT_EQ(r.strides(), (Dims{6, 6, 3, 1}));
  EXPECT_EQ(r.at({1, 0, 1, 2}), 11.0f);
  r.at({0, 0, 1, 0}) = 42.0f;
  EXPECT_EQ(t.at({0, 3}), 42.0f);
  EXPECT_THROW((void)t.reshape(Shape({5, 2})), Error);
}

TEST(Tensor, CloneIsDeep) {
  Tensor t = iota(Shape({3, 2}));
  Tensor c = t.clone();
  EXPECT_NE(c.data(), t.data());
  EXPECT_EQ(c.shape().dims(), t.shape().dims());
  EXPECT_EQ(max_relative_difference(c, t), 0.0);
  c.at({2, 1}) = 99.0f;
  EXPECT_EQ(t.at({2, 1}), 5.0f);
  // Clone of a slice copies only the slice.
  Tensor cs = t.slice(1, 2).clone();
  EXPECT_EQ(cs.numel(), 2);
  EXPECT_EQ(cs.at({0, 0}), 2.0f);
  EXPECT_EQ(cs.allocated_bytes(), 2 * 4);
}

TEST(Tensor, CopyFromChecksShape) {
  Tensor a = iota(Shape({2, 3}));
  Tensor b(Shape({2, 3}));
  b.copy_from(a);
  EXPECT_EQ(b.at({1, 2}), 5.0f);
  Tensor wrong(Shape({3, 2}));
  EXPECT_THROW(wrong.copy_from(a), Error);
}

TEST(Tensor, ResizeKeepsMemoryWhenTheSizeIsTheSame) {
  Tensor t = iota(Shape({4, 6}));
  Tensor alias = t;  // shares the buffer
  const float* before = t.data();
  t.resize(Shape({2, 12}));
  EXPECT_EQ(t.data(), before);
  EXPECT_EQ(t.shape().dims(), (Dims{2, 12}));
  EXPECT_EQ(t.strides(), (Dims{12, 1}));
  EXPECT_EQ(t.at({1, 11}), 23.0f);  // values kept
  t.at({0, 0}) = -5.0f;
  EXPECT_EQ(alias.at({0, 0}), -5.0f);  // the alias still sees the same memory
}

TEST(Tensor, ResizeSmallerKeepsCapacityLargerReallocates) {
  Tensor t(Shape({10}));
  const float* before = t.data();
  t.resize(Shape({4}));
  EXPECT_EQ(t.data(), before);
  EXPECT_EQ(t.numel(), 4);
  EXPECT_EQ(t.allocated_bytes(), 10 * 4);
  t.resize(Shape({10}));  // back within capacity
  EXPECT_EQ(t.data(), before);
  t.fill(3.0f);
  t.resize(Shape({20}));
  EXPECT_EQ(t.numel(), 20);
  EXPECT_EQ(t.allocated_bytes(), 20 * 4);
  for (std::int64_t i = 0; i < 20; ++i) ASSERT_EQ(t.data()[i], 0.0f);  // a fresh zeroed buffer
  Tensor empty;
  empty.resize(Shape({3, 3}));
  EXPECT_EQ(empty.numel(), 9);
  EXPECT_NE(empty.data(), nullptr);
}

// A slice never grows or shrinks into the rest of its buffer (the executor's arena of views,
// where the rest belongs to other tensors): another count gives it a buffer of its own.
TEST(Tensor, ResizingASliceToAnotherCountDetachesIt) {
  Tensor whole = iota(Shape({12}));
  Tensor first = whole.slice(0, 4).reshape(Shape({2, 2}));
  const float* before = first.data();
  first.resize(Shape({4}));  // the same count: still the view
  EXPECT_EQ(first.data(), before);
  first.resize(Shape({8}));  // within the buffer's capacity, but past the slice
  EXPECT_NE(first.data(), before);
  first.fill(-1.0f);
  for (std::int64_t i = 0; i < 12; ++i) ASSERT_EQ(whole.data()[i], static_cast<float>(i));  // untouched
  Tensor middle = whole.slice(4, 8);
  middle.resize(Shape({2}));
  EXPECT_NE(middle.data(), whole.data() + 4);
  EXPECT_EQ(middle.numel(), 2);
}

TEST(Tensor, MaxRelativeDifference) {
  Tensor a(Shape({3})), b(Shape({3}));
  a.data()[0] = 1.0f; b.data()[0] = 1.0f;
  a.data()[1] = 2.0f; b.data()[1] = 2.2f;
  a.data()[2] = 0.0f; b.data()[2] = 0.0f;
  EXPECT_NEAR(max_relative_difference(a, b), 0.2 / 2.2, 1e-6);
  b.data()[2] = NAN;
  EXPECT_TRUE(std::isinf(max_relative_difference(a, b)));
  EXPECT_THROW((void)max_relative_difference(a, Tensor(Shape({4}))), Error);
}

// ---------------------------------------------------------------------------------------------
// Blocks

TEST(Blocks, TenOverThree) {
  EXPECT_EQ(block_begin(10, 3, 0), 0);
  EXPECT_EQ(block_begin(10, 3, 1), 3);
  EXPECT_EQ(block_begin(10, 3, 2), 6);
  EXPECT_EQ(block_begin(10, 3, 3), 10);
  EXPECT_EQ(block_extent(10, 3, 0), 3);
  EXPECT_EQ(block_extent(10, 3, 1), 3);
  EXPECT_EQ(block_extent(10, 3, 2), 4);
}

TEST(Blocks, UnevenSplitsTileTheExtent) {
  for (std::int64_t extent : {1, 2, 5, 7, 10, 31, 64, 100, 1000003}) {
    for (int parts = 1; parts <= 17 && parts <= extent; ++parts) {
      std::int64_t sum = 0, lo = extent, hi = 0;
      for (int p = 0; p < parts; ++p) {
        EXPECT_EQ(block_begin(extent, parts, p), sum) << extent << "/" << parts << " part " << p;
        const auto e = block_extent(extent, parts, p);
        sum += e;
        lo = std::min(lo, e);
        hi = std::max(hi, e);
      }
      EXPECT_EQ(sum, extent) << extent << "/" << parts;
      EXPECT_LE(hi - lo, 1) << extent << "/" << parts;
      EXPECT_GE(lo, 1) << extent << "/" << parts;
    }
  }
}

TEST(Blocks, NoOverflowForLargeExtents) {
  const std::int64_t extent = std::int64_t{1} << 40;
  EXPECT_EQ(block_begin(extent, 4096, 4095), extent / 4096 * 4095);
  EXPECT_EQ(block_extent(extent, 4096, 17), extent / 4096);
}

TEST(Grid, CoordinatesAreRowMajorAndInvertible) {
  const std::vector<int> grid{2, 1, 3};
  EXPECT_EQ(grid_coords(grid, 0), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(grid_coords(grid, 4), (std::vector<int>{1, 0, 1}));
  for (int r = 0; r < 6; ++r) EXPECT_EQ(grid_rank(grid, grid_coords(grid, r)), r);
}

/// Row-major flat index of global point `p` in a tile of `box`.
std::int64_t flat_in(const Box& box, const std::vector<std::int64_t>& p) {
  std::int64_t index = 0;
  for (std::size_t d = 0; d < p.size(); ++d) index = index * box.extent[d] + (p[d] - box.begin[d]);
  return index;
}

/// Calls fn(point) for every point of `box` in row-major order.
void for_each_point(const Box& box, const std::function<void(const std::vector<std::int64_t>&)>& fn) {
  if (box.numel() == 0) return;
  std::vector<std::int64_t> p = box.begin;
  while (true) {
    fn(p);
    int d = static_cast<int>(p.size()) - 1;
    for (; d >= 0; --d) {
      const auto i = static_cast<std::size_t>(d);
      if (++p[i] < box.begin[i] + box.extent[i]) break;
      p[i] = box.begin[i];
    }
    if (d < 0) return;
  }
}

TEST(BoxOps, CopyAddAndFillTouchExactlyTheRegion) {
  // Regions of 1 to 6 dimensions inside two tiles of other boxes, some spanning whole trailing
  // dimensions (merged runs), some strips of one element, the last 30 with runs of up to 40
  // elements (the fixed-length loops and the library copy): against a point-by-point walk.
  std::uint64_t state = 12345;
  auto next = [&](std::int64_t bound) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<std::int64_t>((state >> 33) % static_cast<std::uint64_t>(bound));
  };
  for (int trial = 0; trial < 90; ++trial) {
    const bool long_runs = trial >= 60;
    const int rank = long_runs ? 1 + trial % 3 : 1 + trial % kMaxBoxRank;
    Box region, src_box, dst_box;
    for (int d = 0; d < rank; ++d) {
      const std::int64_t extent = 1 + (long_runs && d == rank - 1 ? next(40) : next(rank > 4 ? 3 : 5));
      const std::int64_t begin = next(4);
      region.begin.push_back(begin);
      region.extent.push_back(extent);
      // Tiles that hold the region, with margins (none in some trailing dimensions: merged runs).
      const bool tight = trial % 3 == 0 && d >= rank / 2;
      const std::int64_t before_src = tight ? 0 : next(3), after_src = tight ? 0 : next(3);
      const std::int64_t before_dst = tight ? 0 : next(3), after_dst = tight ? 0 : next(3);
      src_box.begin.push_back(begin - before_src);
      src_box.extent.push_back(extent + before_src + after_src);
      dst_box.begin.push_back(begin - before_dst);
      dst_box.extent.push_back(extent + before_dst + after_dst);
    }
    std::vector<float> src(static_cast<std::size_t>(src_box.numel())), dst(static_cast<std::size_t>(dst_box.numel()));
    for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i) + 0.5f;
    for (std::size_t i = 0; i < dst.size(); ++i) dst[i] = -static_cast<float>(i);
    std::vector<float> copied = dst, added = dst, filled = dst;
    copy_box(region, src.data(), src_box, copied.data(), dst_box);
    add_box(region, src.data(), src_box, added.data(), dst_box);
    fill_box(region, filled.data(), dst_box, 7.0f);
    // The walk the GPU kernel takes (merged trailing dimensions, one element per thread).
    const detail::BoxWalk walk = detail::box_walk(region, src_box, dst_box);
    EXPECT_EQ(walk.count, region.numel());
    std::vector<float> walked = dst;
    for (std::int64_t i = 0; i < walk.count; ++i) {
      std::int64_t s = 0, t = 0;
      detail::walk_offsets(walk, i, s, t);
      walked[static_cast<std::size_t>(t)] = src[static_cast<std::size_t>(s)];
    }
    EXPECT_EQ(walked, copied) << "trial " << trial << ": the GPU walk over " << walk.rank << " merged dimensions";
    if (trial % 3 == 0 && rank >= 2) {
      EXPECT_LT(walk.rank, rank) << "tight tiles: trailing dimensions merge";
    }
    std::vector<float> want_copy = dst, want_add = dst, want_fill = dst;
    for_each_point(region, [&](const std::vector<std::int64_t>& p) {
      const auto s = static_cast<std::size_t>(flat_in(src_box, p)), t = static_cast<std::size_t>(flat_in(dst_box, p));
      want_copy[t] = src[s];
      want_add[t] = dst[t] + src[s];
      want_fill[t] = 7.0f;
    });
    EXPECT_EQ(copied, want_copy) << "trial " << trial;
    EXPECT_EQ(added, want_add) << "trial " << trial;
    EXPECT_EQ(filled, want_fill) << "trial " << trial;
  }
}

TEST(BoxOps, OnAGpuWhereThereIsNoneAreRefusedWithTheReason) {
  // Where a GPU exists, gpu.kernels runs the GPU box operations against these host ones.
  if (cuda::device_count() > 0) return;
  const Box box{{0}, {2}};
  std::vector<float> a(2), b(2);
  try {
    copy_box(box, a.data(), box, b.data(), box, Device::cuda(0));
    ADD_FAILURE() << "a GPU box copy ran without a GPU";
  } catch (const Error& e) {
    // Built without CUDA, or with CUDA and no visible device: either way the message says CUDA.
    EXPECT_NE(std::string(e.what()).find("CUDA"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera
