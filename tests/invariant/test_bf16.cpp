// The invariant for bf16 operands: a model with `precision: bf16` under sample, spatial, filter and
// channel splits on this job's ranks against its 1-rank run (both bf16). Products of bf16
// operands are exact and every sum and result is fp32 (no partial result is rounded to bf16), so
// the plans agree as fp32 plans do, unless an operand lands on the other side of a bf16 rounding
// boundary: asserted within bf16's 1e-2 relative (measured: 9e-8). That a bf16 run is not simply
// the fp32 run is checked too.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "invariant/invariant_harness.hpp"
#include "tessera/parallel/machine.hpp"
#include "tessera/parallel/planner.hpp"

namespace tessera {
namespace {

using testing::expect_same_as_one_rank;
using testing::plan_for;
using testing::ranks;

// Measured here: at most 9e-8 over these tests at 1-4 ranks (as fp32's plans agree). An operand
// whose fp32 value lands on the other side of a bf16 rounding boundary in another plan (another
// order of an fp32 sum: another machine's kernels) moves a few values by ~1e-3; the bound is
// bf16's, 1e-2.
constexpr double kBf16Tolerance = 1e-2;

const char* kCnn = R"(
precision: bf16
input: {shape: [2, 12, 12]}
layers:
  - {name: conv1, type: conv, filters: 6, kernel: 3, padding: 1}
  - {name: act1, type: leaky_relu, slope: 0.1}
  - {name: conv2, type: conv, filters: 8, kernel: 3, padding: 1}
  - {name: act2, type: relu}
  - {name: pool, type: maxpool, kernel: 2}
  - {name: flatten, type: flatten}
  - {name: fc1, type: linear, out: 12}
  - {name: act3, type: relu}
  - {name: fc2, type: linear, out: 10}
loss: softmax_cross_entropy
)";

const char* kCosmoStyle = R"(
precision: bf16
input: {shape: [1, 12, 12, 12]}
layers:
  - {name: conv1, type: conv, filters: 4, kernel: 3, padding: 1}
  - {name: act1, type: leaky_relu, slope: 0.01}
  - {name: pool1, type: maxpool, kernel: 2}
  - {name: conv2, type: conv, filters: 6, kernel: 3, padding: 1}
  - {name: act2, type: leaky_relu, slope: 0.01}
  - {name: flatten, type: flatten}
  - {name: fc1, type: linear, out: 8}
  - {name: fc2, type: linear, out: 1}
loss: mse
)";

using testing::adamw;

void expect_bf16_plan_equals_one_rank(const std::string& model, const std::string& plan, std::int64_t batch,
                                      const OptimizerConfig& optimizer = testing::sgd_momentum(), double lr = 0.05) {
  expect_same_as_one_rank(model, plan, batch, 4, optimizer, lr, HaloOverlap::Always, Device::host(), kBf16Tolerance);
}

TEST(Bf16Invariant, SampleParallel) { expect_bf16_plan_equals_one_rank(kCnn, plan_for({}, ""), 12); }

TEST(Bf16Invariant, ConvolutionsSplitSpatially) {
  const std::string split = fmt::format("{{sample: 1, spatial: [{}, 1]}}", ranks());
  expect_bf16_plan_equals_one_rank(kCnn, plan_for({"conv1", "act1", "conv2", "act2", "pool"}, split), 6);
}

TEST(Bf16Invariant, ThreeDimensionalConvolutionsSplitAlongDWithMse) {
  const std::string split = fmt::format("{{sample: 1, spatial: [{}, 1, 1]}}", ranks());
  expect_bf16_plan_equals_one_rank(kCosmoStyle, plan_for({"conv1", "act1", "pool1", "conv2", "act2"}, split), 4,
                                   adamw(), 1e-3);
}

TEST(Bf16Invariant, LayersSplitByFilterAndByChannel) {
  const std::string filters = fmt::format("{{sample: 1, filter: {}}}", ranks());
  expect_bf16_plan_equals_one_rank(kCnn, plan_for({"conv2", "fc1"}, filters), 6);
  const std::string channels = fmt::format("{{sample: 1, channel: {}}}", ranks());
  expect_bf16_plan_equals_one_rank(kCnn, plan_for({"conv2", "fc1"}, channels), 6);
}

