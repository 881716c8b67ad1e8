// A training step's tensors in the arena: their views, the bf16 copies kept between forward and
// backward, and the NaNs poured into dead tensors for the tests.
#include <limits>
#include <unordered_set>

#include "tessera/train/executor.hpp"

namespace tessera {

void Executor::place_transients(const Exchanges& ex, bool grow) {
  const TransientArena& arena = ex.step.arena;
  const std::int64_t floats = arena.layout.size / static_cast<std::int64_t>(sizeof(float));
  const bool fits = arena_.defined() && arena_.numel() >= floats;
  const auto drop_forward_tensors = [&] {
    for (std::size_t i = 0; i < outputs_.size(); ++i) {
      outputs_[i] = Tensor();
      partials_[i] = Tensor();
      for (Tensor& t : windows_[i]) t = Tensor();
    }
  };
  if (!fits && !grow) {
    // Evaluation of a larger batch than training's: forward allocates its own (let go after).
    drop_forward_tensors();
    return;
  }
  if (!fits) {
    // Let the views of the smaller arena go first, so that its memory does not outlive it.
    drop_forward_tensors();
    for (std::size_t i = 0; i < outputs_.size(); ++i) {
      grads_[i] = Tensor();
      partial_grads_[i] = Tensor();
      for (Tensor& t : window_grads_[i]) t = Tensor();
    }
    arena_ = Tensor();
    arena_ = Tensor(Shape{floats}, options_.device);
  }
  const auto view = [&](std::size_t buffer, const std::vector<std::int64_t>& extent) {
    return arena_view(arena, buffer, extent);
  };
  for (std::size_t i = 0; i < outputs_.size(); ++i) {
    // (an output its reader's window holds is that window, and its gradient the window's)
    const int reader = ex.step.output_in_window[i];
    const auto& extent = reader >= 0 ? ex.copy_extent[static_cast<std::size_t>(reader)][0] : ex.output_extent[i];
    outputs_[i] = view(arena.output[i], extent);
    grads_[i] = view(arena.output_grad[i], extent);
    partials_[i] = view(arena.partial[i], ex.partial_extent[i]);
    partial_grads_[i] = view(arena.partial_grad[i], ex.partial_extent[i]);
    for (std::size_t a = 0; a < windows_[i].size(); ++a) {
      windows_[i][a] = view(arena.input_copy[i][a], ex.copy_extent[i][a]);
      window_grads_[i][a] = view(arena.input_copy_grad[i][a], ex.copy_extent[i][a]);
    }
  }
}

Tensor Executor::arena_view(const TransientArena& arena, std::size_t buffer, const std::vector<std::int64_t>& extent) {
  if (buffer == TransientArena::kNone) return Tensor();
  const std::int64_t begin = arena.offset(buffer) / static_cast<std::int64_t>(sizeof(float));
  Shape shape(extent);
  return arena_.slice(begin, begin + shape.numel()).reshape(std::move(shape));
}

void Executor::begin_time(const Exchanges& ex, int time) {
  const TransientArena& arena = ex.step.arena;
  constexpr auto kFloat = static_cast<std::int64_t>(sizeof(float));
  const auto stash_of = [&](const ArenaStash& s) {
    return reinterpret_cast<std::uint16_t*>(arena_.data() + arena.offset(s.stash) / kFloat);
  };
  const auto kept = [&](const ArenaStash& s) -> Tensor& {
    const auto k = static_cast<std::size_t>(s.layer);
    return s.input == TransientArena::kNone ? outputs_[k] : windows_[k][s.input];
  };
  // NaNs into the buffers whose last half-step was `last` (ExecutorOptions::poison_dead_tensors).
  const auto poison = [&](int last) {
    if (!options_.poison_dead_tensors) return;
    for (std::size_t b = 0; b < arena.buffers.size(); ++b)
      if (arena.buffers[b].last == last) {
        const std::int64_t begin = arena.offset(b) / kFloat;
        arena_.slice(begin, begin + arena.buffers[b].size / kFloat).fill(std::numeric_limits<float>::quiet_NaN());
      }
  };
  // Forward read these for the last time in the step before: keep them in bf16 until backward.
  for (const ArenaStash& s : arena.stashes)
    if (s.packed == time - 1) backend_->elementwise().to_bf16(kept(s).data(), stash_of(s), kept(s).numel());
  poison(2 * time - 2);  // dead since the step before (the fp32 originals of those included)
  // The first backward that reads these is now: widen them into their place for backward (whose
  // memory may have been a tensor that died in the step before).
  for (const ArenaStash& s : arena.stashes) {
    if (s.widened != time) continue;
    const auto k = static_cast<std::size_t>(s.layer);
    if (s.input == TransientArena::kNone) {
      for (std::size_t m = 0; m < outputs_.size(); ++m)  // the layers of an in-place chain share it
        if (arena.output[m] == s.from) outputs_[m] = arena_view(arena, s.to, ex.output_extent[m]);
    } else {
      windows_[k][s.input] = arena_view(arena, s.to, ex.copy_extent[k][s.input]);
    }
    backend_->elementwise().from_bf16(stash_of(s), kept(s).data(), kept(s).numel());
  }
  poison(2 * time - 1);  // the bf16 copies just widened
}

std::int64_t Executor::current_bytes() const {
  // Each buffer once: a layer running in place shares its input's output and gradient.
  std::int64_t bytes = 0;
  std::unordered_set<const void*> counted;
  const auto count = [&](const Tensor& t) {
    if (counted.insert(t.buffer_id()).second) bytes += t.allocated_bytes();
  };
  count(arena_);  // a training step's tensors are views into it
  for (const auto& t : outputs_) count(t);
  for (const auto& t : grads_) count(t);
  for (const auto& t : partials_) count(t);
  for (const auto& t : partial_grads_) count(t);
  for (const auto& node : windows_)
    for (const auto& t : node) count(t);
  for (const auto& node : window_grads_)
    for (const auto& t : node) count(t);
  for (const auto& node : model_.nodes()) bytes += node.layer->workspace_bytes();
  return bytes;
}

}  // namespace tessera
