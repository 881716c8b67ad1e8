// The invariant on GPUs: the executor training on this job's ranks, one GPU each (gpu_train: ranks
// may share one, and then messages go through host memory; gpu_train_nccl: messages over NCCL, one
// GPU per rank), against the 1-rank run on the host of the same model,
// seed, data, optimizer and learning rate. Every step's loss, the evaluation loss, the first
// step's gradients and the final weights (each rank's block) agree within 1e-5 relative (fp32:
// the GPU's convolutions and GEMMs sum in other orders; the optimizer updates are bit-equal,
// test_gpu_kernels). Plans: sample parallel; spatial (conv blocks split along D, halos and
// redistributions); filter and channel splits. The models cover every layer with GPU kernels:
// 2-D and 3-D convolutions (stride, dilation), max and average pooling, batch norm with global
// statistics, dropout, ReLU, leaky ReLU, flatten, add, concat, linear, and both losses (MSE on one
// target: the harness's labels); SGD with momentum and AdamW; bf16 (native convolutions: within 1e-2).
// Checkpoints of GPU state round-trip.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include <fmt/format.h>

#include "invariant/invariant_harness.hpp"
#include "tessera/core/cuda.hpp"
#include "tessera/parallel/nccl_communicator.hpp"
#include "tessera/train/checkpoint.hpp"

namespace tessera {
namespace {

using testing::plan_for;
using testing::ranks;
using testing::relative_error;

#ifdef TESSERA_GPU_TRAIN_ON_HOST
// gpu_train_logic_on_host: the same tests on the host (their logic, in builds without a GPU).
const Device kGpu = Device::host();
#else
const Device kGpu = Device::cuda(ExecutorOptions::kNodeLocalGpu);
#endif
#ifdef TESSERA_GPU_TRAIN_NCCL
// gpu_train_nccl: messages between the GPUs over NCCL (one GPU per rank).
constexpr ExecutorOptions::GpuComm kGpuComm = ExecutorOptions::GpuComm::Nccl;
#else
// gpu_train: NCCL where each rank has a GPU of its own, MPI through host memory where ranks share one.
constexpr ExecutorOptions::GpuComm kGpuComm = ExecutorOptions::GpuComm::Automatic;
#endif

const char* kBranchyCnn = R"(
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
  - {name: fc1, type: linear, out: 16}
  - {name: relu2, type: relu}
  - {name: drop, type: dropout, rate: 0.25}
  - {name: fc, type: linear, out: 10}
loss: softmax_cross_entropy
)";


using testing::adamw;
using testing::cosmo_style_model;

void expect_gpu_plan_equals_one_host_rank(const std::string& model, const std::string& plan, std::int64_t batch,
                                          const OptimizerConfig& optimizer, double lr, double tolerance = 1e-5) {
  testing::expect_same_as_one_rank(model, plan, batch, 4, optimizer, lr, HaloOverlap::Never, kGpu, tolerance, kGpuComm);
}

TEST(GpuTrain, CnnWithPoolingBranchesAndSoftmaxSampleParallel) {
  expect_gpu_plan_equals_one_host_rank(kBranchyCnn, plan_for({}, ""), 12, testing::sgd_momentum(), 0.05);
}

TEST(GpuTrain, CnnWithLayersSplitByFilterAndChannel) {
  const std::string split = ranks() == 1 ? "{sample: 1}" : fmt::format("{{sample: 1, filter: {}}}", ranks());
  expect_gpu_plan_equals_one_host_rank(kBranchyCnn, plan_for({"down", "fc1"}, split), 12, testing::sgd_momentum(),
                                       0.05);
  const std::string channels = ranks() == 1 ? "{sample: 1}" : fmt::format("{{sample: 1, channel: {}}}", ranks());
  expect_gpu_plan_equals_one_host_rank(kBranchyCnn, plan_for({"fc1"}, channels), 12, testing::sgd_momentum(), 0.05);
}

TEST(GpuTrain, CnnWithGlobalBatchNormSampleParallel) {
  // Global statistics: the ranks normalise with the whole batch's, as one rank does. No bias before
  // a batch norm: its gradient is zero up to rounding, which no relative comparison can judge.
  const std::string global = R"(
input: {shape: [2, 10, 10]}
layers:
  - {name: conv1, type: conv, filters: 4, kernel: 3, padding: 1, bias: false}
  - {name: bn1, type: batchnorm, global: true}
  - {name: relu1, type: relu}
  - {name: pool, type: maxpool, kernel: 2}
  - {name: conv2, type: conv, filters: 6, kernel: 3, bias: false}
  - {name: bn2, type: batchnorm, global: true}
  - {name: relu2, type: relu}
  - {name: flatten, type: flatten}
  - {name: fc, type: linear, out: 10}
loss: softmax_cross_entropy
)";
  expect_gpu_plan_equals_one_host_rank(global, plan_for({}, ""), 12, testing::sgd_momentum(), 0.05);
}