TEST(Bf16Invariant, ThePlannerPredictsTheScratchOfTheRoundedOperandsExactly) {
  // The rounded operands take scratch buffers beside the activations; the planner counts them per
  // rank as the executor's kernels keep them (each kind's largest input, output gradient and
  // weights, the convolutions' and the linear layers' apart), for every kind of split: the
  // largest rank's buffers equal the estimate.
  auto world = MpiCommunicator::world();
  const std::int64_t batch = 6;
  const std::string spatial = fmt::format("{{sample: 1, spatial: [{}, 1]}}", ranks());
  const std::string filters = fmt::format("{{sample: 1, filter: {}}}", ranks());
  const std::string channels = fmt::format("{{sample: 1, channel: {}}}", ranks());
  for (const std::string& text : {plan_for({}, ""), plan_for({"conv1", "act1", "conv2", "act2", "pool"}, spatial),
                                  plan_for({"conv2", "fc1"}, filters), plan_for({"conv2", "fc1"}, channels)}) {
    SCOPED_TRACE(text);
    const Plan plan = Plan::parse(text, "scratch_plan");
    const testing::TrainingRun run = testing::train(kCnn, plan, world, batch, 1);
    const double most = world->allreduce_value(static_cast<double>(run.scratch_bytes), ReduceOp::Max);
    const Model model = Model::parse(kCnn, "scratch_model");
    PlannerOptions options;
    options.ranks = world->size();
    Machine machine;
    machine.ranks_per_node = machine.cores_per_node = world->size();
    const PlanEstimate estimate = CostModel(model.planner_graph(batch), machine, options).estimate(plan);
    EXPECT_GT(most, 0.0);
    EXPECT_DOUBLE_EQ(most, estimate.scratch_bytes);
  }
}

TEST(Bf16Invariant, ABf16RunIsNotTheFp32Run) {
  // The same model and plan in fp32: the losses differ by more than fp32 rounding and less than
  // bf16's precision, so the tests above compare bf16 runs, not fp32 ones.
  auto world = MpiCommunicator::world();
  std::string fp32 = kCnn;
  fp32.replace(fp32.find("precision: bf16"), std::string("precision: bf16").size(), "precision: fp32");
  const testing::TrainingRun bf16_run = testing::train(kCnn, Plan::sample_parallel(world->size()), world, 12, 2);
  const testing::TrainingRun fp32_run = testing::train(fp32, Plan::sample_parallel(world->size()), world, 12, 2);
  ASSERT_EQ(bf16_run.losses.size(), 2u);
  const double relative = std::fabs(bf16_run.losses[0] - fp32_run.losses[0]) / std::fabs(fp32_run.losses[0]);
  EXPECT_GT(relative, 1e-6) << "bf16 loss " << bf16_run.losses[0] << ", fp32 loss " << fp32_run.losses[0];
  EXPECT_LT(relative, 1e-2);
}

// Four convolutions at one resolution (with leaky ReLUs in place): every output waits for the next
// convolution's backward, so the middle of the step holds them all, in bf16 here.
const char* kDeep = R"(
precision: bf16
input: {shape: [2, 10, 10]}
layers:
  - {name: conv1, type: conv, filters: 8, kernel: 3, padding: 1}
  - {name: act1, type: leaky_relu, slope: 0.1}
  - {name: conv2, type: conv, filters: 8, kernel: 3, padding: 1}
  - {name: act2, type: leaky_relu, slope: 0.1}
  - {name: conv3, type: conv, filters: 8, kernel: 3, padding: 1}
  - {name: act3, type: leaky_relu, slope: 0.1}
  - {name: conv4, type: conv, filters: 8, kernel: 3, padding: 1}
  - {name: act4, type: leaky_relu, slope: 0.1}
  - {name: flatten, type: flatten}
  - {name: fc, type: linear, out: 10}
loss: softmax_cross_entropy
)";

// kCnn with conv2 in fp32 (a layer's own precision wins over the model's).
const std::string kCnnFp32Conv2 = [] {
  std::string text = kCnn;
  const std::string conv2 = "{name: conv2, type: conv, filters: 8, kernel: 3, padding: 1";
  text.insert(text.find(conv2) + conv2.size(), ", precision: fp32");
  return text;
}();

