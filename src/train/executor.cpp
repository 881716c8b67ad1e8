#include "tessera/train/executor.hpp"

#include <chrono>
#include <cmath>

#include "tessera/core/error.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/parallel/watchdog.hpp"
#include "tessera/tensor/distribution.hpp"

namespace tessera {
namespace {
void add_into(Tensor& target, const Tensor& source) {
  float* t = target.data();
  const float* s = source.data();
  const std::int64_t n = target.numel();
  for (std::int64_t i = 0; i < n; ++i) t[i] += s[i];
}
}  // namespace

Executor::Executor(Model& model, const Plan& plan, std::shared_ptr<Communicator> world, ExecutorOptions options)
    : model_(model), world_(std::move(world)), options_(options), reducer_(options.reducer) {
  collectively(*world_, [&] { plan.validate(world_->size(), model_.plan_info(options_.global_batch)); });
  // Sample-parallel plans: a 1-D grid whose one axis splits the samples.
  grid_ = std::make_shared<ProcGrid>(world_, std::vector<int>{world_->size()});
  backend_ = make_host_backend();
  outputs_.resize(model_.nodes().size());
  grads_.resize(model_.nodes().size());
  // Register gradients in the order backward produces them (last layer first). Every weight is
  // replicated over the sample group.
  auto& nodes = model_.nodes();
  for (auto it = nodes.rbegin(); it != nodes.rend(); ++it)
    for (auto* p : it->layer->parameters()) reducer_.add(p->grad, sample_comm());
  reducer_.build();
}

Executor::~Executor() = default;

Communicator& Executor::sample_comm() { return grid_->sub_comm({0}); }

std::pair<std::int64_t, std::int64_t> Executor::local_samples(std::int64_t batch_size) const {
  const int parts = grid_->shape()[0];
  const int coord = grid_->coords()[0];
  return {block_begin(batch_size, parts, coord), block_begin(batch_size, parts, coord + 1)};
}

LayerContext Executor::context(const Tensor& inputs, std::int64_t batch_size, std::int64_t step, bool training) {
  const auto [begin, end] = local_samples(batch_size);
  TESSERA_CHECK(inputs.dim(0) == end - begin, "Executor: {} local samples given, the plan gives this rank {}",
                inputs.dim(0), end - begin);
  LayerContext ctx;
  ctx.backend = backend_.get();
  ctx.sample_comm = grid_->size() > 1 ? &sample_comm() : nullptr;
  ctx.sample_offset = begin;
  ctx.global_batch = batch_size;
  ctx.seed = options_.seed;
  ctx.step = step;
  ctx.training = training;
  return ctx;
}

void Executor::forward(const Tensor& inputs, LayerContext& ctx) {
  auto& nodes = model_.nodes();
  std::vector<const Tensor*> in;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    in.clear();
    for (int j : nodes[i].inputs) in.push_back(j == Model::kModelInput ? &inputs : &outputs_[static_cast<std::size_t>(j)]);
    nodes[i].layer->forward(in, outputs_[i], ctx);
  }
}

void Executor::set_watchdog(Watchdog* watchdog) {
  watchdog_ = watchdog;
  reducer_.set_watchdog(watchdog);
}

BatchResult Executor::reduce(double loss_sum, std::int64_t correct, std::int64_t samples, const char* label) {
  double sums[3] = {loss_sum, static_cast<double>(correct), static_cast<double>(samples)};
  {
    const WatchdogScope scope(watchdog_, label);
    world_->allreduce(sums, 3, DType::F64, ReduceOp::Sum);
  }
  BatchResult r;
  r.loss_sum = sums[0];
  r.correct = correct < 0 ? -1 : static_cast<std::int64_t>(std::llround(sums[1]));
  r.samples = static_cast<std::int64_t>(std::llround(sums[2]));
  return r;
}

