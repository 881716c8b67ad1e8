// The one invariant for model parallelism: linear and convolution layers split by output
// features/filters (`filter`), by input features/channels (`channel`, partial sums reduced) and
// both on a 2-D grid, combined with sample and spatial splits and with redistributions between
// differently split layers, compute what one rank computes: the same losses over several
// optimizer steps, the same gradient of every parameter block and the same weights after the
// steps. Each rank holds only its block of a split layer's weights, gradients and optimizer
// state: compared with the same block of the 1-rank run's whole tensors.
//
// The per-channel layers after a filter-split layer (batch norm, pooling, dropout, activations)
// may keep its channel blocks. Also: weight and optimizer-state memory per rank shrinks with the
// model split (from the allocation sizes); a sharded checkpoint holds global tensors and restores
// at one rank and under the plan; impossible splits are refused on every rank with a clear message.
#include <cstring>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <string>

#include <fmt/format.h>

#include "invariant_harness.hpp"
#include "tessera/core/error.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/parallel/mpi_communicator.hpp"
#include "tessera/train/checkpoint.hpp"
#include "tessera/train/executor.hpp"
#include "tessera/train/optimizer.hpp"

namespace tessera {
namespace {
using namespace tessera::testing;

/// A plan that splits the named layers as given and everything else by sample.
std::string plan_with(const std::map<std::string, std::string>& splits) {
  std::string text = fmt::format("ranks: {}\ndefault: {{sample: {}}}\nlayers:\n", ranks(), ranks());
  for (const auto& [layer, split] : splits) text += fmt::format("  {}: {}\n", layer, split);
  return text;
}

std::string filter_all() { return fmt::format("{{sample: 1, filter: {}}}", ranks()); }
std::string channel_all() { return fmt::format("{{sample: 1, channel: {}}}", ranks()); }
/// filter x channel: 2 x 2 at 4 ranks, otherwise all ranks along one of them.
std::string two_d(bool filter_first = true) {
  if (ranks() == 4) return "{sample: 1, filter: 2, channel: 2}";
  return filter_first ? filter_all() : channel_all();
}
/// sample x filter (or channel): 2 x 2 at 4 ranks, 1 x 2 at 2, 3 x 1 at 3.
std::string with_sample(const char* axis) {
  switch (ranks()) {
    case 4: return fmt::format("{{sample: 2, {}: 2}}", axis);
    case 3: return "{sample: 3}";
    default: return fmt::format("{{sample: 1, {}: {}}}", axis, ranks());
  }
}

const std::string kMlp = R"(
input: {shape: [12]}
layers:
  - {name: fc1, type: linear, out: 16}
  - {name: act1, type: leaky_relu, slope: 0.1}
  - {name: fc2, type: linear, out: 14}
  - {name: act2, type: relu}
  - {name: fc3, type: linear, out: 9}
  - {name: out, type: linear, out: 10}
loss: softmax_cross_entropy
)";

TEST(ModelParallelInvariant, LinearFilterSplit) {
  expect_same_as_one_rank(kMlp, plan_with({{"fc1", filter_all()}, {"fc2", filter_all()}, {"fc3", filter_all()}}), 5);
}

TEST(ModelParallelInvariant, LinearChannelSplit) {
  expect_same_as_one_rank(kMlp, plan_with({{"fc1", channel_all()}, {"fc2", channel_all()}, {"fc3", channel_all()}}), 5);
}

TEST(ModelParallelInvariant, LinearFilterThenChannelWithoutBias) {
  // The classic pair: the first layer's output blocks are exactly the second one's input blocks.
  const std::string model = R"(
input: {shape: [10]}
layers:
  - {name: fc1, type: linear, out: 24, bias: false}
  - {name: act1, type: relu}
  - {name: fc2, type: linear, out: 8}
  - {name: out, type: linear, out: 10}
loss: softmax_cross_entropy
)";
  expect_same_as_one_rank(model, plan_with({{"fc1", filter_all()}, {"fc2", channel_all()}}),
                          6);
}