// `precision: bf16` keeps the activations that backward reads in bf16 between forward and
// backward (Model::activation_precision; the outputs of the layers and the windows and other
// copies they read): rounded as the bf16 operands round them, so the convolutions' and linear
// layers' gradients and the activations' and max pooling's masks are what fp32 copies give, to
// the bit, at 1-4 ranks under sample, spatial (halo windows kept in bf16) and model-parallel
// plans; and a rank holds less.
TEST(Bf16Activations, KeptInBf16ChangeNothingButMemory) {
  auto world = MpiCommunicator::world();
  const std::string h_split = fmt::format("{{sample: 1, spatial: [{}, 1]}}", ranks());
  const std::string d_split = fmt::format("{{sample: 1, spatial: [{}, 1, 1]}}", ranks());
  struct Case {
    std::string model, plan;
    std::int64_t batch;
    OptimizerConfig optimizer = testing::sgd_momentum();
    double lr = 0.05;
  };
  const std::vector<Case> cases = {
      {kCnn, plan_for({}, ""), 12},
      {kCnn, plan_for({"conv1", "act1", "conv2", "act2", "pool"}, h_split), 6},
      {kCnn, plan_for({"conv2", "fc1"}, fmt::format("{{sample: 1, channel: {}}}", ranks())), 6},
      {kCosmoStyle, plan_for({"conv1", "act1", "pool1", "conv2", "act2"}, d_split), 4, adamw(), 1e-3},
      // conv2 computes in fp32 (its own precision): what it reads stays fp32 (its weight gradient
      // would differ from the fp32-kept run's otherwise).
      {kCnnFp32Conv2, plan_for({"conv1", "act1", "conv2", "act2", "pool"}, h_split), 6},
      {kDeep, plan_for({}, ""), 8},
      {kDeep, plan_for({"conv1", "act1", "conv2", "act2", "conv3", "act3", "conv4", "act4"}, h_split), 4},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.plan);
    const Plan plan = Plan::parse(c.plan, "bf16_activation_plan");
    EXPECT_EQ(Model::parse(c.model, "m").activation_precision(), Precision::BF16) << "bf16 is precision bf16's default";
    const testing::TrainingRun bf16 = testing::train(c.model, plan, world, c.batch, 3, c.optimizer, c.lr);
    const testing::TrainingRun fp32 =
        testing::train(c.model + "activations: fp32\n", plan, world, c.batch, 3, c.optimizer, c.lr);
    testing::expect_same_to_the_bit(bf16, fp32);
    EXPECT_TRUE(fp32.bf16_kept_layers.empty());
    // The deep chain keeps its convolutions' outputs in bf16 on every rank count, so the bit
    // equality above is about something there.
    if (c.model == kDeep) {
      EXPECT_FALSE(bf16.bf16_kept_layers.empty());
    }
    const double most_bf16 = world->allreduce_value(static_cast<double>(bf16.training_activation_bytes), ReduceOp::Max);
    // Never more (transient_arena keeps the copies only where the arena comes out smaller).
    const double most_fp32 = world->allreduce_value(static_cast<double>(fp32.training_activation_bytes), ReduceOp::Max);
    if (world->rank() == 0)
      std::printf("activations per rank at %d ranks: %.0f B kept in bf16, %.0f B in fp32 (%.3f)\n", world->size(),
                  most_bf16, most_fp32, most_bf16 / most_fp32);
    EXPECT_LE(most_bf16, most_fp32);
    if (bf16.bf16_kept_layers.empty()) {
      EXPECT_EQ(bf16.training_activation_bytes, fp32.training_activation_bytes);
    }
    // The planner lays out the same arena.
    const Model model = Model::parse(c.model, "m");
    PlannerOptions options;
    options.ranks = world->size();
    options.optimizer_state = c.optimizer.type == "adamw" ? 2 : 1;  // moments, or momentum
    options.halo_overlap = HaloOverlap::Always;
    Machine machine;
    machine.ranks_per_node = machine.cores_per_node = world->size();
    const PlanEstimate estimate = CostModel(model.planner_graph(c.batch), machine, options).estimate(plan);
    double weights = 0;
    for (const Tensor& w : bf16.weights) weights += static_cast<double>(w.numel()) * sizeof(float);
    const double held = world->allreduce_value(
        static_cast<double>(bf16.training_activation_bytes + bf16.optimizer_bytes + bf16.scratch_bytes) + 2 * weights,
        ReduceOp::Max);
    EXPECT_GE(estimate.memory_bytes, 0.98 * held);
    EXPECT_LE(estimate.memory_bytes, 1.02 * held);
  }
}

TEST(Bf16Activations, NeedBf16PrecisionAndAreItsDefault) {
  std::string fp32 = kCnn;
  fp32.replace(fp32.find("precision: bf16"), std::string("precision: bf16").size(), "precision: fp32");
  EXPECT_EQ(Model::parse(fp32, "m").activation_precision(), Precision::F32);
  EXPECT_EQ(Model::parse(std::string(kCnn) + "activations: fp32\n", "m").activation_precision(), Precision::F32);
  EXPECT_THROW(Model::parse(fp32 + "activations: bf16\n", "m"), InputError);
  // --precision fp32 over a bf16 file that asks for bf16 activations: the message says why.
  ModelOptions cli;
  cli.precision = Precision::F32;
  try {
    Model::parse(std::string(kCnn) + "activations: bf16\n", "m", cli);
    ADD_FAILURE() << "accepted bf16 activations in an fp32 model";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--precision fp32"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Model::parse(std::string(kCnn) + "activations: fp16\n", "m"), InputError);
  EXPECT_THROW(Model::parse(std::string(kCnn) + "activations: [bf16]\n", "m"), InputError);
}

}  // namespace
}  // namespace tessera
