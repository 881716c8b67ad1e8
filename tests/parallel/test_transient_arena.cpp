// The arena of a training step's transients (transient_arena.hpp): the layout against its
// definition (no two buffers alive at a common time overlap, aligned, at least the most bytes
// alive at once) on random buffers, and the lifetimes transient_arena gives a layer graph's
// outputs, copies, partial sums and gradients, checked by hand.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/parallel/transient_arena.hpp"

namespace tessera {
namespace {

constexpr std::int64_t kUnit = kArenaAlignment;

/// A buffer alive from step `first` to step `last` (TransientArena's times are half-steps).
ArenaBuffer steps(std::int64_t size, int first, int last) { return {size, 2 * first, 2 * last}; }

/// The most bytes alive at any one time.
std::int64_t most_alive(const std::vector<ArenaBuffer>& buffers) {
  std::int64_t most = 0;
  for (const ArenaBuffer& at : buffers)
    for (int t = at.first; t <= at.last; ++t) {
      std::int64_t alive = 0;
      for (const ArenaBuffer& b : buffers)
        if (b.first <= t && t <= b.last) alive += b.size;
      most = std::max(most, alive);
    }
  return most;
}

void expect_valid(const std::vector<ArenaBuffer>& buffers, const ArenaLayout& layout, std::int64_t alignment) {
  ASSERT_EQ(layout.offsets.size(), buffers.size());
  EXPECT_EQ(layout.size % alignment, 0);
  std::int64_t sum = 0;
  for (std::size_t a = 0; a < buffers.size(); ++a) {
    sum += buffers[a].size;
    EXPECT_EQ(layout.offsets[a] % alignment, 0) << "buffer " << a;
    EXPECT_GE(layout.offsets[a], 0);
    EXPECT_LE(layout.offsets[a] + buffers[a].size, layout.size) << "buffer " << a;
    for (std::size_t b = a + 1; b < buffers.size(); ++b) {
      const bool together = buffers[a].first <= buffers[b].last && buffers[b].first <= buffers[a].last;
      const bool apart = layout.offsets[a] + buffers[a].size <= layout.offsets[b] ||
                         layout.offsets[b] + buffers[b].size <= layout.offsets[a];
      if (together && buffers[a].size > 0 && buffers[b].size > 0) {
        EXPECT_TRUE(apart) << "buffers " << a << " and " << b << " are alive together and overlap";
      }
    }
  }
  EXPECT_GE(layout.size, most_alive(buffers));
  EXPECT_LE(layout.size, sum + static_cast<std::int64_t>(buffers.size()) * alignment);
}

TEST(ArenaLayout, BuffersAliveTogetherNeverOverlap) {
  std::mt19937 random(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int count = 1 + static_cast<int>(random() % 40);
    std::vector<ArenaBuffer> buffers;
    for (int b = 0; b < count; ++b) {
      const int first = static_cast<int>(random() % 30);
      buffers.push_back({static_cast<std::int64_t>(random() % 5000), first, first + static_cast<int>(random() % 8)});
    }
    const std::int64_t alignment = trial % 2 ? 1 : 256;
    const ArenaLayout layout = lay_out_arena(buffers, alignment);
    expect_valid(buffers, layout, alignment);
    const ArenaLayout again = lay_out_arena(buffers, alignment);
    EXPECT_EQ(again.offsets, layout.offsets) << "the layout must be deterministic";
  }
}

TEST(ArenaLayout, ReusesWhatIsDeadAndRefusesNonsense) {
  // Three buffers that never live together fit in the largest; two that do, side by side.
  EXPECT_EQ(lay_out_arena({{3 * kUnit, 0, 0}, {2 * kUnit, 1, 1}, {kUnit, 2, 2}}, kUnit).size, 3 * kUnit);
  EXPECT_EQ(lay_out_arena({{3 * kUnit, 0, 1}, {2 * kUnit, 1, 2}}, kUnit).size, 5 * kUnit);
  EXPECT_EQ(lay_out_arena({}, kUnit).size, 0);
  EXPECT_EQ(lay_out_arena({{0, 0, 5}}, kUnit).size, 0);
  EXPECT_THROW(lay_out_arena({{kUnit, 2, 1}}, kUnit), Error);
  EXPECT_THROW(lay_out_arena({{-1, 0, 1}}, kUnit), Error);
  EXPECT_THROW(lay_out_arena({{kUnit, 0, 1}}, 0), Error);
}

/// conv -> act (in place) -> pool -> flatten -> fc, the loss on fc: sizes in units.
TransientGraph chain() {
  TransientGraph g;
  g.inputs = {{-1}, {0}, {1}, {2}, {3}};
  g.in_place = {false, true, false, false, false};
  g.output = 4;
  g.output_bytes = {8 * kUnit, 8 * kUnit, 2 * kUnit, 2 * kUnit, kUnit};
  g.released = {false, false, false, false, false};
  g.input_copy_bytes = {{0}, {0}, {0}, {0}, {0}};
  g.partial_bytes = {0, 0, 0, 0, 0};
  return g;
}

/// The buffers of `arena` rebuilt from their expected lifetimes, in its numbering: `expected`,
/// and the chain's tail (pool, flatten and fc: their outputs and gradients), the same in every
/// variant of chain() here.
std::vector<ArenaBuffer> expected_buffers(const TransientArena& arena,
                                          std::vector<std::pair<std::size_t, ArenaBuffer>> expected) {
  expected.insert(expected.end(), {{arena.output[2], steps(2 * kUnit, 2, 7)},
                                   {arena.output[3], steps(2 * kUnit, 3, 6)},
                                   {arena.output[4], steps(kUnit, 4, 5)},
                                   {arena.output_grad[4], steps(kUnit, 5, 6)},
                                   {arena.output_grad[3], steps(2 * kUnit, 6, 7)},
                                   {arena.output_grad[2], steps(2 * kUnit, 7, 8)}});
  std::vector<ArenaBuffer> buffers(arena.layout.offsets.size());
  for (const auto& [b, buffer] : expected) {
    EXPECT_NE(b, TransientArena::kNone);
    if (b < buffers.size()) buffers[b] = buffer;
  }
  return buffers;
}

TEST(TransientArena, AChainHoldsWhatIsAliveAtOnce) {
  const TransientArena arena = transient_arena(chain());
  // The activation running in place shares its input's output and gradient buffers.
  EXPECT_EQ(arena.output[0], arena.output[1]);
  EXPECT_EQ(arena.output_grad[0], arena.output_grad[1]);
  // Steps (5 layers): forward i = i, the loss 5, backward k = 10 - k. Outputs until their first
  // reader's backward (the shared one until act's), gradients from their last reader's backward.
  const std::vector<ArenaBuffer> buffers =
      expected_buffers(arena, {{arena.output[0], steps(8 * kUnit, 0, 9)},
                               {arena.output_grad[0], steps(8 * kUnit, 8, 10)}});
  ASSERT_EQ(buffers.size(), 8u);
  EXPECT_EQ(lay_out_arena(buffers, kArenaAlignment).offsets, arena.layout.offsets);
  expect_valid(buffers, arena.layout, kArenaAlignment);
  // At pool's backward: the shared output, pool's and conv's gradients (8 + 2 + 8 units); every
  // output and gradient held at once would be 26 units.
  EXPECT_EQ(arena.layout.size, 18 * kUnit);
  EXPECT_EQ(most_alive(buffers), 18 * kUnit);
  for (std::size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(arena.partial[i], TransientArena::kNone);
    EXPECT_EQ(arena.partial_grad[i], TransientArena::kNone);
    EXPECT_EQ(arena.input_copy[i], std::vector<std::size_t>{TransientArena::kNone});
    EXPECT_EQ(arena.input_copy_grad[i], std::vector<std::size_t>{TransientArena::kNone});
  }
}

TEST(TransientArena, CopiesOutputsLetGoAndPartialSumsTakeTheirTimes) {
  TransientGraph g = chain();
  g.in_place[1] = false;  // act reads a copy of conv's output (a halo window)...
  g.input_copy_bytes[1] = {9 * kUnit};
  g.released[0] = true;   // ...so conv's output goes after act's forward
  g.partial_bytes[3] = 3 * kUnit;  // flatten split by channel (its partial sums)
  g.input_copy_bytes[0] = {kUnit};  // conv reads a copy of the model's input (no gradient)
  const TransientArena arena = transient_arena(g);
  EXPECT_NE(arena.output[0], arena.output[1]);
  EXPECT_EQ(arena.input_copy_grad[0][0], TransientArena::kNone);
  const std::vector<ArenaBuffer> buffers =
      expected_buffers(arena, {{arena.output[0], steps(8 * kUnit, 0, 1)},
                               {arena.output[1], steps(8 * kUnit, 1, 8)},
                               {arena.output_grad[1], steps(8 * kUnit, 8, 9)},
                               {arena.output_grad[0], steps(8 * kUnit, 9, 10)},
                               {arena.input_copy[0][0], steps(kUnit, 0, 10)},
                               {arena.input_copy[1][0], steps(9 * kUnit, 1, 9)},
                               {arena.input_copy_grad[1][0], steps(9 * kUnit, 9, 9)},
                               {arena.partial[3], steps(3 * kUnit, 3, 3)},
                               {arena.partial_grad[3], steps(3 * kUnit, 7, 7)}});
  ASSERT_EQ(buffers.size(), 15u);
  EXPECT_EQ(lay_out_arena(buffers, kArenaAlignment).offsets, arena.layout.offsets);
  expect_valid(buffers, arena.layout, kArenaAlignment);
  // At act's backward: the input's copy, act's copy and its gradient, act's and conv's output
  // gradients (1 + 9 + 9 + 8 + 8 units); the layout reaches that bound.
  EXPECT_EQ(most_alive(buffers), 35 * kUnit);
  EXPECT_EQ(arena.layout.size, 35 * kUnit);
}

TEST(TransientArena, OutputsLiveOnlyUntilTheLastBackwardThatReadsThem) {
  // Pool does act's backward (max pooling through a leaky ReLU): act's backward reads nothing,
  // pool reads its own output instead of its input, and flatten reads only shapes.
  TransientGraph g = chain();
  g.backward_reads = {{true}, {false}, {false}, {false}, {true}};
  g.reads_own_output = {false, false, true, false, false};
  const TransientArena arena = transient_arena(g);
  EXPECT_EQ(arena.output[0], arena.output[1]);
  std::vector<ArenaBuffer> buffers(arena.layout.offsets.size());
  ASSERT_EQ(buffers.size(), 8u);
  const std::vector<std::pair<std::size_t, ArenaBuffer>> expected = {
      {arena.output[0], steps(8 * kUnit, 0, 2)},  // conv's and act's: until pool's forward (was 9)
      {arena.output[2], steps(2 * kUnit, 2, 8)},  // pool's: until its own backward (was flatten's, 7)
      {arena.output[3], steps(2 * kUnit, 3, 6)},  // flatten's: fc reads it
      {arena.output[4], steps(kUnit, 4, 5)},
      {arena.output_grad[4], steps(kUnit, 5, 6)},
      {arena.output_grad[3], steps(2 * kUnit, 6, 7)},
      {arena.output_grad[2], steps(2 * kUnit, 7, 8)},
      {arena.output_grad[0], steps(8 * kUnit, 8, 10)}};
  for (const auto& [b, buffer] : expected) {
    ASSERT_LT(b, buffers.size());
    buffers[b] = buffer;
  }
  EXPECT_EQ(lay_out_arena(buffers, kArenaAlignment).offsets, arena.layout.offsets);
  expect_valid(buffers, arena.layout, kArenaAlignment);
  // At pool's backward: pool's output and gradient and conv's gradient (2 + 2 + 8 units), where
  // the chain that every backward reads holds 18.
  EXPECT_EQ(most_alive(buffers), 12 * kUnit);
  EXPECT_EQ(arena.layout.size, 12 * kUnit);
  // A copy that its reader's backward does not read lives through that reader's forward only.
  g.in_place[1] = false;
  g.input_copy_bytes[1] = {9 * kUnit};
  g.released[0] = true;
  g.backward_reads[1] = {false};
  const TransientArena copied = transient_arena(g);
  EXPECT_EQ(copied.buffers[copied.input_copy[1][0]].first, 2);
  EXPECT_EQ(copied.buffers[copied.input_copy[1][0]].last, 2);
  EXPECT_EQ(copied.buffers[copied.output[0]].last, 2);
  // One flag per input, or none at all.
  g.backward_reads[4] = {true, true};
  EXPECT_THROW(transient_arena(g), Error);
  g.backward_reads.pop_back();
  EXPECT_THROW(transient_arena(g), Error);
}

/// Every buffer of `arena` (its own record, TransientArena::buffers).
std::int64_t most_alive_in(const TransientArena& arena) { return most_alive(arena.buffers); }

TEST(TransientArena, WhatBackwardReadsIsKeptInBf16BetweenForwardAndBackward) {
  // Four convolutions of 8 units each in a chain, then fc (1 unit), the loss on fc: every output
  // is read by the next layer's backward (its weight gradient).
  TransientGraph g;
  g.inputs = {{-1}, {0}, {1}, {2}, {3}};
  g.in_place.assign(5, false);
  g.output = 4;
  g.output_bytes = {8 * kUnit, 8 * kUnit, 8 * kUnit, 8 * kUnit, kUnit};
  g.released.assign(5, false);
  g.input_copy_bytes = {{0}, {0}, {0}, {0}, {0}};
  g.partial_bytes.assign(5, 0);
  const TransientArena fp32 = transient_arena(g);
  EXPECT_TRUE(fp32.stashes.empty());
  g.bf16_stash = true;
  const TransientArena bf16 = transient_arena(g);
  // Output i: fp32 until its reader's forward (step i + 1), bf16 (half the bytes) until just
  // before that reader's backward (step 9 - i), fp32 again there. fc's output is read by the loss
  // and no backward: no copy.
  ASSERT_EQ(bf16.stashes.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    SCOPED_TRACE(i);
    const ArenaStash& s = bf16.stashes[static_cast<std::size_t>(i)];
    EXPECT_EQ(s.layer, i);
    EXPECT_EQ(s.input, TransientArena::kNone);
    EXPECT_EQ(s.from, bf16.output[static_cast<std::size_t>(i)]);
    EXPECT_EQ(s.packed, i + 1);
    EXPECT_EQ(s.widened, 9 - i);
    const ArenaBuffer& from = bf16.buffers[s.from];
    const ArenaBuffer& stash = bf16.buffers[s.stash];
    const ArenaBuffer& to = bf16.buffers[s.to];
    EXPECT_EQ(from.first, 2 * i);
    EXPECT_EQ(from.last, 2 * (i + 1));
    EXPECT_EQ(stash.size, 4 * kUnit);
    EXPECT_EQ(stash.first, 2 * (i + 1));
    EXPECT_EQ(stash.last, 2 * (9 - i) - 1);  // widened just before the step
    EXPECT_EQ(to.size, 8 * kUnit);
    EXPECT_EQ(to.first, 2 * (9 - i) - 1);
    EXPECT_EQ(to.last, 2 * (9 - i));
  }
  expect_valid(bf16.buffers, bf16.layout, kArenaAlignment);
  // At fc's backward in fp32: four outputs, fc's and conv4's gradients (32 + 1 + 8 units); in
  // bf16 the peak is at conv4's backward: two bf16 copies, conv3's widened output, the gradients
  // of conv4's and conv3's outputs (8 + 8 + 8 + 8).
  EXPECT_EQ(most_alive_in(fp32), 41 * kUnit);
  EXPECT_EQ(most_alive_in(bf16), 32 * kUnit);
  EXPECT_LT(bf16.layout.size, fp32.layout.size);
  // A copy that backward reads (conv2 reads a window of conv1's output): bf16 from its reader's
  // forward to just before its backward.
  g.input_copy_bytes[2] = {9 * kUnit};
  g.released[1] = true;
  const TransientArena copied = transient_arena(g);
  const auto window = std::find_if(copied.stashes.begin(), copied.stashes.end(),
                                   [](const ArenaStash& s) { return s.layer == 2 && s.input == 0; });
  ASSERT_NE(window, copied.stashes.end());
  EXPECT_EQ(window->from, copied.input_copy[2][0]);
  EXPECT_EQ(window->packed, 2);
  EXPECT_EQ(window->widened, 8);
  EXPECT_EQ(copied.buffers[window->stash].size, 9 * kUnit / 2);
  EXPECT_EQ(copied.buffers[window->to].first, 15);
  EXPECT_EQ(copied.buffers[window->to].last, 16);
  // A layer whose backward needs fp32 values (a convolution computing in fp32): no bf16 copy of
  // what it reads.
  g.backward_reads_fp32 = {false, false, true, false, false};
  const TransientArena fp32_reader = transient_arena(g);
  EXPECT_TRUE(std::none_of(fp32_reader.stashes.begin(), fp32_reader.stashes.end(),
                           [](const ArenaStash& s) { return s.layer == 2 && s.input == 0; }));
  EXPECT_EQ(fp32_reader.buffers[fp32_reader.input_copy[2][0]].last, 2 * 8);  // fp32 until conv2's backward
  g.backward_reads_fp32.pop_back();
  EXPECT_THROW(transient_arena(g), Error);
  g.backward_reads_fp32.clear();
  // conv1's output, let go after the copy, has no bf16 copy of its own.
  EXPECT_TRUE(std::none_of(copied.stashes.begin(), copied.stashes.end(),
                           [](const ArenaStash& s) { return s.layer == 1 && s.input == TransientArena::kNone; }));
  expect_valid(copied.buffers, copied.layout, kArenaAlignment);
}

TEST(TransientArena, RefusesAGraphThatIsNotOne) {
  TransientGraph g = chain();
  g.in_place[0] = true;  // in place over the model's input
  EXPECT_THROW(transient_arena(g), Error);
  g = chain();
  g.partial_bytes.pop_back();
  EXPECT_THROW(transient_arena(g), Error);
  g = chain();
  g.released[0] = true;  // read in place, yet let go
  EXPECT_THROW(transient_arena(g), Error);
  g = chain();
  g.inputs[2] = {3};  // reads a later layer
  EXPECT_THROW(transient_arena(g), Error);
  g = chain();
  g.input_copy_bytes[2] = {0, 0};
  EXPECT_THROW(transient_arena(g), Error);
}

}  // namespace
}  // namespace tessera