TEST(ModelParallelInvariant, LinearFilterSplitActivationsStaySplit) {
  // fc1 -> act1 keep the feature blocks (no exchange); fc2 gathers them; act2 -> fc3 (channel)
  // read exactly the blocks fc2 and act2 hold.
  expect_same_as_one_rank(kMlp, plan_with({{"fc1", filter_all()}, {"act1", filter_all()}, {"fc2", filter_all()},
                                           {"act2", filter_all()}, {"fc3", channel_all()}}),
                          5);
}

TEST(ModelParallelInvariant, LinearTwoDimensional) {
  expect_same_as_one_rank(kMlp, plan_with({{"fc1", two_d()}, {"fc2", two_d(false)}, {"fc3", two_d()}}), 5);
}

TEST(ModelParallelInvariant, LinearWithSampleSplit) {
  expect_same_as_one_rank(kMlp, plan_with({{"fc1", with_sample("filter")}, {"fc2", with_sample("channel")},
                                           {"fc3", with_sample("filter")}}),
                          7);
}

TEST(ModelParallelInvariant, LinearWithAdamOverSeveralSteps) {
  OptimizerConfig adam;
  adam.type = "adam";
  expect_same_as_one_rank(kMlp, plan_with({{"fc1", two_d()}, {"fc2", filter_all()}, {"fc3", channel_all()}}), 6, 5,
                          adam, 0.01);
}

const std::string kConvNet = R"(
input: {shape: [3, 6, 7]}
layers:
  - {name: c1, type: conv, filters: 8, kernel: 3, padding: 1}
  - {name: a1, type: relu}
  - {name: c2, type: conv, filters: 8, kernel: 3, padding: 1, stride: [1, 2]}
  - {name: a2, type: leaky_relu, slope: 0.1}
  - {name: c3, type: conv, filters: 4, kernel: 1}
  - {name: flatten, type: flatten}
  - {name: fc, type: linear, out: 10}
loss: softmax_cross_entropy
)";

TEST(ModelParallelInvariant, ConvFilterSplit) {
  expect_same_as_one_rank(kConvNet, plan_with({{"c1", filter_all()}, {"c2", filter_all()}, {"c3", filter_all()}}), 4);
}

TEST(ModelParallelInvariant, ConvChannelSplit) {
  // c1 has 3 input channels: split by channel only where that gives each rank one.
  expect_same_as_one_rank(kConvNet, plan_with({{"c1", ranks() <= 3 ? channel_all() : with_sample("channel")},
                                               {"c2", channel_all()}, {"c3", channel_all()}}),
                          4);
}

TEST(ModelParallelInvariant, ConvFilterSplitActivationsStaySplit) {
  const std::string split = ranks() == 4 ? "{sample: 2, filter: 2}" : filter_all();
  expect_same_as_one_rank(kConvNet, plan_with({{"c1", split}, {"a1", split}, {"c2", filter_all()},
                                               {"a2", filter_all()}, {"c3", channel_all()}}),
                          4);
}

// No biases before batch norm (directly, or through linear layers): their gradients are zero up
// to rounding, which no comparison can check.
const std::string kConvBatchNormNet = R"(
input: {shape: [3, 6, 5]}
layers:
  - {name: c1, type: conv, filters: 6, kernel: 3, padding: 1, bias: false}
  - {name: bn1, type: batchnorm, global: true}
  - {name: a1, type: relu}
  - {name: pool, type: maxpool, kernel: 2, stride: 1}
  - {name: drop, type: dropout, rate: 0.3}
  - {name: c2, type: conv, filters: 5, kernel: 3, padding: 1, bias: false}
  - {name: flatten, type: flatten}
  - {name: fc1, type: linear, out: 12, bias: false}
  - {name: bnf, type: batchnorm}
  - {name: dropf, type: dropout, rate: 0.2}
  - {name: fc, type: linear, out: 10}