BatchResult Executor::train_step(const Tensor& inputs, const Tensor& targets, std::int64_t batch_size,
                                 std::int64_t step) {
  const auto [begin, end] = local_samples(batch_size);
  const WatchdogScope step_scope(watchdog_, "forward/backward (global batch-norm statistics are allreduced there)");
  LayerContext ctx = context(inputs, batch_size, step, /*training=*/true);
  forward(inputs, ctx);

  auto& nodes = model_.nodes();
  const auto out = static_cast<std::size_t>(model_.output_node());
  const double loss_sum = model_.loss().forward_backward(outputs_[out], targets, grads_[out], ctx);
  const std::int64_t correct = model_.loss().correct(outputs_[out], targets);

  // Backward in reverse order. A node's output gradient is complete once every consumer ran
  // (consumers come later in the list); the first writer overwrites, later ones accumulate.
  std::vector<bool> has_grad(nodes.size(), false);
  has_grad[out] = true;
  std::vector<const Tensor*> in;
  std::vector<Tensor*> grad_in;
  std::vector<Tensor> extra;
  for (std::size_t k = nodes.size(); k-- > 0;) {
    auto& node = nodes[k];
    in.clear();
    grad_in.clear();
    extra.assign(node.inputs.size(), Tensor());
    for (std::size_t a = 0; a < node.inputs.size(); ++a) {
      const int j = node.inputs[a];
      in.push_back(j == Model::kModelInput ? &inputs : &outputs_[static_cast<std::size_t>(j)]);
      if (j == Model::kModelInput) {
        grad_in.push_back(nullptr);
      } else if (!has_grad[static_cast<std::size_t>(j)]) {
        grad_in.push_back(&grads_[static_cast<std::size_t>(j)]);
      } else {
        grad_in.push_back(&extra[a]);
      }
    }
    if (!has_grad[k]) fail("Executor: layer '{}' got no gradient", node.layer->name());
    node.layer->backward(in, outputs_[k], grads_[k], grad_in, ctx);
    for (std::size_t a = 0; a < node.inputs.size(); ++a) {
      const int j = node.inputs[a];
      if (j == Model::kModelInput) continue;
      if (has_grad[static_cast<std::size_t>(j)] && grad_in[a] == &extra[a])
        add_into(grads_[static_cast<std::size_t>(j)], extra[a]);
      has_grad[static_cast<std::size_t>(j)] = true;
    }
    for (auto* p : node.layer->parameters()) reducer_.ready(p->grad);
  }
  const auto wait_start = std::chrono::steady_clock::now();
  reducer_.finish();
  BatchResult result = reduce(loss_sum, correct, end - begin, "loss allreduce");
  result.comm_wait_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_start).count();
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

BatchResult Executor::evaluate(const Tensor& inputs, const Tensor& targets, std::int64_t batch_size) {
  const auto [begin, end] = local_samples(batch_size);
  LayerContext ctx = context(inputs, batch_size, /*step=*/0, /*training=*/false);
  forward(inputs, ctx);
  const auto out = static_cast<std::size_t>(model_.output_node());
  const double loss_sum = end > begin ? model_.loss().forward(outputs_[out], targets) : 0.0;
  const std::int64_t correct = end > begin ? model_.loss().correct(outputs_[out], targets) : 0;
  return reduce(loss_sum, correct, end - begin, "validation (loss allreduce)");
}

void Executor::average_buffers() {
  if (grid_->size() == 1) return;
  Communicator& group = sample_comm();
  const WatchdogScope scope(watchdog_, "averaging batch-norm statistics over the ranks");
  const float scale = 1.0f / static_cast<float>(group.size());
  for (auto& node : model_.nodes())
    for (Tensor* buffer : node.layer->buffers()) {
      group.allreduce(buffer->data(), static_cast<std::size_t>(buffer->numel()), DType::F32, ReduceOp::Sum);
      float* b = buffer->data();
      for (std::int64_t i = 0; i < buffer->numel(); ++i) b[i] *= scale;
    }
}

std::int64_t Executor::activation_bytes() const {
  std::int64_t bytes = 0;
  for (const auto& t : outputs_) bytes += t.allocated_bytes();
  for (const auto& t : grads_) bytes += t.allocated_bytes();
  return bytes;
}

}  // namespace tessera
