// The executor on a GPU against the executor on the host: the same model, seed, data, optimizer
// and learning rate, one rank each (a GPU plan is refused over more ranks so far). Every step's
// loss, the evaluation loss, the first step's gradients and the final weights agree within 1e-5
// relative (fp32: the GPU's convolutions and GEMMs sum in other orders; the optimizer updates
// are bit-equal, test_gpu_kernels). The models cover every layer with GPU kernels: 2-D and 3-D
// convolutions (stride, dilation), max and average pooling, ReLU, leaky ReLU, flatten, add,
// concat, linear, and both losses; SGD with momentum and AdamW. Checkpoints of GPU state round-trip.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "invariant/invariant_harness.hpp"
#include "tessera/core/cuda.hpp"
#include "tessera/train/checkpoint.hpp"

namespace tessera {
namespace {

using testing::relative_error;
using testing::TrainingRun;

const Device kGpu = Device::cuda(0);

void expect_gpu_equals_host(const std::string& model_text, std::int64_t batch, const OptimizerConfig& optimizer,
                            double lr) {
  auto world = MpiCommunicator::world();
  ASSERT_EQ(world->size(), 1) << "gpu.train runs on one rank";
  const Plan plan = Plan::sample_parallel(1);
  const TrainingRun host = testing::train(model_text, plan, world, batch, 4, optimizer, lr, HaloOverlap::Never);
  const TrainingRun gpu =
      testing::train(model_text, plan, world, batch, 4, optimizer, lr, HaloOverlap::Never, kGpu);
  ASSERT_EQ(host.losses.size(), gpu.losses.size());
  for (std::size_t s = 0; s < host.losses.size(); ++s) {
    EXPECT_TRUE(std::isfinite(host.losses[s]));
    EXPECT_NEAR(gpu.losses[s], host.losses[s], 1e-5 * std::fabs(host.losses[s])) << "step " << s;
  }
  EXPECT_NE(host.losses.front(), host.losses.back()) << "the losses must move, or the comparison proves little";
  EXPECT_NEAR(gpu.evaluation_loss, host.evaluation_loss, 1e-5 * std::fabs(host.evaluation_loss));
  ASSERT_EQ(host.weights.size(), gpu.weights.size());
  for (std::size_t i = 0; i < host.weights.size(); ++i) {
    EXPECT_GT(relative_error(host.first_gradients[i], Tensor(host.first_gradients[i].shape())), 0.5)
        << "parameter " << i << " has a zero gradient: the comparison would prove nothing";
    EXPECT_LT(relative_error(host.first_gradients[i], gpu.first_gradients[i]), 1e-5) << "gradient of parameter " << i;
    EXPECT_LT(relative_error(host.weights[i], gpu.weights[i]), 1e-5) << "parameter " << i;
  }
  EXPECT_EQ(host.optimizer_bytes, gpu.optimizer_bytes);
}

TEST(GpuTrain, CnnWithPoolingBranchesAndSoftmaxSgdMomentum) {
  expect_gpu_equals_host(R"(
input: {shape: [2, 12, 12]}
layers:
  - {name: conv1, type: conv, filters: 4, kernel: 3, padding: 1}
  - {name: relu1, type: relu}
  - {name: left, type: conv, filters: 4, kernel: 3, padding: 2, dilation: 2}
  - {name: right, type: conv, filters: 4, kernel: 1, inputs: [relu1]}
  - {name: sum, type: add, inputs: [left, right]}
  - {name: pool, type: maxpool, kernel: 2}
  - {name: down, type: conv, filters: 6, kernel: 3, stride: 2, padding: 1}
  - {name: act, type: leaky_relu, slope: 0.1}
  - {name: avg, type: avgpool, kernel: 3, stride: 1, padding: 1}
  - {name: both, type: concat, inputs: [act, avg]}
  - {name: flatten, type: flatten}
  - {name: fc, type: linear, out: 10}
loss: softmax_cross_entropy
)",
                         12, testing::sgd_momentum(), 0.05);
}

TEST(GpuTrain, CosmoFlowStyle3dCnnWithMseAdamW) {
  OptimizerConfig adamw;
  adamw.type = "adamw";
  adamw.weight_decay = 0.01;
  expect_gpu_equals_host(R"(
input: {shape: [1, 16, 16, 16]}
layers:
  - {name: conv1, type: conv, filters: 4, kernel: 3, padding: 1}
  - {name: act1, type: leaky_relu, slope: 0.01}
  - {name: pool1, type: maxpool, kernel: 2}
  - {name: conv2, type: conv, filters: 8, kernel: 3, padding: 1}
  - {name: act2, type: leaky_relu, slope: 0.01}
  - {name: pool2, type: maxpool, kernel: 2}
  - {name: flatten, type: flatten}
  - {name: fc1, type: linear, out: 16}
  - {name: act3, type: leaky_relu, slope: 0.01}
  - {name: fc2, type: linear, out: 4}
loss: mse
)",
                         4, adamw, 1e-3);
}