loss: softmax_cross_entropy
)";

TEST(ModelParallelInvariant, BatchNormPoolingAndDropoutSplitByFilter) {
  // Batch norm (global statistics over the sample ranks of each channel block; local ones with
  // one sample part), pooling and dropout (masks by global index) on the filter blocks of the
  // layer before.
  const std::string split = ranks() == 4 ? "{sample: 2, filter: 2}" : filter_all();
  const std::string whole_batch = filter_all();
  expect_same_as_one_rank(kConvBatchNormNet,
                          plan_with({{"c1", split}, {"bn1", split}, {"a1", split}, {"pool", split}, {"drop", split},
                                     {"c2", channel_all()}, {"fc1", whole_batch}, {"bnf", whole_batch}, {"dropf", whole_batch}}),
                          6);
}

TEST(ModelParallelInvariant, ConvTwoDimensionalAndWithSample) {
  expect_same_as_one_rank(kConvNet, plan_with({{"c1", with_sample("filter")}, {"c2", two_d()},
                                               {"c3", with_sample("channel")}}),
                          5);
}

TEST(ModelParallelInvariant, ConvModelSplitWithSpatialSplit) {
  // Filter or channel parts times spatial tiles on the same layer, and spatial layers before.
  std::string fs, cs;
  switch (ranks()) {
    case 4:
      fs = "{sample: 1, filter: 2, spatial: [1, 2]}";
      cs = "{sample: 1, channel: 2, spatial: [2, 1]}";
      break;
    case 1:
      fs = cs = "{sample: 1}";
      break;
    default:
      fs = fmt::format("{{sample: 1, filter: {}}}", ranks());
      cs = fmt::format("{{sample: 1, spatial: [{}, 1]}}", ranks());
  }
  const std::string spatial = fmt::format("{{sample: 1, spatial: [1, {}]}}", ranks());
  expect_same_as_one_rank(kConvNet, plan_with({{"c1", spatial}, {"a1", spatial}, {"c2", fs}, {"a2", spatial}, {"c3", cs}}),
                          4);
}

TEST(ModelParallelInvariant, SpatialThenModelParallelClassifier) {
  const std::string model = R"(
input: {shape: [2, 8, 8]}
layers:
  - {name: conv1, type: conv, filters: 4, kernel: 3, padding: 1}
  - {name: act1, type: leaky_relu, slope: 0.01}
  - {name: pool1, type: maxpool, kernel: 2}
  - {name: conv2, type: conv, filters: 8, kernel: 3, padding: 1}
  - {name: flatten, type: flatten}
  - {name: fc1, type: linear, out: 20}
  - {name: act3, type: leaky_relu, slope: 0.01}
  - {name: fc2, type: linear, out: 12}
  - {name: fc3, type: linear, out: 10}
loss: softmax_cross_entropy
)";
  const std::string spatial = fmt::format("{{sample: 1, spatial: [{}, 1]}}", ranks());
  expect_same_as_one_rank(model, plan_with({{"conv1", spatial}, {"act1", spatial}, {"pool1", spatial},
                                            {"conv2", filter_all()}, {"fc1", two_d()}, {"fc2", channel_all()}}),
                          5, 5);
}