TEST(GpuTrain, CosmoFlowStyle3dCnnSampleParallelAdamW) {
  expect_gpu_plan_equals_one_host_rank(cosmo_style_model(), plan_for({}, ""), 4, adamw(), 1e-3);
}

TEST(GpuTrain, CosmoFlowStyle3dCnnConvBlocksSplitAlongD) {
  const std::string split = fmt::format("{{sample: 1, spatial: [{}, 1, 1]}}", ranks());
  expect_gpu_plan_equals_one_host_rank(
      cosmo_style_model(), plan_for({"conv1", "act1", "pool1", "conv2", "act2", "pool2"}, split), 4, adamw(), 1e-3);
}

TEST(GpuTrain, CosmoFlowStyle3dCnnSplitAlongDWithHaloOverlap) {
  // Halo overlap on the GPU: interiors computed while the halos travel (packed on the GPU), the
  // boundary outputs recomputed, the input gradient's halos sent back during the weight gradients.
  const std::string split = fmt::format("{{sample: 1, spatial: [{}, 1, 1]}}", ranks());
  testing::expect_same_as_one_rank(cosmo_style_model(), plan_for({"conv1", "act1", "pool1", "conv2", "act2", "pool2"}, split),
                                   4, 4, adamw(), 1e-3, HaloOverlap::Always, kGpu, 1e-5, kGpuComm);
}

TEST(GpuTrain, Bf16CosmoFlowStyle3dCnnSampleParallelAndSplitAlongD) {
  // bf16 operands: cuDNN on bf16 tensors (Bf16Convolutions::Native, the default: results rounded
  // to bf16) and cuBLAS on bf16 tensor cores, against the host's fp32 kernels over the rounded
  // operands (1-rank reference, fp32 results). Both sum in fp32, in other orders, and the GPU's
  // convolution results are rounded once more: a value may round to the other bf16 neighbour as
  // the next layer's operand (2^-8 relative), so the runs agree within bf16's bound, 1e-2 (SGD:
  // AdamW's sign-like first step would turn a flipped near-zero gradient into a whole
  // learning-rate step).
  const std::string model = "precision: bf16\n" + cosmo_style_model();
  expect_gpu_plan_equals_one_host_rank(model, plan_for({}, ""), 4, testing::sgd_momentum(), 1e-3, 1e-2);
  const std::string split = fmt::format("{{sample: 1, spatial: [{}, 1, 1]}}", ranks());
  expect_gpu_plan_equals_one_host_rank(model, plan_for({"conv1", "act1", "pool1", "conv2", "act2", "pool2"}, split), 4,
                                       testing::sgd_momentum(), 1e-3, 1e-2);
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
  options.global_batch = 6;
  options.device = kGpu;
  options.gpu_comm = kGpuComm;
  Executor executor(model, Plan::sample_parallel(ranks()), MpiCommunicator::world(), options);
  EXPECT_EQ(executor.device().is_host(), kGpu.is_host());
  // NCCL when asked for on GPUs; never on the host, nor for one rank unless asked for.
  if (kGpu.is_host() || (kGpuComm == ExecutorOptions::GpuComm::Automatic && ranks() == 1)) {
    EXPECT_FALSE(executor.uses_nccl());
  }
  if (!kGpu.is_host() && kGpuComm == ExecutorOptions::GpuComm::Nccl) {
    EXPECT_TRUE(executor.uses_nccl());
  }
  EXPECT_GE(executor.device().index, 0);
  for (Parameter* p : model.parameters()) {
    EXPECT_EQ(p->value.device(), executor.device()) << p->name;
    EXPECT_EQ(p->grad.device(), executor.device()) << p->name;
  }
}

