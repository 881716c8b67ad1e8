#pragma once
// The harness of the plan invariant tests (spatial, model parallel): train a model from YAML text
// under a plan on this job's ranks and under one rank, and compare losses, an evaluation loss,
// every parameter's gradient (this rank's block of it) and the weights; build executors for plans
// that must be refused. Each rank computes the 1-rank reference itself on a communicator of its own.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "training_test_util.hpp"
#include "tessera/core/error.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/parallel/mpi_communicator.hpp"
#include "tessera/train/executor.hpp"
#include "tessera/train/optimizer.hpp"

namespace tessera::testing {

/// Block `box` of a whole tensor.
inline Tensor block_of(const Tensor& whole, const Box& box) {
  Tensor block{Shape(box.extent)};
  const int rank = whole.rank();
  std::vector<std::int64_t> index(static_cast<std::size_t>(rank));
  for (std::int64_t i = 0; i < block.numel(); ++i) {
    std::int64_t rest = i;
    for (int d = rank; d-- > 0;) {
      const auto u = static_cast<std::size_t>(d);
      index[u] = box.begin[u] + rest % box.extent[u];
      rest /= box.extent[u];
    }
    block.data()[i] = whole.at(index);
  }
  return block;
}

struct TrainingRun {
  std::vector<double> losses;
  std::vector<Tensor> first_gradients;  ///< every parameter's gradient (this rank's block) after the first step
  std::vector<Tensor> weights;          ///< after the last step (this rank's blocks)
  std::vector<Box> boxes;               ///< each parameter's block
  std::vector<bool> sharded;
  double evaluation_loss = 0;           ///< of the trained model on another batch (inference mode)
  std::int64_t parameter_bytes = 0;     ///< values + gradients
  std::int64_t optimizer_bytes = 0;
  std::int64_t activation_bytes = 0;    ///< peak of the training steps and the evaluation
  std::int64_t training_activation_bytes = 0;  ///< peak of the training steps alone
  std::int64_t scratch_bytes = 0;       ///< the kernels' scratch (bf16's rounded operands)
  std::vector<std::string> in_place_layers;  ///< Executor::in_place_layers of the training batch
  std::vector<std::string> fused_layers;     ///< Executor::fused_layers of the training batch
  std::vector<std::string> backward_fused_layers;  ///< Executor::backward_fused_layers, the same
  std::vector<std::string> bf16_kept_layers;       ///< Executor::bf16_kept_layers, the same
  std::vector<std::string> window_output_layers;   ///< Executor::window_output_layers, the same
  std::vector<std::string> pooled_gradient_layers;  ///< Executor::pooled_gradient_layers, the same
};

inline OptimizerConfig sgd_momentum() {
  OptimizerConfig c;
  c.momentum = 0.9;
  return c;
}

inline OptimizerConfig adamw() {
  OptimizerConfig c;
  c.type = "adamw";
  c.weight_decay = 0.01;
  return c;
}

/// The tests overlap every halo exchange a layer can (HaloOverlap::Always), so the overlapped
/// path is what the invariant covers; tests that name HaloOverlap::Never cover the other. The
/// layers run on `device` (the GPU tests); gradients and weights come back on the host.
/// `ranks_per_node` > 0: blocks of that many ranks are taken for nodes (ExecutorOptions).
/// `in_place`: ExecutorOptions::in_place. `poison`: ExecutorOptions::poison_dead_tensors (on in
/// every test, so that a layer reading a tensor past its lifetime in the arena fails them).
inline TrainingRun train(const std::string& model_text, const Plan& plan, std::shared_ptr<Communicator> comm, std::int64_t batch,
                  int steps, const OptimizerConfig& optimizer_config = sgd_momentum(), double lr = 0.05,
                  HaloOverlap overlap = HaloOverlap::Always, Device device = Device::host(),
                  ExecutorOptions::GpuComm gpu_comm = ExecutorOptions::GpuComm::Automatic, int ranks_per_node = 0,
                  bool in_place = true, bool poison = true) {
  Model model = Model::parse(model_text, "invariant_test_model");
  model.init_parameters(11);
  ExecutorOptions options;
  options.global_batch = batch;
  options.halo_overlap = overlap;
  options.device = device;
  options.gpu_comm = gpu_comm;
  options.ranks_per_node = ranks_per_node;
  options.in_place = in_place;
  options.poison_dead_tensors = poison;
  options.seed = 11;
  options.reducer.bucket_bytes = 4 << 10;  // several buckets
  Executor executor(model, plan, comm, options);
  auto optimizer = create_optimizer(optimizer_config);
  const auto params = model.parameters();
  TrainingRun run;
  Tensor inputs, labels;
  for (int step = 0; step < steps; ++step) {
    synthetic_batch(model.sample_shape(), batch, step, inputs, labels);
    const auto [begin, end] = executor.local_samples(batch);
    const Tensor local_inputs = local_tile(inputs, begin, end, executor.input_sample_box());
    const Tensor local_labels = labels.slice(begin, end).clone();
    const BatchResult r = executor.train_step(local_inputs, local_labels, batch, step);
    EXPECT_EQ(r.samples, batch);
    run.losses.push_back(r.mean_loss());
    if (step == 0)
      for (auto* p : params) run.first_gradients.push_back(p->grad.to(Device::host()).clone());
    optimizer->step(params, lr);
  }
  run.scratch_bytes = executor.scratch_bytes();  // the training steps' (evaluate lets its own go)
  run.training_activation_bytes = executor.activation_bytes();
  run.in_place_layers = executor.in_place_layers(batch);
  run.fused_layers = executor.fused_layers(batch);
  run.backward_fused_layers = executor.backward_fused_layers(batch);
  run.bf16_kept_layers = executor.bf16_kept_layers(batch);
  run.window_output_layers = executor.window_output_layers(batch);
  run.pooled_gradient_layers = executor.pooled_gradient_layers(batch);
  synthetic_batch(model.sample_shape(), batch, steps, inputs, labels);
  const auto [begin, end] = executor.local_samples(batch);
  run.evaluation_loss = executor
                            .evaluate(local_tile(inputs, begin, end, executor.input_sample_box()),
                                      labels.slice(begin, end).clone(), batch)
                            .mean_loss();
  for (auto* p : params) {
    run.weights.push_back(p->value.to(Device::host()).clone());
    run.boxes.push_back(p->whole_box());
    run.sharded.push_back(p->sharded());
    run.parameter_bytes += p->value.allocated_bytes() + p->grad.allocated_bytes();
  }
  run.optimizer_bytes = optimizer->state_bytes();
  run.activation_bytes = executor.activation_bytes();
  EXPECT_EQ(executor.scratch_bytes(), 0) << "evaluate keeps no scratch";
  return run;
}

/// Two runs of the same model, plan and data that must compute the same to the bit (running in
/// place or not, dead tensors filled with NaNs or not, activations kept in bf16 or fp32): every
/// loss (finite), the evaluation loss, every first gradient and every final weight.
inline void expect_same_to_the_bit(const TrainingRun& a, const TrainingRun& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (std::size_t s = 0; s < a.losses.size(); ++s) {
    EXPECT_TRUE(std::isfinite(a.losses[s])) << "step " << s;
    EXPECT_EQ(a.losses[s], b.losses[s]) << "step " << s;
  }
  EXPECT_TRUE(std::isfinite(a.evaluation_loss));
  EXPECT_EQ(a.evaluation_loss, b.evaluation_loss);
  ASSERT_EQ(a.weights.size(), b.weights.size());
  for (std::size_t i = 0; i < a.weights.size(); ++i) {
    EXPECT_EQ(max_relative_difference(a.first_gradients[i], b.first_gradients[i]), 0.0) << "gradient " << i;
    EXPECT_EQ(max_relative_difference(a.weights[i], b.weights[i]), 0.0) << "weight " << i;
  }
}

/// Runs `model_text` under `plan_text` on every rank of the job and under one rank, and compares
/// every rank's blocks with the same blocks of the 1-rank tensors.
/// `device`: where the plan's run computes (the 1-rank reference always runs on the host).
/// `tolerance`: relative (1e-5 for fp32). `gpu_comm`: how the plan's run moves messages between GPUs.
inline void expect_same_as_one_rank(const std::string& model_text, const std::string& plan_text, std::int64_t batch,
                             int steps = 4, const OptimizerConfig& optimizer = sgd_momentum(), double lr = 0.05,
                             HaloOverlap overlap = HaloOverlap::Always, Device device = Device::host(),
                             double tolerance = 1e-5,
                             ExecutorOptions::GpuComm gpu_comm = ExecutorOptions::GpuComm::Automatic) {
  auto world = MpiCommunicator::world();
  SCOPED_TRACE(plan_text);
  std::shared_ptr<Communicator> self = world->split(world->rank(), 0);
  const TrainingRun reference = train(model_text, Plan::sample_parallel(1), self, batch, steps, optimizer, lr);
  const TrainingRun parallel = train(model_text, Plan::parse(plan_text, "invariant_test_plan"), world, batch, steps,
                                     optimizer, lr, overlap, device, gpu_comm);
  ASSERT_EQ(reference.losses.size(), parallel.losses.size());
  for (std::size_t s = 0; s < reference.losses.size(); ++s) {
    EXPECT_TRUE(std::isfinite(reference.losses[s]));
    EXPECT_NEAR(parallel.losses[s], reference.losses[s], tolerance * std::fabs(reference.losses[s])) << "step " << s;
  }
  EXPECT_NE(reference.losses.front(), reference.losses.back());
  EXPECT_NEAR(parallel.evaluation_loss, reference.evaluation_loss, tolerance * std::fabs(reference.evaluation_loss));
  ASSERT_EQ(reference.first_gradients.size(), parallel.first_gradients.size());
  for (std::size_t i = 0; i < reference.first_gradients.size(); ++i) {
    EXPECT_GT(relative_error(reference.first_gradients[i], Tensor(reference.first_gradients[i].shape())), 0.5)
        << "parameter " << i << " has a zero gradient: the comparison would prove nothing";
    const Tensor grad = block_of(reference.first_gradients[i], parallel.boxes[i]);
    const Tensor weight = block_of(reference.weights[i], parallel.boxes[i]);
    ASSERT_EQ(grad.shape(), parallel.first_gradients[i].shape()) << "parameter " << i;
    EXPECT_LT(relative_error(grad, parallel.first_gradients[i]), tolerance) << "gradient of parameter " << i;
    EXPECT_LT(relative_error(weight, parallel.weights[i]), tolerance) << "parameter " << i;
  }
}

inline int ranks() { return MpiCommunicator::world()->size(); }

/// A small CosmoFlow-style 3-D network (16^3, one channel): conv, leaky ReLU and max-pool
/// blocks, then two linear layers, the last with `outputs` outputs, and `loss`.
inline std::string cosmo_style_model(int outputs = 1, const std::string& loss = "mse") {
  return R"(
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
  - {name: fc2, type: linear, out: )" +
         std::to_string(outputs) + "}\nloss: " + loss + "\n";
}

/// cosmo_style_model with a wider conv2 (32 filters): the step's peak memory is not where pool1's
/// halo window outlives its tile, so D splits write pool1 into conv2's window (StepPlan::
/// output_in_window).
inline std::string cosmo_style_wide_model() {
  std::string model = cosmo_style_model(10, "softmax_cross_entropy");
  model.replace(model.find("filters: 8"), 10, "filters: 32");
  return model;
}

/// A plan for this job's ranks that splits the named layers with `split` and every other layer by sample.
inline std::string plan_for(const std::vector<std::string>& layers, const std::string& split) {
  std::string text = fmt::format("ranks: {}\ndefault: {{sample: {}}}\nlayers:\n", ranks(), ranks());
  for (const auto& layer : layers) text += fmt::format("  {}: {}\n", layer, split);
  return text;
}

/// Builds an executor for the plan; returns the InputError's message, or "" when accepted.
inline std::string refusal(const std::string& model_text, const std::string& plan_text, std::int64_t batch) {
  auto world = MpiCommunicator::world();
  Model model = Model::parse(model_text, "m");
  ExecutorOptions options;
  options.global_batch = batch;
  try {
    Executor executor(model, Plan::parse(plan_text, "bad_plan.yaml"), world, options);
  } catch (const AgreedFailure& e) {
    EXPECT_EQ(e.exit_code(), 2) << e.what();
    return e.what();
  }
  return "";
}

inline void expect_message(const std::string& message, const std::vector<std::string>& needles) {
  for (const auto& needle : needles) EXPECT_NE(message.find(needle), std::string::npos) << message;
}

}  // namespace tessera::testing