TEST(ModelParallelInvariant, OneSampleSplitSpatiallyThenADenseTailSplitByFeature) {
  // Batch 1 (plans/cosmoflow_spatial2_deep.yaml's shape): the conv blocks split the one sample
  // along D, the first linear layer by output feature, the second by input feature, so that no
  // rank idles before the last layer. The same as one rank.
  const std::string model = R"(
input: {shape: [1, 8, 8, 8]}
layers:
  - {name: conv1, type: conv, filters: 4, kernel: 3, padding: 1}
  - {name: act1, type: leaky_relu, slope: 0.01}
  - {name: pool1, type: maxpool, kernel: 2}
  - {name: flatten, type: flatten}
  - {name: fc1, type: linear, out: 16}
  - {name: act2, type: leaky_relu, slope: 0.01}
  - {name: fc2, type: linear, out: 8}
  - {name: act3, type: leaky_relu, slope: 0.01}
  - {name: fc3, type: linear, out: 1}
loss: mse
)";
  const std::string spatial = fmt::format("{{sample: 1, spatial: [{}, 1, 1]}}", ranks());
  expect_same_as_one_rank(model,
                          plan_with({{"conv1", spatial}, {"act1", spatial}, {"pool1", spatial}, {"fc1", filter_all()},
                                     {"act2", filter_all()}, {"fc2", channel_all()}}),
                          1, 4, sgd_momentum(), 0.002);
}

// ---------------------------------------------------------------------------------------------
// Memory

TEST(ModelParallelMemory, WeightsAndOptimizerStateShrinkWithTheModelSplit) {
  // Two wide layers dominate; the (replicated) classifier adds a little.
  const std::string model = R"(
input: {shape: [64]}
layers:
  - {name: fc1, type: linear, out: 256}
  - {name: act1, type: relu}
  - {name: fc2, type: linear, out: 256}
  - {name: act2, type: relu}
  - {name: out, type: linear, out: 10}
loss: softmax_cross_entropy
)";
  OptimizerConfig adam;
  adam.type = "adam";
  auto world = MpiCommunicator::world();
  std::shared_ptr<Communicator> self = world->split(world->rank(), 0);
  const TrainingRun one = train(model, Plan::sample_parallel(1), self, 8, 1, adam, 0.01);
  for (const std::string& second : {filter_all(), channel_all(), two_d()}) {
    SCOPED_TRACE(second);
    const TrainingRun split = train(model, Plan::parse(plan_with({{"fc1", two_d()}, {"fc2", second}}), "p"), world, 8, 1,
                                    adam, 0.01);
    // The classifier (10 x 256 + 10) and the biases of channel-split layers stay whole.
    const double replicated = 4.0 * (10 * 256 + 10 + 2 * 256);
    const double p = ranks();
    EXPECT_LE(static_cast<double>(split.parameter_bytes), static_cast<double>(one.parameter_bytes) / p + 2 * replicated)
        << "one rank " << one.parameter_bytes << " bytes, split " << split.parameter_bytes;
    EXPECT_LE(static_cast<double>(split.optimizer_bytes), static_cast<double>(one.optimizer_bytes) / p + 2 * replicated)
        << "one rank " << one.optimizer_bytes << " bytes, split " << split.optimizer_bytes;
    // The blocks of the split weights tile the whole weights exactly.
    std::int64_t weights = 0, whole = 0;
    for (std::size_t i = 0; i < split.weights.size(); ++i)
      if (split.sharded[i] && split.weights[i].rank() == 2) {
        weights += split.weights[i].numel();
        whole += one.weights[i].numel();
      }
    EXPECT_EQ(world->allreduce_value(weights), whole);
  }
}

// ---------------------------------------------------------------------------------------------
// Blocks built alone: a model parsed without its whole weights (what tessera train does) allocates
// and initialises only each rank's blocks after the split, equal to the blocks of the whole
// initialisation

