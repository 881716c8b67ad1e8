#include "tessera/parallel/transient_arena.hpp"

#include <algorithm>
#include <numeric>

#include "tessera/core/error.hpp"

namespace tessera {
namespace {

std::int64_t align_up(std::int64_t bytes, std::int64_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

}  // namespace

ArenaLayout lay_out_arena(const std::vector<ArenaBuffer>& buffers, std::int64_t alignment) {
  TESSERA_CHECK(alignment > 0, "lay_out_arena: alignment {} must be positive", alignment);
  ArenaLayout layout;
  layout.offsets.assign(buffers.size(), 0);
  std::vector<std::size_t> order(buffers.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return buffers[a].size > buffers[b].size; });
  std::vector<std::size_t> placed, clashing;
  for (std::size_t b : order) {
    const ArenaBuffer& buffer = buffers[b];
    TESSERA_CHECK(buffer.size >= 0 && buffer.first <= buffer.last, "lay_out_arena: buffer {} of {} bytes over steps {}..{}",
                  b, buffer.size, buffer.first, buffer.last);
    if (buffer.size == 0) continue;  // occupies nothing
    clashing.clear();
    for (std::size_t p : placed)
      if (buffers[p].first <= buffer.last && buffer.first <= buffers[p].last) clashing.push_back(p);
    std::sort(clashing.begin(), clashing.end(),
              [&](std::size_t a, std::size_t c) { return layout.offsets[a] < layout.offsets[c]; });
    std::int64_t offset = 0;
    for (std::size_t p : clashing) {
      if (offset + buffer.size <= layout.offsets[p]) break;  // fits in the gap below p
      offset = std::max(offset, align_up(layout.offsets[p] + buffers[p].size, alignment));
    }
    layout.offsets[b] = offset;
    layout.size = std::max(layout.size, offset + buffer.size);
    placed.push_back(b);
  }
  layout.size = align_up(layout.size, alignment);
  return layout;
}

TransientArena transient_arena(const TransientGraph& graph) {
  const std::size_t n = graph.inputs.size();
  TESSERA_CHECK(graph.in_place.size() == n && graph.output_bytes.size() == n && graph.released_after.size() == n &&
                    graph.input_copy_grad.size() == n && graph.partial_bytes.size() == n && graph.output >= 0 &&
                    static_cast<std::size_t>(graph.output) < n,
                "transient_arena: a graph of {} layers with mismatched fields", n);
  const auto forward_time = [n](std::size_t i) { return static_cast<int>(n + 1 + i); };
  // The time each output gradient is first written: its last reader's backward (backward runs
  // the layers in reverse), the loss's (time n) for the output.
  std::vector<int> written(n);
  for (std::size_t i = 0; i < n; ++i) written[i] = static_cast<int>(i);
  for (std::size_t i = 0; i < n; ++i)
    for (int j : graph.inputs[i])
      if (j >= 0) written[static_cast<std::size_t>(j)] = std::max(written[static_cast<std::size_t>(j)], static_cast<int>(i));
  written[static_cast<std::size_t>(graph.output)] = static_cast<int>(n);

  TransientArena arena;
  std::vector<ArenaBuffer> buffers;
  const auto add = [&](std::int64_t size, int first, int last) {
    buffers.push_back({size, first, last});
    return buffers.size() - 1;
  };
  arena.output_grad.assign(n, TransientArena::kNone);
  // Last layer first: a layer running in place hands its buffer to its input, whose backward
  // (an earlier time) reads it last.
  for (std::size_t i = n; i-- > 0;) {
    std::size_t& b = arena.output_grad[i];
    if (b == TransientArena::kNone) {
      b = add(graph.output_bytes[i], static_cast<int>(i), written[i]);
    } else {
      buffers[b].first = static_cast<int>(i);
      buffers[b].size = std::max(buffers[b].size, graph.output_bytes[i]);
    }
    if (graph.in_place[i]) {
      TESSERA_CHECK(graph.inputs[i].size() == 1 && graph.inputs[i][0] >= 0 &&
                        static_cast<std::size_t>(graph.inputs[i][0]) < i,
                    "transient_arena: layer {} runs in place but does not read one earlier layer", i);
      arena.output_grad[static_cast<std::size_t>(graph.inputs[i][0])] = b;
    }
  }
  arena.input_copy_grad.resize(n);
  arena.partial_grad.assign(n, TransientArena::kNone);
  arena.released_output.assign(n, TransientArena::kNone);
  arena.partial.assign(n, TransientArena::kNone);
  for (std::size_t k = 0; k < n; ++k) {
    const int step = static_cast<int>(k);
    TESSERA_CHECK(graph.input_copy_grad[k].size() == graph.inputs[k].size(),
                  "transient_arena: layer {} has {} inputs but {} copy sizes", k, graph.inputs[k].size(),
                  graph.input_copy_grad[k].size());
    for (std::int64_t size : graph.input_copy_grad[k])
      arena.input_copy_grad[k].push_back(size > 0 ? add(size, step, step) : TransientArena::kNone);
    if (graph.partial_bytes[k] > 0) {
      arena.partial_grad[k] = add(graph.partial_bytes[k], step, step);
      arena.partial[k] = add(graph.partial_bytes[k], forward_time(k), forward_time(k));
    }
    if (const int last = graph.released_after[k]; last >= 0) {
      TESSERA_CHECK(static_cast<std::size_t>(last) > k && static_cast<std::size_t>(last) < n,
                    "transient_arena: layer {}'s output let go after layer {}", k, last);
      arena.released_output[k] = add(graph.output_bytes[k], forward_time(k), forward_time(static_cast<std::size_t>(last)));
    }
  }
  arena.layout = lay_out_arena(buffers, kArenaAlignment);
  return arena;
}

}  // namespace tessera
