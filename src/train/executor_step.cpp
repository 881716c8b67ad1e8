// A training step and an evaluation: forward with its exchanges, the loss, backward with the
// reverse exchanges and the gradient reduction, and the per-layer profile.
#include <algorithm>
#include <cmath>
#include <string>

#include "tessera/core/clock.hpp"
#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/parallel/step_plan.hpp"
#include "tessera/parallel/watchdog.hpp"
#include "tessera/tensor/grid.hpp"
#include "tessera/train/executor.hpp"

namespace tessera {
namespace {

/// A node index no layer has: evaluation's forward is not profiled.
constexpr std::size_t kNotProfiled = static_cast<std::size_t>(-1);

/// Runs `work` while `exchange` is in flight; if it throws, finishes the exchange (its messages
/// must not outlive it: every rank runs the same layers, so the peers have started theirs) and
/// rethrows the first error.
template <typename Work>
void finishing_on_error(TileExchange& exchange, const Work& work) {
  try {
    work();
  } catch (...) {
    try {
      exchange.finish_pending();
    } catch (...) {
    }
    throw;
  }
}

}  // namespace

LayerContext Executor::context(std::size_t node, std::int64_t batch_size, std::int64_t step, bool training) {
  const Placement& p = placement_[node];
  LayerContext ctx;
  ctx.backend = backend_.get();
  ctx.sample_comm = p.sample_comm;
  ctx.spatial_comm = p.spatial_comm;
  ctx.tile = p.tiled ? &p.tile : nullptr;
  ctx.sample_offset = block_begin(batch_size, p.split.sample, grid_coords(p.grid, world_->rank())[kSampleAxis]);
  ctx.global_batch = batch_size;
  ctx.seed = options_.seed;
  ctx.step = step;
  ctx.training = training;
  return ctx;
}

class Executor::LayerTimer {
 public:
  /// Times layer `node`'s forward (or backward) into the profile when `executor` profiles.
  LayerTimer(Executor& executor, std::size_t node, bool forward) : executor_(executor) {
    if (node >= executor.profile_.size()) return;  // not profiling, or kNotProfiled
    LayerTiming& timing = executor.profile_[node];
    seconds_ = forward ? &timing.forward_seconds : &timing.backward_seconds;
    cpu_seconds_ = &timing.cpu_seconds;
    executor.profiled_ = &timing;
    cpu_start_ = process_cpu_seconds();
    start_ = Clock::now();
  }
  ~LayerTimer() {
    if (!seconds_) return;
    if (!executor_.options_.device.is_host()) {
      try {
        cuda::synchronize();  // the layer's kernels, not only their launches
      } catch (...) {
      }
    }
    *seconds_ += seconds_since(start_);
    *cpu_seconds_ += process_cpu_seconds() - cpu_start_;
    executor_.profiled_ = nullptr;
  }
  LayerTimer(const LayerTimer&) = delete;
  LayerTimer& operator=(const LayerTimer&) = delete;