TEST(ModelParallelBlocks, DeferredBlocksEqualTheWholeInitialisation) {
  auto world = MpiCommunicator::world();
  const std::vector<std::pair<std::string, std::string>> cases{
      {kMlp, plan_with({{"fc1", filter_all()}, {"fc2", channel_all()}, {"fc3", two_d()}})},
      {kConvNet, plan_with({{"c1", filter_all()}, {"c2", channel_all()}, {"c3", two_d(false)}})}};
  for (const auto& [model_text, plan_text] : cases) {
    SCOPED_TRACE(plan_text);
    const Plan plan = Plan::parse(plan_text, "p.yaml");
    ExecutorOptions options;
    options.global_batch = 8;
    options.seed = 13;
    Model whole = Model::parse(model_text, "m.yaml");
    whole.init_parameters(7);
    Executor split_after(whole, plan, world, options);
    ModelOptions deferred;
    deferred.allocate_parameters = false;
    Model blocks = Model::parse(model_text, "m.yaml", deferred);
    for (auto* p : blocks.parameters()) EXPECT_FALSE(p->allocated()) << p->name;  // nothing before the split
    options.init_seed = 7;
    Executor split_first(blocks, plan, world, options);
    const auto a = whole.parameters(), b = blocks.parameters();
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      SCOPED_TRACE(a[i]->name);
      ASSERT_TRUE(b[i]->allocated());
      EXPECT_EQ(a[i]->sharded(), b[i]->sharded());
      EXPECT_EQ(a[i]->whole_box().begin, b[i]->whole_box().begin);
      EXPECT_EQ(a[i]->whole_box().extent, b[i]->whole_box().extent);
      const Tensor x = a[i]->value.to(Device::host()), y = b[i]->value.to(Device::host());
      ASSERT_EQ(x.numel(), y.numel());
      EXPECT_EQ(std::memcmp(x.data(), y.data(), static_cast<std::size_t>(x.numel()) * sizeof(float)), 0);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Checkpoints hold global tensors: a sharded run's checkpoint restores at one rank and under the plan

struct Trainee {
  std::unique_ptr<Model> model;
  std::unique_ptr<Executor> executor;
  std::unique_ptr<Optimizer> optimizer;
  std::int64_t batch = 6;

  Trainee(const std::string& model_text, const Plan& plan, std::shared_ptr<Communicator> comm,
          std::uint64_t init_seed) {
    model = std::make_unique<Model>(Model::parse(model_text, "m"));
    model->init_parameters(init_seed);
    ExecutorOptions options;
    options.global_batch = batch;
    options.seed = 13;
    executor = std::make_unique<Executor>(*model, plan, comm, options);
    OptimizerConfig adam;
    adam.type = "adam";
    optimizer = create_optimizer(adam);
  }
  std::vector<double> train(int from, int to) {
    std::vector<double> losses;
    const auto params = model->parameters();
    Tensor inputs, labels;
    for (int step = from; step < to; ++step) {
      synthetic_batch(model->sample_shape(), batch, step, inputs, labels);
      const auto [begin, end] = executor->local_samples(batch);
      const BatchResult r = executor->train_step(local_tile(inputs, begin, end, executor->input_sample_box()),
                                                 labels.slice(begin, end).clone(), batch, step);
      losses.push_back(r.mean_loss());
      optimizer->step(params, 0.01);
    }
    return losses;
  }
  CheckpointMeta meta(std::int64_t step) const { return {step, 0, batch, 13, "model-parallel"}; }
  /// Parameters and optimizer state with their blocks.
  std::vector<std::pair<Tensor, Box>> state() {
    std::vector<std::pair<Tensor, Box>> out;
    std::map<std::string, Box> boxes;
    for (auto* p : model->parameters()) {
      out.emplace_back(p->value.clone(), p->whole_box());
      boxes[p->name] = p->whole_box();
    }
    for (auto& [name, t] : optimizer->state()) out.emplace_back(t->clone(), boxes.at(name.substr(0, name.rfind('.'))));
    for (auto& node : model->nodes())
      for (std::size_t i = 0; i < node.layer->buffers().size(); ++i) {
        std::vector<std::int64_t> global;
        out.emplace_back(node.layer->buffers()[i]->clone(), node.layer->buffer_box(i, global));
      }
    return out;
  }
};

/// A fresh folder under the temporary directory, named alike on every rank (rank 0's pid) and made
/// by rank 0 before any rank goes on.
std::string scratch_folder(Communicator& world, const char* what) {
  std::int64_t pid = static_cast<std::int64_t>(::getpid());
  world.broadcast(std::span<std::int64_t>(&pid, 1), 0);
  const std::string dir =
      (std::filesystem::temp_directory_path() / fmt::format("tessera_mp_{}_{}_np{}", what, pid, world.size())).string();
  if (world.rank() == 0) std::filesystem::create_directories(dir);
  world.barrier();
  return dir;
}

void expect_checkpoint_round_trip(const std::string& model_text, const Plan& plan) {
  auto world = MpiCommunicator::world();
  std::shared_ptr<Communicator> self = world->split(world->rank(), 0);
  const std::string dir = scratch_folder(*world, "ckpt");

  Trainee sharded(model_text, plan, world, 13);
  sharded.train(0, 3);
  const std::string path = save_checkpoint(dir, *sharded.model, *sharded.executor, *sharded.optimizer, sharded.meta(3));
  Trainee reference(model_text, Plan::sample_parallel(1), self, 13);
  reference.train(0, 3);
  const auto expected = reference.state();

  // At one rank: every tensor whole, as the 1-rank run has it.
  Trainee one(model_text, Plan::sample_parallel(1), self, 99);
  EXPECT_EQ(restore_checkpoint(path, *one.model, *one.executor, *one.optimizer, one.meta(0)).step, 3);
  auto restored = one.state();
  ASSERT_EQ(restored.size(), expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i)
    EXPECT_LT(relative_error(restored[i].first, expected[i].first), 1e-5) << "state tensor " << i;

  // Under the plan again: each rank reads its blocks; training goes on as the 1-rank run does.
  Trainee again(model_text, plan, world, 99);
  restore_checkpoint(path, *again.model, *again.executor, *again.optimizer, again.meta(0));
  restored = again.state();
  ASSERT_EQ(restored.size(), expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i)
    EXPECT_LT(relative_error(restored[i].first, block_of(expected[i].first, restored[i].second)), 1e-5)
        << "state tensor " << i;
  const auto losses = again.train(3, 5), reference_losses = reference.train(3, 5);
  for (std::size_t s = 0; s < losses.size(); ++s)
    EXPECT_NEAR(losses[s], reference_losses[s], 1e-5 * std::fabs(reference_losses[s])) << "step " << 3 + s;
  world->barrier();
  if (world->rank() == 0) std::filesystem::remove_all(dir);
}

/// Whether `a` holds exactly the values of `b`.
bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::host()).clone(), y = b.to(Device::host()).clone();
  return x.numel() == y.numel() &&
         std::memcmp(x.data(), y.data(), static_cast<std::size_t>(x.numel()) * sizeof(float)) == 0;
}