#if !defined(TESSERA_GPU_TRAIN_ON_HOST) && !defined(TESSERA_GPU_TRAIN_NCCL)
TEST(GpuTrain, NcclIsRefusedClearlyWhereRanksShareAGpuAndUsedWhereEachHasItsOwn) {
  auto world = MpiCommunicator::world();
  Model model = Model::parse(cosmo_style_model(), "m");
  ExecutorOptions options;
  options.global_batch = 4;
  options.device = kGpu;
  const bool shared = ranks_sharing_a_gpu(*world).has_value();
  {
    Executor automatic(model, Plan::sample_parallel(ranks()), world, options);
    EXPECT_EQ(automatic.uses_nccl(), !shared && ranks() > 1);
  }
  options.gpu_comm = ExecutorOptions::GpuComm::Nccl;
  try {
    Executor nccl(model, Plan::sample_parallel(ranks()), world, options);
    EXPECT_FALSE(shared) << "NCCL was accepted for ranks that share a GPU";
    EXPECT_TRUE(nccl.uses_nccl());
  } catch (const AgreedFailure& e) {
    // Every rank fails the check; every rank's failure names rank 0, whose message is the reason.
    EXPECT_TRUE(shared) << e.what();
    EXPECT_EQ(e.failed_rank(), 0) << e.what();
    if (e.is_origin()) {
      EXPECT_NE(e.origin_message().find("one GPU per rank"), std::string::npos) << e.origin_message();
    }
  }
}
#endif

TEST(GpuTrain, CheckpointsOfGpuStateRoundTripExactly) {
  // Saved from the GPU through a host copy, restored into another model on the GPU: parameters
  // and Adam's moments come back bit for bit, and stay on the GPU.
  auto world = MpiCommunicator::world();
  const std::string model_file = std::string(TESSERA_SOURCE_DIR) + "/models/fashion_cnn.yaml";
  // One folder for the job (rank 0's process id, the same on every rank).
  const auto job = static_cast<long>(world->allreduce_value(world->rank() == 0 ? static_cast<double>(::getpid()) : 0.0,
                                                            ReduceOp::Max));
  const auto dir = std::filesystem::temp_directory_path() / ("tessera_gpu_checkpoint_" + std::to_string(job));
  OptimizerConfig adam;
  adam.type = "adam";
  CheckpointMeta meta;
  meta.step = 2;
  meta.global_batch = 8;
  meta.seed = 3;
  const Plan plan = Plan::sample_parallel(ranks());
  meta.plan_text = plan.to_yaml();
  ExecutorOptions options;
  options.global_batch = 8;
  options.seed = 3;
  options.device = kGpu;
  options.gpu_comm = kGpuComm;
  std::vector<Tensor> values, state;
  std::string path;
  {
    Model model = Model::load(model_file);
    model.init_parameters(3);
    Executor executor(model, plan, world, options);
    auto optimizer = create_optimizer(adam);
    Tensor inputs, labels;
    const auto [begin, end] = executor.local_samples(8);
    for (int step = 0; step < 2; ++step) {
      testing::synthetic_batch(model.sample_shape(), 8, step, inputs, labels);
      executor.train_step(inputs.slice(begin, end).clone(), labels.slice(begin, end).clone(), 8, step);
      optimizer->step(model.parameters(), 1e-3);
    }
    path = save_checkpoint(dir.string(), model, executor, *optimizer, meta, 1);
    for (Parameter* p : model.parameters()) values.push_back(p->value.to(Device::host()).clone());
    for (auto& [name, tensor] : optimizer->state()) state.push_back(tensor->to(Device::host()).clone());
  }
  Model model = Model::load(model_file);
  model.init_parameters(99);  // other weights: the restore must overwrite them
  Executor executor(model, plan, world, options);
  auto optimizer = create_optimizer(adam);
  restore_checkpoint(path, model, executor, *optimizer, meta);
  const auto params = model.parameters();
  ASSERT_EQ(params.size(), values.size());
  for (std::size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i]->value.device(), executor.device()) << params[i]->name;
    EXPECT_EQ(max_relative_difference(values[i], params[i]->value.to(Device::host())), 0.0) << params[i]->name;
  }
  const auto restored = optimizer->state();
  ASSERT_EQ(restored.size(), state.size());
  for (std::size_t i = 0; i < state.size(); ++i) {
    EXPECT_EQ(restored[i].second->device(), executor.device()) << restored[i].first;
    EXPECT_EQ(max_relative_difference(state[i], restored[i].second->to(Device::host())), 0.0) << restored[i].first;
  }
  EXPECT_GT(relative_error(state.back(), Tensor(state.back().shape())), 0.0) << "Adam's moments must not be zero";
  world->barrier();
  if (world->rank() == 0) std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tessera