TEST(GpuTrain, TheModelLivesOnTheGpu) {
  Model model = Model::parse(R"(
input: {shape: [1, 8, 8]}
layers:
  - {name: conv, type: conv, filters: 2, kernel: 3}
  - {name: flatten, type: flatten}
  - {name: fc, type: linear, out: 3}
loss: mse
)",
                             "m");
  model.init_parameters(1);
  ExecutorOptions options;
  options.global_batch = 2;
  options.device = kGpu;
  Executor executor(model, Plan::sample_parallel(1), MpiCommunicator::world(), options);
  EXPECT_EQ(executor.device(), kGpu);
  for (Parameter* p : model.parameters()) {
    EXPECT_EQ(p->value.device(), kGpu) << p->name;
    EXPECT_EQ(p->grad.device(), kGpu) << p->name;
  }
}

TEST(GpuTrain, LayersWithoutGpuKernelsSayWhich) {
  Model model = Model::parse(R"(
input: {shape: [2, 6, 6]}
layers:
  - {name: conv, type: conv, filters: 3, kernel: 3}
  - {name: bn, type: batchnorm}
  - {name: flatten, type: flatten}
  - {name: fc, type: linear, out: 10}
loss: softmax_cross_entropy
)",
                             "bn_model");
  model.init_parameters(3);
  ExecutorOptions options;
  options.global_batch = 4;
  options.device = kGpu;
  Executor executor(model, Plan::sample_parallel(1), MpiCommunicator::world(), options);
  Tensor inputs, labels;
  testing::synthetic_batch(model.sample_shape(), 4, 0, inputs, labels);
  try {
    executor.train_step(inputs, labels, 4, 0);
    ADD_FAILURE() << "batch norm ran on a GPU tensor without GPU kernels";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bn"), std::string::npos) << e.what();
  }
}

TEST(GpuTrain, CheckpointsOfGpuStateRoundTripExactly) {
  // Saved from the GPU through a host copy, restored into another model on the GPU: parameters
  // and Adam's moments come back bit for bit, and stay on the GPU.
  auto world = MpiCommunicator::world();
  const std::string model_file = std::string(TESSERA_SOURCE_DIR) + "/models/fashion_cnn.yaml";
  const auto dir = std::filesystem::temp_directory_path() / ("tessera_gpu_checkpoint_" + std::to_string(::getpid()));
  OptimizerConfig adam;
  adam.type = "adam";
  CheckpointMeta meta;
  meta.step = 2;
  meta.global_batch = 8;
  meta.seed = 3;
  meta.plan_text = Plan::sample_parallel(1).to_yaml();
  ExecutorOptions options;
  options.global_batch = 8;
  options.seed = 3;
  options.device = kGpu;
  std::vector<Tensor> values, state;
  std::string path;
  {
    Model model = Model::load(model_file);
    model.init_parameters(3);
    Executor executor(model, Plan::sample_parallel(1), world, options);
    auto optimizer = create_optimizer(adam);
    Tensor inputs, labels;
    for (int step = 0; step < 2; ++step) {
      testing::synthetic_batch(model.sample_shape(), 8, step, inputs, labels);
      executor.train_step(inputs, labels, 8, step);
      optimizer->step(model.parameters(), 1e-3);
    }
    path = save_checkpoint(dir.string(), model, executor, *optimizer, meta, 1);
    for (Parameter* p : model.parameters()) values.push_back(p->value.to(Device::host()).clone());
    for (auto& [name, tensor] : optimizer->state()) state.push_back(tensor->to(Device::host()).clone());
  }
  Model model = Model::load(model_file);
  model.init_parameters(99);  // other weights: the restore must overwrite them
  Executor executor(model, Plan::sample_parallel(1), world, options);
  auto optimizer = create_optimizer(adam);
  restore_checkpoint(path, model, executor, *optimizer, meta);
  const auto params = model.parameters();
  ASSERT_EQ(params.size(), values.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i]->value.device(), kGpu) << params[i]->name;
    EXPECT_EQ(max_relative_difference(values[i], params[i]->value.to(Device::host())), 0.0) << params[i]->name;
  }
  const auto restored = optimizer->state();
  ASSERT_EQ(restored.size(), state.size());
  for (std::size_t i = 0; i < state.size(); ++i) {
    EXPECT_EQ(restored[i].second->device(), kGpu) << restored[i].first;
    EXPECT_EQ(max_relative_difference(state[i], restored[i].second->to(Device::host())), 0.0) << restored[i].first;
  }
  EXPECT_GT(relative_error(state.back(), Tensor(state.back().shape())), 0.0) << "Adam's moments must not be zero";
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tessera