 private:
  Executor& executor_;
  double* seconds_ = nullptr;
  double* cpu_seconds_ = nullptr;
  double cpu_start_ = 0;
  Clock::time_point start_;
};

void Executor::forward(const Tensor& inputs, Exchanges& ex, std::int64_t batch_size, std::int64_t step,
                       bool training) {
  const auto [begin, end] = local_samples(batch_size);
  TESSERA_CHECK(inputs.dim(0) == end - begin, "Executor: {} local samples given, the plan gives this rank {}",
                inputs.dim(0), end - begin);
  auto& nodes = model_.nodes();
  std::vector<const Tensor*> in;
  // Layer i's output into its reader's window where the step plan puts it there (the arena's
  // view; evaluating a batch larger than training's, a window of its own).
  const auto into_window = [&](std::size_t i, LayerContext& ctx) {
    const int reader = ex.step.output_in_window[i];
    if (reader < 0) return;
    Tensor& window = windows_[static_cast<std::size_t>(reader)][0];
    window.resize(Shape(ex.copy_extent[static_cast<std::size_t>(reader)][0]), options_.device);
    outputs_[i] = window;
    ctx.output_offset = ex.output_offset[i];
  };
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (training) begin_time(ex, static_cast<int>(i));
    const LayerTimer timer(*this, training ? i : kNotProfiled, /*forward=*/true);
    in.clear();
    const bool overlap = ex.overlap[i].interior;
    for (std::size_t a = 0; a < nodes[i].inputs.size(); ++a) {
      const int j = nodes[i].inputs[a];
      const Tensor* source = j == Model::kModelInput ? &inputs : &outputs_[static_cast<std::size_t>(j)];
      if (TileExchange* exchange = ex.inputs[i][a].get()) {
        const auto start = Clock::now();
        if (j != Model::kModelInput && ex.step.output_in_window[static_cast<std::size_t>(j)] == static_cast<int>(i))
          exchange->start_forward_in_place(windows_[i][a]);  // its producer wrote its tile there
        else
          exchange->start_forward(*source, windows_[i][a]);
        if (!overlap) exchange->finish_forward();  // else after the interior
        count_exchange(start, ex.halo[i][a]);
        source = &windows_[i][a];
      }
      in.push_back(source);
    }
    // A producer whose every consumer has copied what it reads is not needed any more (backward
    // reads the copies): release it, so a split layer holds its tile once, not twice.
    for (std::size_t a = 0; a < nodes[i].inputs.size(); ++a) {
      const int j = nodes[i].inputs[a];
      if (j != Model::kModelInput && ex.step.release_after[static_cast<std::size_t>(j)] == static_cast<int>(i)) outputs_[static_cast<std::size_t>(j)] = Tensor();
    }
    // Its output is its input, overwritten (StepPlan::in_place; in the arena, the same view).
    if (ex.step.in_place[i]) outputs_[i] = outputs_[static_cast<std::size_t>(nodes[i].inputs[0])];
    if (ex.step.fused[i]) continue;  // its producer computed its output
    if (ex.step.pooled_by[i] >= 0) continue;  // the convolution it reads wrote its output and maxima
    LayerContext ctx = context(i, batch_size, step, training);
    ctx.leaky_relu_after = ex.step.leaky_relu_after[i];
    into_window(i, ctx);
    std::optional<PooledOutput> pooled;
    if (const int k = ex.step.gradient_from_pooling[i]; k >= 0) {
      // Its reader's max pooling, made as its rows are (it keeps no output of its own).
      const auto u = static_cast<std::size_t>(k);
      LayerContext pool_ctx = context(u, batch_size, step, training);
      into_window(u, pool_ctx);
      pooled = nodes[u].layer->pooled_output(Shape(ex.output_extent[i]), options_.device, outputs_[u], pool_ctx);
      if (!pooled) fail("Executor: layer '{}' cannot be pooled by its producer (executor bug)", nodes[u].layer->name());
      ctx.pooled_output = &*pooled;
    }
    if (TileExchange* reduce = ex.reduce[i].get()) {
      // A partial sum over this rank's input channels: summed over the channel group into the
      // output tiles (backward never reads a layer's output, so the partial sum goes).
      nodes[i].layer->forward(in, partials_[i], ctx);
      peak_bytes_ = std::max(peak_bytes_, current_bytes());
      const auto start = Clock::now();
      reduce->reverse(partials_[i], outputs_[i]);
      count_exchange(start, /*halo=*/false);
      peak_bytes_ = std::max(peak_bytes_, current_bytes());
      partials_[i] = Tensor();
      continue;
    }
    if (!overlap) {
      nodes[i].layer->forward(in, outputs_[i], ctx);
    } else {
      TileExchange& exchange = *ex.inputs[i][0];
      finishing_on_error(exchange, [&] { nodes[i].layer->forward(in, outputs_[i], ctx); });
      // The interior is right; the boundary read halos that had not arrived: recompute it.
      const auto start = Clock::now();
      exchange.finish_forward();
      count_exchange(start, /*halo=*/true);
      for (const OutputRegion& region : ex.overlap[i].boundary)
        nodes[i].layer->forward_region(in, outputs_[i], ctx, region.begin, region.extent);
    }
    peak_bytes_ = std::max(peak_bytes_, current_bytes());
  }
}

const Tensor& Executor::output_targets(const Tensor& targets, Exchanges& ex) {
  if (!ex.targets) return targets;
  ex.targets->forward(targets, targets_);
  return targets_;
}

