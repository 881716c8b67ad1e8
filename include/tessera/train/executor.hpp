#pragma once
// Runs a model under a plan: each rank computes its tile of every layer, and the executor does
// the communication the plan implies. With sample-parallel plans that is: a rank holds a block of
// the batch's samples; batch-norm layers asking for global statistics reduce over the sample
// group; gradients are summed over each weight's replica group by the GradReducer, bucket by
// bucket while backward continues.
#include <cstdint>
#include <memory>
#include <vector>

#include "tessera/layers/dnn_backend.hpp"
#include "tessera/parallel/grad_reducer.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/tensor/proc_grid.hpp"
#include "tessera/train/model.hpp"

namespace tessera {

struct ExecutorOptions {
  std::int64_t global_batch = 64;
  std::uint64_t seed = 0;
  GradReducerOptions reducer;
};

/// Sums over the whole batch (all ranks).
struct BatchResult {
  double loss_sum = 0;       ///< sum of the per-sample losses
  std::int64_t correct = 0;  ///< correctly classified samples (-1: not a classifier)
  std::int64_t samples = 0;
  /// Seconds this rank waited for communication that backward could not hide (gradient
  /// reductions still running after backward, and the loss reduction).
  double comm_wait_seconds = 0;
  double mean_loss() const { return samples ? loss_sum / static_cast<double>(samples) : 0.0; }
};

class Executor {
 public:
  /// Checks the plan against the model and the job (collectively: every rank fails together).
  Executor(Model& model, const Plan& plan, std::shared_ptr<Communicator> world, ExecutorOptions options);
  ~Executor();

  /// The samples [begin, end) of a batch of `batch_size` that this rank holds.
  std::pair<std::int64_t, std::int64_t> local_samples(std::int64_t batch_size) const;

  /// Forward, loss, backward and gradient reduction for one batch (this rank's samples of it).
  /// `step` keys the dropout masks. Gradients are left in the model's parameters, reduced.
  BatchResult train_step(const Tensor& inputs, const Tensor& targets, std::int64_t batch_size, std::int64_t step);
  /// Forward and loss only (inference mode), summed over all ranks.
  BatchResult evaluate(const Tensor& inputs, const Tensor& targets, std::int64_t batch_size);

  /// Averages the layers' non-trainable state (batch-norm running statistics) over the sample
  /// group, so that every rank evaluates the same model. With local batch-norm statistics each
  /// rank's running averages differ; with global ones this changes nothing but rounding.
  void average_buffers();

  Communicator& world() { return *world_; }
  Communicator& sample_comm();
  ProcGrid& grid() { return *grid_; }
  const GradReducer& reducer() const { return reducer_; }
  /// Names the blocking points of a step (gradient and loss allreduces) to `watchdog` (null: none).
  void set_watchdog(Watchdog* watchdog);
  Watchdog* watchdog() const { return watchdog_; }
  /// Bytes of activations, their gradients and workspace this rank holds after a step.
  std::int64_t activation_bytes() const;

 private:
  /// The context of a call on this rank's `inputs` of a batch of `batch_size` samples.
  LayerContext context(const Tensor& inputs, std::int64_t batch_size, std::int64_t step, bool training);
  void forward(const Tensor& inputs, LayerContext& ctx);
  BatchResult reduce(double loss_sum, std::int64_t correct, std::int64_t samples, const char* label);

  Model& model_;
  std::shared_ptr<Communicator> world_;
  std::shared_ptr<ProcGrid> grid_;
  ExecutorOptions options_;
  std::unique_ptr<DnnBackend> backend_;
  GradReducer reducer_;
  std::vector<Tensor> outputs_;
  std::vector<Tensor> grads_;
  Tensor grad_scratch_;
  Watchdog* watchdog_ = nullptr;
};

}  // namespace tessera
