// The step plan's decisions on small graphs, each rule by hand: in place, forward and backward
// fusion, outputs let go after their readers' copies, the arena's shared buffers. That the
// executor's memory equals the planner's estimate (test_memory_estimate, test_bf16) and every
// plan equals the 1-rank run (tests/invariant) is the proof that both carry out this plan.
#include <gtest/gtest.h>

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
