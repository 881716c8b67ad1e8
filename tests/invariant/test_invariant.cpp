// The one invariant for whole models: a sample-parallel run on this job's ranks gives the same
// loss at every step and the same final weights as a 1-rank run of the same model, seed and
// global batch. Each rank computes the 1-rank reference itself on a communicator of its own.
#include <gtest/gtest.h>

#include <cmath>

#include "training_test_util.hpp"
#include "tessera/core/cuda.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/parallel/mpi_communicator.hpp"
#include "tessera/train/executor.hpp"
#include "tessera/train/optimizer.hpp"

namespace tessera {
namespace {
using testing::relative_error;
using testing::synthetic_batch;

struct Run {
  std::vector<double> losses;
  std::vector<Tensor> weights;
};


Run train(const std::string& model_file, std::shared_ptr<Communicator> comm, std::int64_t batch, int steps,
          const OptimizerConfig& optimizer_config, double lr) {
  Model model = Model::load(std::string(TESSERA_SOURCE_DIR) + "/models/" + model_file);
  model.init_parameters(7);
  ExecutorOptions options;
  options.global_batch = batch;
  options.seed = 7;
  options.reducer.bucket_bytes = 64 << 10;  // several buckets, so bucketing is exercised
  options.poison_dead_tensors = true;  // a tensor read past its lifetime in the arena gives NaNs
  Executor executor(model, Plan::sample_parallel(comm->size()), comm, options);
  auto optimizer = create_optimizer(optimizer_config);
  const auto params = model.parameters();
  Run run;
  Tensor inputs, labels;
  for (int step = 0; step < steps; ++step) {
    synthetic_batch(model.sample_shape(), batch, step, inputs, labels);
    const auto [begin, end] = executor.local_samples(batch);
    const Tensor local_inputs = inputs.slice(begin, end).clone();
    const Tensor local_labels = labels.slice(begin, end).clone();
    const BatchResult r = executor.train_step(local_inputs, local_labels, batch, step);
    EXPECT_EQ(r.samples, batch);
    run.losses.push_back(r.mean_loss());
    optimizer->step(params, lr);
  }
  for (auto* p : params) run.weights.push_back(p->value.clone());
  return run;
}


void expect_same_as_one_rank(const std::string& model_file, std::int64_t batch, int steps,
                             const OptimizerConfig& optimizer, double lr) {
  auto world = MpiCommunicator::world();
  std::shared_ptr<Communicator> self = world->split(world->rank(), 0);
  const Run reference = train(model_file, self, batch, steps, optimizer, lr);
  const Run parallel = train(model_file, world, batch, steps, optimizer, lr);
  ASSERT_EQ(reference.losses.size(), parallel.losses.size());
  for (std::size_t s = 0; s < reference.losses.size(); ++s) {
    EXPECT_TRUE(std::isfinite(reference.losses[s]));
    EXPECT_NEAR(parallel.losses[s], reference.losses[s], 1e-5 * std::fabs(reference.losses[s]))
        << model_file << " step " << s << " on " << world->size() << " ranks";
  }
  // The losses must actually move, or the comparison proves little.
  EXPECT_NE(reference.losses.front(), reference.losses.back());
  ASSERT_EQ(reference.weights.size(), parallel.weights.size());
  for (std::size_t i = 0; i < reference.weights.size(); ++i)
    EXPECT_LT(relative_error(reference.weights[i], parallel.weights[i]), 1e-5)
        << model_file << " parameter " << i << " on " << world->size() << " ranks";
}

TEST(Invariant, FashionCnnSgdMomentum) {
  OptimizerConfig sgd;
  sgd.momentum = 0.9;
  expect_same_as_one_rank("fashion_cnn.yaml", 22, 6, sgd, 0.05);
}

TEST(Invariant, ResidualCnnWithGlobalBatchNormAndDropoutAdam) {
  OptimizerConfig adam;
  adam.type = "adam";
  expect_same_as_one_rank("residual_cnn.yaml", 16, 6, adam, 1e-3);
}

TEST(Invariant, AGpuWhereThereIsNoneIsRefusedByEveryRank) {
  // Without a usable GPU every rank refuses a GPU executor with the same exit code, rank 0 saying
  // why (the GPU tests, gpu.train, run the accepted case against the host).
  auto world = MpiCommunicator::world();
  Model model = Model::load(std::string(TESSERA_SOURCE_DIR) + "/models/fashion_cnn.yaml");
  model.init_parameters(7);
  ExecutorOptions options;
  options.global_batch = 8;
  options.device = Device::cuda(ExecutorOptions::kNodeLocalGpu);
  std::string message;
  int code = 0;
  try {
    Executor executor(model, Plan::sample_parallel(world->size()), world, options);
  } catch (const AgreedFailure& e) {
    message = e.what();
    code = e.exit_code();
  }
  if (cuda::device_count() == 0) {
    EXPECT_EQ(code, 2) << message;
    if (world->rank() == 0) {  // the others' message points to rank 0's
      EXPECT_NE(message.find("needs one, but " + cuda::unavailable_reason()), std::string::npos) << message;
    }
  } else {
    EXPECT_EQ(message, "");
  }
}

TEST(Invariant, TheLayerProfileTimesEveryLayerOfTrainingSteps) {
  auto world = MpiCommunicator::world();
  Model model = Model::load(std::string(TESSERA_SOURCE_DIR) + "/models/fashion_cnn.yaml");
  model.init_parameters(7);
  ExecutorOptions options;
  options.global_batch = 8;
  Executor quiet(model, Plan::sample_parallel(world->size()), world, options);
  EXPECT_TRUE(quiet.layer_profile().empty());
  options.profile = true;
  Executor executor(model, Plan::sample_parallel(world->size()), world, options);
  Tensor inputs, labels;
  synthetic_batch(model.sample_shape(), 8, 0, inputs, labels);
  const auto [begin, end] = executor.local_samples(8);
  const Tensor local_inputs = inputs.slice(begin, end).clone(), local_labels = labels.slice(begin, end).clone();
  executor.evaluate(local_inputs, local_labels, 8);  // not profiled: evaluation is not a training step
  for (const auto& t : executor.layer_profile()) EXPECT_EQ(t.forward_seconds, 0.0) << t.name;
  for (int step = 0; step < 2; ++step) executor.train_step(local_inputs, local_labels, 8, step);
  const auto& profile = executor.layer_profile();
  ASSERT_EQ(profile.size(), model.nodes().size());
  for (std::size_t i = 0; i < profile.size(); ++i) {
    EXPECT_EQ(profile[i].name, model.nodes()[i].layer->name());
    EXPECT_GT(profile[i].forward_seconds, 0.0) << profile[i].name;
    EXPECT_GT(profile[i].backward_seconds, 0.0) << profile[i].name;
    EXPECT_EQ(profile[i].exchange_seconds, 0.0) << profile[i].name << ": sample parallel exchanges nothing";
  }
  executor.reset_layer_profile();
  for (const auto& t : executor.layer_profile()) EXPECT_EQ(t.backward_seconds, 0.0) << t.name;
}

TEST(Invariant, LocalBatchNormRunningStatisticsAreAveragedBeforeEvaluation) {
  // With local statistics each rank's running averages differ after training; evaluation must
  // still use one model on every rank.
  auto world = MpiCommunicator::world();
  Model model = Model::parse(R"(
input: {shape: [2, 6, 6]}
layers:
  - {name: conv, type: conv, filters: 3, kernel: 3}
  - {name: bn, type: batchnorm}
  - {name: flatten, type: flatten}
  - {name: fc, type: linear, out: 10}
loss: softmax_cross_entropy
)",
                             "local_bn");
  model.init_parameters(3);
  ExecutorOptions options;
  options.global_batch = 8;
  Executor executor(model, Plan::sample_parallel(world->size()), world, options);
  Tensor inputs, labels;
  synthetic_batch(model.sample_shape(), 8, 0, inputs, labels);
  const auto [begin, end] = executor.local_samples(8);
  executor.train_step(inputs.slice(begin, end).clone(), labels.slice(begin, end).clone(), 8, 0);
  Tensor* mean = model.nodes()[1].layer->buffers().at(0);
  const auto spread = [&] {
    double worst = 0;
    for (std::int64_t c = 0; c < mean->numel(); ++c) {
      const float v = mean->data()[c];
      worst = std::max(worst, static_cast<double>(world->allreduce_value(v, ReduceOp::Max) -
                                                  world->allreduce_value(v, ReduceOp::Min)));
    }
    return worst;
  };
  if (world->size() > 1) {
    EXPECT_GT(spread(), 1e-4) << "local statistics should differ between ranks";
  }
  executor.average_buffers();
  EXPECT_LT(spread(), 1e-7);
}

}  // namespace
}  // namespace tessera
