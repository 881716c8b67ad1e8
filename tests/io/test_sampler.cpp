// EpochSampler: the per-epoch order is a permutation, a pure function of (seed, epoch), and the
// batches tile it as documented.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "tessera/core/error.hpp"
#include "tessera/io/sampler.hpp"

namespace tessera {
namespace {

std::vector<std::int64_t> identity(std::int64_t n) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), std::int64_t{0});
  return v;
}

TEST(EpochSampler, ShuffledOrderIsAPermutation) {
  for (std::int64_t n : {1, 2, 7, 100, 1000}) {
    EpochSampler sampler({.dataset_size = n, .global_batch = 3, .seed = 9});
    for (std::int64_t epoch = 0; epoch < 3; ++epoch) {
      auto order = sampler.permutation(epoch);
      std::sort(order.begin(), order.end());
      EXPECT_EQ(order, identity(n)) << "n " << n << " epoch " << epoch;
    }
  }
}

TEST(EpochSampler, SameSeedSameOrderAcrossInstancesAndCallOrder) {
  EpochSampler a({.dataset_size = 500, .global_batch = 32, .seed = 1234});
  EpochSampler b({.dataset_size = 500, .global_batch = 32, .seed = 1234});
  // b visits epochs in another order: the cache must not change the answer.
  const auto b2 = b.permutation(2);
  const auto b0 = b.permutation(0);
  EXPECT_EQ(a.permutation(0), b0);
  EXPECT_EQ(a.permutation(2), b2);
  EXPECT_EQ(a.batch(2, 5), b.batch(2, 5));
  EpochSampler copy = a;
  EXPECT_EQ(copy.permutation(2), b2);
}

TEST(EpochSampler, EpochsAndSeedsShuffleDifferently) {
  EpochSampler a({.dataset_size = 1000, .global_batch = 10, .seed = 1});
  EpochSampler b({.dataset_size = 1000, .global_batch = 10, .seed = 2});
  EXPECT_NE(a.permutation(0), a.permutation(1));
  EXPECT_NE(a.permutation(0), b.permutation(0));
  EXPECT_NE(a.permutation(0), identity(1000));
  // Every sample is equally likely at the front: a crude check that positions are mixed.
  std::int64_t moved = 0;
  const auto order = a.permutation(0);
  for (std::int64_t i = 0; i < 1000; ++i) moved += order[static_cast<std::size_t>(i)] != i ? 1 : 0;
  EXPECT_GT(moved, 950);
}

TEST(EpochSampler, BatchesTileTheEpoch) {
  EpochSampler sampler({.dataset_size = 23, .global_batch = 5, .seed = 3});
  ASSERT_EQ(sampler.batches_per_epoch(), 5);
  std::vector<std::int64_t> joined;
  for (std::int64_t b = 0; b < 5; ++b) {
    const auto batch = sampler.batch(4, b);
    EXPECT_EQ(static_cast<std::int64_t>(batch.size()), b < 4 ? 5 : 3);
    joined.insert(joined.end(), batch.begin(), batch.end());
  }
  EXPECT_EQ(joined, sampler.permutation(4));
  EXPECT_THROW(sampler.batch(4, 5), Error);
}

TEST(EpochSampler, WithoutShuffleInOrderAndDropLast) {
  EpochSampler ordered({.dataset_size = 10, .global_batch = 4, .shuffle = false});
  EXPECT_EQ(ordered.batches_per_epoch(), 3);
  EXPECT_EQ(ordered.batch(7, 0), (std::vector<std::int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(ordered.batch(7, 2), (std::vector<std::int64_t>{8, 9}));
  EpochSampler dropping({.dataset_size = 10, .global_batch = 4, .shuffle = false, .drop_last = true});
  EXPECT_EQ(dropping.batches_per_epoch(), 2);
  EXPECT_EQ(dropping.batch(0, 1), (std::vector<std::int64_t>{4, 5, 6, 7}));
  EpochSampler exact({.dataset_size = 8, .global_batch = 4, .drop_last = true});
  EXPECT_EQ(exact.batches_per_epoch(), 2);
}

TEST(EpochSampler, RejectsBadOptions) {
  EXPECT_THROW(EpochSampler({.dataset_size = 10, .global_batch = 0}), InputError);
  EXPECT_THROW(EpochSampler({.dataset_size = -1, .global_batch = 1}), InputError);
  EXPECT_THROW(EpochSampler({.dataset_size = 3, .global_batch = 4, .drop_last = true}), InputError);
}

}  // namespace
}  // namespace tessera