TEST(ModelParallelCheckpoint, BlocksRoundTripBitForBitAcrossPlans) {
  // A checkpoint of a filter x channel plan (2 x 2 at 4 ranks), restored at 1 rank, and under a
  // 2-rank filter plan that saves it again, restored at 1 rank once more: the same values to the bit.
  auto world = MpiCommunicator::world();
  std::shared_ptr<Communicator> self = world->split(world->rank(), 0);
  const std::string dir = scratch_folder(*world, "bits");
  if (world->rank() == 0) std::filesystem::create_directories(dir + "/two");
  world->barrier();
  Trainee sharded(kMlp, Plan::parse(plan_with({{"fc1", two_d()}, {"fc2", two_d(false)}, {"fc3", filter_all()}}), "p"),
                  world, 13);
  sharded.train(0, 2);
  const std::string path = save_checkpoint(dir, *sharded.model, *sharded.executor, *sharded.optimizer, sharded.meta(2));
  Trainee one(kMlp, Plan::sample_parallel(1), self, 99);
  restore_checkpoint(path, *one.model, *one.executor, *one.optimizer, one.meta(0));
  const auto whole = one.state();
  const bool pair_member = world->size() >= 2 && world->rank() < 2;
  std::shared_ptr<Communicator> pair = world->split(pair_member ? 0 : 1, world->rank());
  if (pair_member) {
    const Plan filter2 = Plan::parse("ranks: 2\ndefault: {sample: 2}\nlayers:\n  fc1: {sample: 1, filter: 2}\n"
                                     "  fc2: {sample: 1, filter: 2}\n  fc3: {sample: 1, filter: 2}\n", "f2");
    Trainee two(kMlp, filter2, pair, 99);
    restore_checkpoint(path, *two.model, *two.executor, *two.optimizer, two.meta(0));
    const auto blocks = two.state();
    ASSERT_EQ(blocks.size(), whole.size());
    for (std::size_t i = 0; i < whole.size(); ++i)
      EXPECT_TRUE(same_bits(blocks[i].first, block_of(whole[i].first, blocks[i].second))) << "state tensor " << i;
    const std::string again = save_checkpoint(dir + "/two", *two.model, *two.executor, *two.optimizer, two.meta(2));
    Trainee back(kMlp, Plan::sample_parallel(1), self, 7);
    restore_checkpoint(again, *back.model, *back.executor, *back.optimizer, back.meta(0));
    const auto round_trip = back.state();
    ASSERT_EQ(round_trip.size(), whole.size());
    for (std::size_t i = 0; i < whole.size(); ++i)
      EXPECT_TRUE(same_bits(round_trip[i].first, whole[i].first)) << "state tensor " << i;
  }
  world->barrier();
  if (world->rank() == 0) std::filesystem::remove_all(dir);
}

