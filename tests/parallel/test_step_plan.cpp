// The step plan's decisions on small graphs, each rule by hand: in place, forward and backward
// fusion, outputs let go after their readers' copies, the arena's shared buffers. That the
// executor's memory equals the planner's estimate (test_memory_estimate, test_bf16) and every
// plan equals the 1-rank run (tests/invariant) is the proof that both carry out this plan.
#include <gtest/gtest.h>

#include <algorithm>

#include "tessera/core/error.hpp"
#include "tessera/parallel/step_plan.hpp"

namespace tessera {
namespace {

LayerTraits conv_traits() {
  LayerTraits t;
  t.fuses_leaky_relu = true;
  t.backward_reads_fp32 = true;
  t.computes_output_regions = true;
  t.splits_backward = true;
  return t;
}

LayerTraits relu_traits(float slope) {
  LayerTraits t;
  t.runs_in_place = true;
  t.leaky_relu_slope = slope;
  return t;
}

LayerTraits pool_traits() {
  LayerTraits t;
  t.backward_reads_inputs = false;
  t.fuses_leaky_relu_backward = true;
  t.writes_into_window = true;
  return t;
}

StepLayer layer(std::vector<int> inputs, LayerTraits traits, std::int64_t bytes = 1024) {
  StepLayer l;
  l.traits = traits;
  l.output_bytes = bytes;
  l.copies_input.assign(inputs.size(), false);
  l.input_copy_bytes.assign(inputs.size(), 0);
  l.inputs = std::move(inputs);
  return l;
}

/// conv -> leaky relu -> max pooling -> conv (the loss's input): a CosmoFlow block.
StepGraph block(float slope) {
  StepGraph g;
  g.layers = {layer({-1}, conv_traits()), layer({0}, relu_traits(slope)), layer({1}, pool_traits(), 256),
              layer({2}, conv_traits(), 256)};
  g.output = 3;
  return g;
}

TEST(StepPlan, LeakyReluRunsInPlaceAndFusesIntoItsProducerAndItsReader) {
  const StepPlan plan = plan_step(block(0.01f), StepOptions{});
  EXPECT_EQ(plan.in_place, (std::vector<bool>{false, true, false, false}));
  EXPECT_EQ(plan.fused, (std::vector<bool>{false, true, false, false}));
  EXPECT_EQ(plan.leaky_relu_after[0], 0.01f);
  EXPECT_FALSE(plan.leaky_relu_after[1]);
  EXPECT_EQ(plan.backward_fused, (std::vector<bool>{false, true, false, false}));
  EXPECT_EQ(plan.leaky_relu_before[2], 0.01f);
  EXPECT_EQ(plan.release_after, (std::vector<int>{-1, -1, -1, -1}));
  // The relu's output is its input's buffer; its gradient the buffer its reader writes.
  EXPECT_EQ(plan.arena.output[1], plan.arena.output[0]);
  EXPECT_EQ(plan.arena.output_grad[1], plan.arena.output_grad[0]);
  EXPECT_NE(plan.arena.output[2], plan.arena.output[0]);
}

// The first convolution (one input channel) does the pooling's forward and backward where it can
// read the pooling's gradient and the chain reads as produced: through the fused leaky ReLU or
// directly.
// The pooling's output and gradient live until that convolution's backward. Not where the
// pooling reads a copy, the convolution reads another layer (an input gradient to compute), the
// activation runs its own backward, either is split by channel, the pooling's rows are shorter
// than kPooledRowWindows, or the options say no.
TEST(StepPlan, TheFirstConvolutionDoesItsPoolingsBackward) {
  StepGraph g = block(0.01f);
  g.layers[0].traits.reads_pooled_gradient = true;
  g.layers[2].traits.pools_in_pairs = true;
  g.layers[2].output_row = kPooledRowWindows;
  const StepPlan plan = plan_step(g, StepOptions{});
  EXPECT_EQ(plan.gradient_from_pooling, (std::vector<int>{2, -1, -1, -1}));
  EXPECT_EQ(plan.pooled_by, (std::vector<int>{-1, -1, 0, -1}));
  EXPECT_TRUE(plan.backward_fused[1]);
  // Nothing writes the convolution's output (nor the activation's, in place over it); the
  // pooling's output is born at the convolution's forward.
  EXPECT_EQ(plan.arena.output[0], TransientArena::kNone);
  EXPECT_EQ(plan.arena.output[1], TransientArena::kNone);
  EXPECT_EQ(plan.arena.buffers.at(plan.arena.output[2]).first, 0);
  // Alive until the convolution's backward: the pooling's output and gradient, which the plain
  // plan lets go at the pooling's backward. The convolution's output gradient (the activation's,
  // in place) has no buffer: nothing writes it.
  const StepPlan plain = plan_step(block(0.01f), StepOptions{});
  const auto last = [](const StepPlan& p, std::size_t buffer) { return p.arena.buffers.at(buffer).last; };
  EXPECT_GT(last(plan, plan.arena.output[2]), last(plain, plain.arena.output[2]));
  EXPECT_GT(last(plan, plan.arena.output_grad[2]), last(plain, plain.arena.output_grad[2]));
  EXPECT_EQ(last(plan, plan.arena.output_grad[2]), last(plain, plain.arena.output_grad[0]));
  EXPECT_EQ(plan.arena.output_grad[0], TransientArena::kNone);
  EXPECT_EQ(plan.arena.output_grad[1], TransientArena::kNone);
  EXPECT_NE(plain.arena.output_grad[0], TransientArena::kNone);

  StepGraph direct = g;  // conv -> pool
  direct.layers.erase(direct.layers.begin() + 1);
  direct.layers[1].inputs = {0};
  direct.layers[2].inputs = {1};
  direct.output = 2;
  EXPECT_EQ(plan_step(direct, StepOptions{}).gradient_from_pooling, (std::vector<int>{1, -1, -1}));
  EXPECT_EQ(plan_step(direct, StepOptions{}).pooled_by, (std::vector<int>{-1, 0, -1}));

  const auto none = [](const StepGraph& graph, StepOptions options = {}) {
    const StepPlan p = plan_step(graph, options);
    return std::all_of(p.pooled_by.begin(), p.pooled_by.end(), [](int by) { return by < 0; }) &&
           std::all_of(p.gradient_from_pooling.begin(), p.gradient_from_pooling.end(), [](int k) { return k < 0; });
  };
  EXPECT_FALSE(none(g));
  StepGraph copied = g;
  copied.layers[2].copies_input = {true};
  copied.layers[2].input_copy_bytes = {1024};
  EXPECT_TRUE(none(copied));
  StepGraph reads_a_layer = g;
  reads_a_layer.layers.insert(reads_a_layer.layers.begin(), layer({-1}, LayerTraits{}));
  for (std::size_t i = 1; i < reads_a_layer.layers.size(); ++i)
    reads_a_layer.layers[i].inputs = {static_cast<int>(i) - 1};
  reads_a_layer.output = 4;
  EXPECT_TRUE(none(reads_a_layer));
  StepGraph short_rows = g;
  short_rows.layers[2].output_row = kPooledRowWindows - 1;
  EXPECT_TRUE(none(short_rows));
  StepGraph unfusable = g;
  unfusable.layers[2].traits.fuses_leaky_relu_backward = false;
  EXPECT_TRUE(none(unfusable));
  for (std::size_t split : {0u, 2u}) {
    StepGraph partial = g;
    partial.layers[split].channel_split = true;
    partial.layers[split].partial_bytes = 512;
    EXPECT_TRUE(none(partial)) << "layer " << split << " split by channel";
  }
  EXPECT_TRUE(none(g, StepOptions{.pooled_gradients = false}));
  EXPECT_TRUE(none(g, StepOptions{.fuse = false}));
  EXPECT_TRUE(none(g, default_step_options(/*gpu=*/true)));
}

/// A CosmoFlow block whose last convolution reads the pooling through a halo window of
/// `window_bytes` holding the pooling's tile of 2048 bytes (`holds_tile`), then a dense tail; the
/// first convolution's output of `first_bytes`.
StepGraph windowed_block(std::int64_t window_bytes, bool holds_tile = true, std::int64_t first_bytes = 65536) {
  StepGraph g = block(0.01f);
  g.layers[0].output_bytes = first_bytes;
  g.layers[2].output_bytes = 2048;
  g.layers[3].copies_input = {true};
  g.layers[3].input_copy_bytes = {window_bytes};
  g.layers[3].copy_holds_tile = {holds_tile};
  g.layers.push_back(layer({3}, LayerTraits{}, 64));
  g.output = 4;
  return g;
}

// Pooling writes into its reader's halo window where that window holds its tile and the arena
// grows by kWindowArenaGrowth at most: its output and the window are one buffer, from the
// pooling's forward to the later of their lives, and so are their gradients; the output is not
// released. Not on GPUs (StepOptions::outputs_into_windows), with bf16 activations, with a
// window that does not hold the tile, a second reader, or a window much larger than the tile.
TEST(StepPlan, PoolingWritesIntoItsReadersWindowWhereTheArenaAllows) {
  const StepPlan plan = plan_step(windowed_block(2304), StepOptions{});
  EXPECT_EQ(plan.output_in_window, (std::vector<int>{-1, -1, 3, -1, -1}));
  EXPECT_EQ(plan.release_after[2], -1);
  EXPECT_EQ(plan.arena.output[2], plan.arena.input_copy[3][0]);
  EXPECT_EQ(plan.arena.output_grad[2], plan.arena.input_copy_grad[3][0]);
  const ArenaBuffer& window = plan.arena.buffers[plan.arena.output[2]];
  EXPECT_EQ(window.size, 2304);
  EXPECT_EQ(window.first, 2 * 2);             // the pooling's forward
  EXPECT_EQ(window.last, 2 * (2 * 5 - 2));    // its backward (it reads its own output)
  const ArenaBuffer& grad = plan.arena.buffers[plan.arena.output_grad[2]];
  EXPECT_EQ(grad.first, 2 * (2 * 5 - 3));     // the reader's backward
  EXPECT_EQ(grad.last, 2 * (2 * 5 - 2));

  const auto windows = [](const StepGraph& g, const StepOptions& options = {}) {
    return plan_step(g, options).output_in_window[2];
  };
  StepOptions gpu;
  gpu.outputs_into_windows = false;
  EXPECT_EQ(windows(windowed_block(2304), gpu), -1);
  StepGraph bf16 = windowed_block(2304);
  bf16.bf16_activations = true;
  EXPECT_EQ(windows(bf16), -1);
  EXPECT_EQ(windows(windowed_block(2304, /*holds_tile=*/false)), -1);
  StepGraph two_readers = windowed_block(2304);
  two_readers.layers.push_back(layer({2}, LayerTraits{}, 64));
  EXPECT_EQ(windows(two_readers), -1);
  // A window 4 times the tile, alive with its gradient at the pooling's backward beside the
  // large gradient of its input: the arena would grow by far more.
  EXPECT_EQ(windows(windowed_block(8192)), -1);
}

// Where all windows together would grow the arena too much, they are kept one by one: here the
// second block's (small beside the first block's gradients), not the first's.
TEST(StepPlan, WindowsAreKeptOneByOneWhereAllTogetherGrowTheArena) {
  StepGraph g = windowed_block(8192);  // as in the test above: this window alone grows it too much
  g.layers.pop_back();
  g.layers[3].output_bytes = 16384;
  g.layers.push_back(layer({3}, relu_traits(0.01f), 16384));
  g.layers.push_back(layer({4}, pool_traits(), 512));
  g.layers.push_back(layer({5}, conv_traits(), 256));
  g.layers.back().copies_input = {true};
  g.layers.back().input_copy_bytes = {768};
  g.layers.back().copy_holds_tile = {true};
  g.layers.push_back(layer({6}, LayerTraits{}, 64));
  g.output = 7;
  const StepPlan plan = plan_step(g, StepOptions{});
  EXPECT_EQ(plan.output_in_window, (std::vector<int>{-1, -1, -1, -1, -1, 6, -1, -1}));
  EXPECT_EQ(plan.arena.output[5], plan.arena.input_copy[6][0]);
  EXPECT_NE(plan.arena.output[2], plan.arena.input_copy[3][0]);
}

TEST(StepPlan, AZeroSlopeFusesForwardOnlyWhereTheBackendDoesIt) {
  StepOptions host;
  EXPECT_EQ(plan_step(block(0.0f), host).fused, (std::vector<bool>{false, false, false, false}));
  EXPECT_EQ(plan_step(block(0.0f), host).backward_fused, (std::vector<bool>{false, true, false, false}));
  StepOptions gpu;
  gpu.fuses_zero_slope = true;
  EXPECT_EQ(plan_step(block(0.0f), gpu).fused, (std::vector<bool>{false, true, false, false}));
  EXPECT_EQ(plan_step(block(0.0f), gpu).leaky_relu_after[0], 0.0f);
}

TEST(StepPlan, OptionsTurnInPlaceAndFusionOff) {
  StepOptions apart;
  apart.fuse = false;
  StepPlan plan = plan_step(block(0.01f), apart);
  EXPECT_EQ(plan.in_place, (std::vector<bool>{false, true, false, false}));
  EXPECT_EQ(plan.fused, (std::vector<bool>(4, false)));
  EXPECT_EQ(plan.backward_fused, (std::vector<bool>(4, false)));
  EXPECT_FALSE(plan.leaky_relu_before[2]);
  StepOptions own;
  own.in_place = false;
  plan = plan_step(block(0.01f), own);
  EXPECT_EQ(plan.in_place, (std::vector<bool>(4, false)));
  EXPECT_EQ(plan.fused, (std::vector<bool>(4, false)));
  EXPECT_NE(plan.arena.output[1], plan.arena.output[0]);
}

TEST(StepPlan, NoInPlaceOverACopyASharedInputOrTheLossInput) {
  // The relu reads a copy (a halo window): it needs an output of its own, and nothing fuses.
  StepGraph copied = block(0.01f);
  copied.layers[1].copies_input = {true};
  copied.layers[1].input_copy_bytes = {2048};
  StepPlan plan = plan_step(copied, StepOptions{});
  EXPECT_FALSE(plan.in_place[1]);
  EXPECT_FALSE(plan.fused[1]);
  EXPECT_FALSE(plan.backward_fused[1]);
  // Every reader of the conv copies its output: let go after the relu's exchange.
  EXPECT_EQ(plan.release_after[0], 1);
  // A second reader of the conv's output.
  StepGraph shared = block(0.01f);
  shared.layers.push_back(layer({0, 3}, LayerTraits{}, 256));
  shared.output = 4;
  plan = plan_step(shared, StepOptions{});
  EXPECT_FALSE(plan.in_place[1]);
  EXPECT_EQ(plan.release_after[0], -1);
  // The loss reads the conv's output.
  StepGraph loss;
  loss.layers = {layer({-1}, conv_traits()), layer({0}, relu_traits(0.01f))};
  loss.output = 0;
  EXPECT_FALSE(plan_step(loss, StepOptions{}).in_place[1]);
  EXPECT_EQ(in_place_candidates({{-1}, {0}}, {conv_traits(), relu_traits(0.01f)}, 1),
            (std::vector<bool>{false, true}));
  EXPECT_EQ(in_place_candidates({{-1}, {0}}, {conv_traits(), relu_traits(0.01f)}, 0),
            (std::vector<bool>{false, false}));
}

TEST(StepPlan, PartialSumsAndCopiedReadersStopFusion) {
  // A channel-split producer's output is a sum the exchange makes: its kernels cannot apply the slope.
  StepGraph split = block(0.01f);
  split.layers[0].channel_split = true;
  split.layers[0].partial_bytes = 512;
  StepPlan plan = plan_step(split, StepOptions{});
  EXPECT_TRUE(plan.in_place[1]);
  EXPECT_FALSE(plan.fused[1]);
  EXPECT_TRUE(plan.backward_fused[1]);
  EXPECT_NE(plan.arena.partial[0], TransientArena::kNone);
  // The pooling reads a copy of the relu's output: it cannot do the relu's backward, and the
  // relu's output (the conv's buffer) goes after the pooling's exchange.
  StepGraph window = block(0.01f);
  window.layers[2].copies_input = {true};
  window.layers[2].input_copy_bytes = {2048};
  plan = plan_step(window, StepOptions{});
  EXPECT_TRUE(plan.in_place[1]);
  EXPECT_FALSE(plan.backward_fused[1]);
  EXPECT_FALSE(plan.leaky_relu_before[2]);
  EXPECT_EQ(plan.release_after[1], 2);
}

TEST(StepPlan, MismatchedInputsAreRefused) {
  StepGraph g = block(0.01f);
  g.layers[2].copies_input.clear();
  EXPECT_THROW(plan_step(g, StepOptions{}), Error);
}

}  // namespace
}  // namespace tessera