BatchResult Executor::reduce(Communicator& comm, double loss_sum, std::int64_t correct, std::int64_t samples,
                             const char* label) {
  double sums[3] = {loss_sum, static_cast<double>(correct), static_cast<double>(samples)};
  {
    const WatchdogScope scope(watchdog_, label);
    comm.allreduce(sums, 3, DType::F64, ReduceOp::Sum);
  }
  BatchResult r;
  r.loss_sum = sums[0];
  r.correct = correct < 0 ? -1 : static_cast<std::int64_t>(std::llround(sums[1]));
  r.samples = static_cast<std::int64_t>(std::llround(sums[2]));
  return r;
}

void Executor::count_exchange(Clock::time_point start, bool halo) {
  const double seconds = seconds_since(start);
  exchange_seconds_ += seconds;
  if (halo) halo_seconds_ += seconds;
  if (profiled_) profiled_->exchange_seconds += seconds;
}

const Tensor& Executor::on_device(const Tensor& given, Tensor& staging) const {
  if (given.device() == options_.device) return given;
  staging.resize(given.shape(), options_.device);
  staging.copy_from(given);
  return staging;
}

BatchResult Executor::train_step(const Tensor& given_inputs, const Tensor& given_targets, std::int64_t batch_size,
                                 std::int64_t step) {
  const Tensor& inputs = on_device(given_inputs, staged_inputs_);
  const Tensor& targets = on_device(given_targets, staged_targets_);
  const WatchdogScope step_scope(watchdog_, "forward/backward (halo exchanges and batch-norm statistics are there)");
  exchange_seconds_ = 0;
  halo_seconds_ = 0;
  peak_bytes_ = 0;
  Exchanges& ex = exchanges(batch_size, targets);
  place_transients(ex, /*grow=*/true);
  forward(inputs, ex, batch_size, step, /*training=*/true);

  auto& nodes = model_.nodes();
  const auto out = static_cast<std::size_t>(model_.output_node());
  const Tensor& local_targets = output_targets(targets, ex);
  LayerContext loss_ctx = context(out, batch_size, step, /*training=*/true);
  begin_time(ex, static_cast<int>(nodes.size()));
  const double loss_sum = model_.loss().forward_backward(outputs_[out], local_targets, grads_[out], loss_ctx);
  const std::int64_t correct = model_.loss().correct(outputs_[out], local_targets);

  // Backward in reverse order. A node's output gradient is complete once every consumer ran
  // (consumers come later in the list); the first writer overwrites, later ones accumulate.
  std::vector<bool> has_grad(nodes.size(), false);
  has_grad[out] = true;
  std::vector<const Tensor*> in;
  std::vector<Tensor*> grad_in;
  std::vector<Tensor> extra;
  // What layer k's backward reads of its input a: its copy (exchanged), the model's input, or the
  // producer's output.
  const auto input_of = [&](std::size_t k, std::size_t a) -> const Tensor* {
    const int j = nodes[k].inputs[a];
    return ex.inputs[k][a]           ? &windows_[k][a]
           : j == Model::kModelInput ? &inputs
                                     : &outputs_[static_cast<std::size_t>(j)];
  };
  // A max pooling's backward handed to the convolution it reads (StepPlan::pooled_by).
  std::optional<PooledGradient> pooled;
  for (std::size_t k = nodes.size(); k-- > 0;) {
    begin_time(ex, static_cast<int>(2 * nodes.size() - k));
    const LayerTimer timer(*this, k, /*forward=*/false);
    auto& node = nodes[k];
    if (const int by = ex.step.pooled_by[k]; by >= 0) {
      // The step plan hands it over only where the convolution's tile can read it; the pooling
      // has no output of its own to run a backward from.
      pooled = node.layer->pooled_gradient(outputs_[k], grads_[k], ex.step.leaky_relu_before[k]);
      const auto conv = static_cast<std::size_t>(by);
      const Tensor* conv_in[] = {input_of(conv, 0)};
      LayerContext conv_ctx = context(conv, batch_size, step, /*training=*/true);
      if (!pooled || !nodes[conv].layer->reads_pooled_gradient(conv_in, *pooled, conv_ctx))
        fail("Executor: layer '{}' made its pooling's forward but cannot read its gradient (executor bug)",
             nodes[conv].layer->name());
      has_grad[static_cast<std::size_t>(node.inputs[0])] = true;
      continue;
    }
    in.clear();
    grad_in.clear();
    extra.assign(node.inputs.size(), Tensor());
    for (std::size_t a = 0; a < node.inputs.size(); ++a) {
      // (A layer running in place finds its input's gradient in its output gradient's place:
      // the arena gives a chain of them one buffer.)
      const int j = node.inputs[a];
      const bool exchanged = ex.inputs[k][a] != nullptr;
      in.push_back(input_of(k, a));
      if (!input_has_gradient(j)) {
        grad_in.push_back(nullptr);
      } else if (exchanged) {
        grad_in.push_back(&window_grads_[k][a]);
      } else if (!has_grad[static_cast<std::size_t>(j)] &&
                 std::find(grad_in.begin(), grad_in.end(), &grads_[static_cast<std::size_t>(j)]) == grad_in.end()) {
        // (a layer reading the same producer twice writes its first gradient here, the second
        // into `extra`, summed below)
        grad_in.push_back(&grads_[static_cast<std::size_t>(j)]);
      } else {
        grad_in.push_back(&extra[a]);
      }
    }
    if (!has_grad[k]) fail("Executor: layer '{}' got no gradient", node.layer->name());
    if (ex.step.backward_fused[k]) {
      // Its reader applied its factor: the output gradient is its input gradient (in place).
      has_grad[static_cast<std::size_t>(node.inputs[0])] = true;
      continue;
    }
    LayerContext ctx = context(k, batch_size, step, /*training=*/true);
    ctx.leaky_relu_before = ex.step.leaky_relu_before[k];
    ctx.output_offset = ex.output_offset[k];
    if (pooled && ex.step.gradient_from_pooling[k] >= 0) ctx.pooled_gradient = &*pooled;
    // Whether its one input's producer wrote into its window: the halo gradients are summed there.
    const bool window_holds_input = node.inputs.size() == 1 && node.inputs[0] != Model::kModelInput &&
                                    ex.step.output_in_window[static_cast<std::size_t>(node.inputs[0])] == static_cast<int>(k);
    if (TileExchange* reduce = ex.reduce[k].get()) {
      // The gradient of a partial sum is the output gradient over the whole partial box.
      const auto start = Clock::now();
      reduce->forward(grads_[k], partial_grads_[k]);
      count_exchange(start, /*halo=*/false);
      node.layer->backward(in, partials_[k], partial_grads_[k], grad_in, ctx);
      peak_bytes_ = std::max(peak_bytes_, current_bytes());
    } else if (TileExchange* exchange = ex.split_backward[k]) {
      // The halo gradients travel to their owners while the parameter gradients are computed.
      node.layer->backward_inputs(in, grads_[k], grad_in, ctx);
      peak_bytes_ = std::max(peak_bytes_, current_bytes());
      const auto uj = static_cast<std::size_t>(node.inputs[0]);
      auto start = Clock::now();
      if (window_holds_input)
        exchange->start_reverse_in_place(window_grads_[k][0]);  // grads_[uj] is that window's gradient
      else
        exchange->start_reverse(window_grads_[k][0], grads_[uj], /*accumulate=*/has_grad[uj]);
      count_exchange(start, ex.halo[k][0]);
      finishing_on_error(*exchange, [&] { node.layer->backward_parameters(in, grads_[k], ctx); });
      for (auto* p : node.layer->parameters()) reducer_.ready(p->grad);
      start = Clock::now();
      exchange->finish_reverse();
      count_exchange(start, ex.halo[k][0]);
      peak_bytes_ = std::max(peak_bytes_, current_bytes());
      has_grad[uj] = true;
      continue;
    } else {
      node.layer->backward(in, outputs_[k], grads_[k], grad_in, ctx);
      peak_bytes_ = std::max(peak_bytes_, current_bytes());
    }
    for (auto* p : node.layer->parameters()) reducer_.ready(p->grad);
    for (std::size_t a = 0; a < node.inputs.size(); ++a) {
      const int j = node.inputs[a];
      if (j == Model::kModelInput) continue;
      const auto uj = static_cast<std::size_t>(j);
      if (TileExchange* exchange = ex.inputs[k][a].get()) {
        // Halo gradients go back to their owners and are summed there.
        const auto start = Clock::now();
        if (window_holds_input) {
          exchange->start_reverse_in_place(window_grads_[k][a]);  // grads_[uj] is that window's gradient
          exchange->finish_reverse();
        } else {
          exchange->reverse(window_grads_[k][a], grads_[uj], /*accumulate=*/has_grad[uj]);
        }
        count_exchange(start, ex.halo[k][a]);
        peak_bytes_ = std::max(peak_bytes_, current_bytes());
      } else if (has_grad[uj] && grad_in[a] == &extra[a]) {
        backend_->elementwise().accumulate(extra[a].data(), grads_[uj].data(), grads_[uj].numel());
      }
      has_grad[uj] = true;
    }
  }
  const auto wait_start = Clock::now();
  reducer_.finish();
  if (uses_nccl()) {
    // NCCL's requests only make the GPU's compute wait: wait here for backward and the gradient
    // allreduce, so that a hung NCCL operation shows under its name (the watchdog) in this step.
    const WatchdogScope scope(watchdog_, "gradient allreduce (NCCL, with the rest of backward on the GPU)");
    cuda::synchronize();
  }
  BatchResult result = reduce(*loss_comm_, loss_sum, correct, outputs_[out].dim(0), "loss allreduce");
  result.comm_wait_seconds = seconds_since(wait_start);
  result.exchange_seconds = exchange_seconds_;
  result.halo_seconds = halo_seconds_;
  if (!std::isfinite(result.loss_sum)) {
    // The loss is reduced, so every rank sees the same value and stops at the same step.
    const int rank = world_->rank();
    throw AgreedFailure(fmt::format("the loss is {} at step {}: training diverged (lower the learning rate, or "
                                    "check the data for NaNs)",
                                    result.loss_sum, step),
                        exit_code_for(NumericError("")), 0, rank == 0);
  }
  return result;
}