TEST(ModelParallelCheckpoint, ShardedCheckpointRestoresAtOneRankAndUnderThePlan) {
  expect_checkpoint_round_trip(
      kMlp, Plan::parse(plan_with({{"fc1", two_d()}, {"fc2", filter_all()}, {"fc3", channel_all()}}), "p"));
}

TEST(ModelParallelCheckpoint, FilterSplitBatchNormStatisticsRoundTrip) {
  const std::string split = filter_all();
  expect_checkpoint_round_trip(kConvBatchNormNet,
                               Plan::parse(plan_with({{"c1", split}, {"bn1", split}, {"a1", split}, {"drop", split},
                                                      {"c2", channel_all()}, {"fc1", split}, {"bnf", split}}),
                                           "p"));
}

// ---------------------------------------------------------------------------------------------
// Plans that cannot work

TEST(ModelParallelPlans, ImpossibleSplitsAreRefusedOnEveryRank) {
  // With one rank every part count is 1: the same plans are accepted there.
  const int p = ranks();
  const bool reporter = p > 1 && MpiCommunicator::world()->rank() == 0;  // the other ranks say "see rank 0"
  const auto accepted_on_one_rank = [&](const std::string& message) {
    if (p == 1) {
      EXPECT_EQ(message, "");
    }
  };
  // Point-wise layers hold no weights to split by input channel.
  std::string message = refusal(kMlp, plan_with({{"act1", channel_all()}}), 4);
  accepted_on_one_rank(message);
  if (reporter) expect_message(message, {"layer 'act1'", "a leaky_relu layer cannot be split by channel"});
  // More filter parts than outputs.
  const std::string narrow = R"(
input: {shape: [12]}
layers:
  - {name: thin, type: linear, out: 1}
  - {name: out, type: linear, out: 10}
loss: softmax_cross_entropy
)";
  message = refusal(narrow, plan_with({{"thin", filter_all()}}), 4);
  accepted_on_one_rank(message);
  if (reporter) expect_message(message, {"layer 'thin'", fmt::format("{} filter parts but the layer has 1 output", p)});
  // The loss needs whole samples.
  message = refusal(kMlp, plan_with({{"out", filter_all()}}), 4);
  accepted_on_one_rank(message);
  if (reporter) expect_message(message, {"the output layer 'out' must be split by sample only"});
}

}  // namespace
}  // namespace tessera