BatchResult Executor::evaluate(const Tensor& given_inputs, const Tensor& given_targets, std::int64_t batch_size) {
  const Tensor& inputs = on_device(given_inputs, staged_inputs_);
  const Tensor& targets = on_device(given_targets, staged_targets_);
  exchange_seconds_ = 0;
  halo_seconds_ = 0;
  Exchanges& ex = exchanges(batch_size, targets);
  place_transients(ex, /*grow=*/false);  // in training's arena where it fits
  forward(inputs, ex, batch_size, /*step=*/0, /*training=*/false);
  const auto out = static_cast<std::size_t>(model_.output_node());
  const Tensor& local_targets = output_targets(targets, ex);
  const std::int64_t local = outputs_[out].dim(0);
  const double loss_sum = local > 0 ? model_.loss().forward(outputs_[out], local_targets) : 0.0;
  const std::int64_t correct = local > 0 ? model_.loss().correct(outputs_[out], local_targets) : 0;
  BatchResult result = reduce(*world_, loss_sum, correct, local, "validation (loss allreduce)");
  result.exchange_seconds = exchange_seconds_;
  result.halo_seconds = halo_seconds_;
  // Evaluation batches may be larger than training's: the tensors it allocated outside the arena
  // and its bf16 operands' scratch are let go, so that training keeps what the planner counted
  // (the next step makes its own scratch again).
  const auto outside_arena = [&](Tensor& t) {
    if (t.buffer_id() != arena_.buffer_id()) t = Tensor();
  };
  for (std::size_t i = 0; i < outputs_.size(); ++i) {
    outside_arena(outputs_[i]);
    outside_arena(partials_[i]);
    for (Tensor& t : windows_[i]) outside_arena(t);
  }
  backend_->convolution().release_scratch();
  backend_->linear().release_scratch();
  return result;
}

void Executor::average_buffers() {
  if (world_->size() == 1) return;
  const WatchdogScope scope(watchdog_, "averaging batch-norm statistics over the ranks");
  // Ranks holding tiles of the same samples have equal statistics, and every sample group has
  // as many ranks, so the average over the ranks holding the same block of the buffers (all
  // ranks unless the layer is split by filter) is the average over the sample groups.
  auto& nodes = model_.nodes();
  for (std::size_t k = 0; k < nodes.size(); ++k) {
    Communicator& group = buffer_group(k);
    if (group.size() == 1) continue;
    const float scale = 1.0f / static_cast<float>(group.size());
    for (Tensor* buffer : nodes[k].layer->buffers()) {
      Tensor host = buffer->to(Device::host());  // the buffer itself on the host, else a copy
      group.allreduce(host.data(), static_cast<std::size_t>(host.numel()), DType::F32, ReduceOp::Sum);
      float* b = host.data();
      for (std::int64_t i = 0; i < host.numel(); ++i) b[i] *= scale;
      if (!buffer->device().is_host()) buffer->copy_from(host);
    }
  }
}

}  // namespace tessera
