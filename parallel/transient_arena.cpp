#include "tessera/parallel/transient_arena.hpp"

#include <algorithm>
#include <limits>
#include <numeric>

#include "tessera/core/error.hpp"

namespace tessera {
namespace {

std::int64_t align_up(std::int64_t bytes, std::int64_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

/// Each buffer in `order` at the lowest aligned offset clear of every buffer placed before it
/// that is alive at a common time.
ArenaLayout place_in_order(const std::vector<ArenaBuffer>& buffers, const std::vector<std::size_t>& order,
                           std::int64_t alignment) {
  ArenaLayout layout;
  layout.offsets.assign(buffers.size(), 0);
  std::vector<std::size_t> placed, clashing;
  for (std::size_t b : order) {
    const ArenaBuffer& buffer = buffers[b];
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

}  // namespace

ArenaLayout lay_out_arena(const std::vector<ArenaBuffer>& buffers, std::int64_t alignment) {
  TESSERA_CHECK(alignment > 0, "lay_out_arena: alignment {} must be positive", alignment);
  for (std::size_t b = 0; b < buffers.size(); ++b)
    TESSERA_CHECK(buffers[b].size >= 0 && buffers[b].first <= buffers[b].last,
                  "lay_out_arena: buffer {} of {} bytes over times {}..{}", b, buffers[b].size, buffers[b].first,
                  buffers[b].last);
  const auto length = [&](std::size_t b) { return buffers[b].last - buffers[b].first; };
  // Three greedy orders; the smallest layout wins (the first of equal ones).
  // The largest first; of equal sizes the longest-lived first (they constrain the others most).
  const auto by_size = [&](std::size_t a, std::size_t b) {
    if (buffers[a].size != buffers[b].size) return buffers[a].size > buffers[b].size;
    return length(a) > length(b);
  };
  // The longest-lived first (the bf16 copies that span a step), then by size.
  const auto by_lifetime = [&](std::size_t a, std::size_t b) {
    if (length(a) != length(b)) return length(a) > length(b);
    return buffers[a].size > buffers[b].size;
  };
  // In the order they are born (of those born together, the largest first).
  const auto by_birth = [&](std::size_t a, std::size_t b) {
    if (buffers[a].first != buffers[b].first) return buffers[a].first < buffers[b].first;
    return buffers[a].size > buffers[b].size;
  };
  ArenaLayout best;
  bool first = true;
  std::vector<std::size_t> order(buffers.size());
  const auto try_order = [&](const auto& before) {
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), before);
    ArenaLayout layout = place_in_order(buffers, order, alignment);
    if (first || layout.size < best.size) best = std::move(layout);
    first = false;
  };
  try_order(by_size);
  try_order(by_lifetime);
  try_order(by_birth);
  return best;
}

namespace {

/// transient_arena with bf16 copies (ArenaStash) where `stash` is set.
TransientArena build_arena(const TransientGraph& graph, bool stash) {
  const std::size_t n = graph.inputs.size();
  TESSERA_CHECK(graph.in_place.size() == n && graph.output_bytes.size() == n && graph.released.size() == n &&
                    graph.input_copy_bytes.size() == n && graph.partial_bytes.size() == n && graph.output >= 0 &&
                    static_cast<std::size_t>(graph.output) < n &&
                    (graph.backward_reads.empty() || graph.backward_reads.size() == n) &&
                    (graph.reads_own_output.empty() || graph.reads_own_output.size() == n) &&
                    (graph.backward_reads_fp32.empty() || graph.backward_reads_fp32.size() == n) &&
                    (graph.output_in_copy.empty() || graph.output_in_copy.size() == n) &&
                    (graph.pooled_by.empty() || graph.pooled_by.size() == n),
                "transient_arena: a graph of {} layers with mismatched fields", n);
  // In half-steps (TransientArena): step s is time 2s.
  const int loss = 2 * static_cast<int>(n);
  const auto forward = [](std::size_t i) { return 2 * static_cast<int>(i); };
  const auto backward = [n](std::size_t k) { return 2 * static_cast<int>(2 * n - k); };
  // The layer whose passes do layer k's (pooled_by; k itself where none).
  const auto done_by = [&](std::size_t k) {
    const int other = graph.pooled_by.empty() ? -1 : graph.pooled_by[k];
    TESSERA_CHECK(other < static_cast<int>(k),
                  "transient_arena: layer {}'s passes done by layer {}, not an earlier one", k, other);
    return other >= 0 ? static_cast<std::size_t>(other) : k;
  };
  // When a layer's output is born, and when its own backward work runs.
  const auto own_forward = [&](std::size_t k) { return forward(done_by(k)); };
  const auto own_backward = [&](std::size_t k) { return backward(done_by(k)); };
  // Per layer: neither its output nor its gradient is ever written, as the input (down through
  // layers in place) of a layer whose passes an earlier one does.
  std::vector<bool> unwritten(n, false);
  for (std::size_t k = 0; k < graph.pooled_by.size(); ++k) {
    if (graph.pooled_by[k] < 0) continue;
    for (int u = graph.inputs[k].at(0); u >= 0;
         u = graph.in_place[static_cast<std::size_t>(u)] ? graph.inputs[static_cast<std::size_t>(u)][0] : -1) {
      unwritten[static_cast<std::size_t>(u)] = true;
      if (u == graph.pooled_by[k]) break;
    }
  }
  // Each layer's last reader (whose backward first writes its gradient).
  std::vector<int> last_reader(n, -1);
  for (std::size_t i = 0; i < n; ++i)
    for (int j : graph.inputs[i]) {
      if (j < 0) continue;
      const auto u = static_cast<std::size_t>(j);
      TESSERA_CHECK(u < i, "transient_arena: layer {} reads layer {}, not an earlier one", i, j);
      last_reader[u] = static_cast<int>(i);
    }
  // The reader whose copy holds layer i's output (-1: none).
  const auto in_copy = [&](std::size_t i) { return graph.output_in_copy.empty() ? -1 : graph.output_in_copy[i]; };
  for (std::size_t i = 0; i < n; ++i) {
    const int k = in_copy(i);
    if (k < 0) continue;
    const auto u = static_cast<std::size_t>(k);
    TESSERA_CHECK(u < n && graph.inputs[u].size() == 1 && graph.inputs[u][0] == static_cast<int>(i) &&
                      graph.input_copy_bytes[u].at(0) >= graph.output_bytes[i] && !graph.in_place[i],
                  "transient_arena: layer {}'s output in the copy of layer {}, which does not copy it alone", i, k);
  }
  for (std::size_t i = 0; i < n; ++i)
    if (graph.in_place[i])
      TESSERA_CHECK(graph.inputs[i].size() == 1 && graph.inputs[i][0] >= 0 && !graph.released[static_cast<std::size_t>(graph.inputs[i][0])],
                    "transient_arena: layer {} runs in place but does not read one earlier layer as produced", i);

  TransientArena arena;
  std::vector<ArenaBuffer> buffers;
  const auto add = [&](std::int64_t size, int first, int last) {
    buffers.push_back({size, first, last});
    return buffers.size() - 1;
  };
  const auto reads = [&](std::size_t k, std::size_t a) {
    return graph.backward_reads.empty() || graph.backward_reads[k].at(a);
  };
  const auto needs_fp32 = [&](std::size_t k) { return !graph.backward_reads_fp32.empty() && graph.backward_reads_fp32[k]; };
  // When each output is read: in forward by its layer and its readers (a copy is made in its
  // reader's forward; the loss reads the loss's input), in backward by each reader that reads it as
  // produced and whose backward reads values, and by its own backward where that reads it.
  constexpr int kNever = std::numeric_limits<int>::max();
  struct Reads {
    int forward_last = 0;
    int backward_first = kNever, backward_last = -1;
    bool fp32 = false;  ///< by a backward that needs fp32 values (no bf16 copy)
    void in_backward(int time, bool needs_fp32) {
      backward_first = std::min(backward_first, time);
      backward_last = std::max(backward_last, time);
      fp32 = fp32 || needs_fp32;
    }
  };
  std::vector<Reads> read(n);
  for (std::size_t i = 0; i < n; ++i) {
    read[i].forward_last = static_cast<int>(i) == graph.output ? loss : forward(i);
    if (!graph.reads_own_output.empty() && graph.reads_own_output[i])
      read[i].in_backward(own_backward(i), needs_fp32(i));
  }
  for (std::size_t k = 0; k < n; ++k) {
    TESSERA_CHECK(graph.backward_reads.empty() || graph.backward_reads[k].size() == graph.inputs[k].size(),
                  "transient_arena: layer {} has {} inputs but {} backward reads", k, graph.inputs[k].size(),
                  graph.backward_reads.empty() ? 0 : graph.backward_reads[k].size());
    for (std::size_t a = 0; a < graph.inputs[k].size(); ++a) {
      const int j = graph.inputs[k][a];
      if (j < 0) continue;
      const auto u = static_cast<std::size_t>(j);
      read[u].forward_last = std::max(read[u].forward_last, forward(k));
      if (!graph.released[u] && graph.input_copy_bytes[k].at(a) == 0 && reads(k, a))
        read[u].in_backward(backward(k), needs_fp32(k));
    }
  }
  // Outputs, first layer first: a layer running in place takes its input's buffer.
  arena.output.assign(n, TransientArena::kNone);
  for (std::size_t i = 0; i < n; ++i) {
    if (unwritten[i]) continue;
    const int last = std::max(read[i].forward_last, read[i].backward_last);
    if (graph.in_place[i]) {
      const std::size_t b = arena.output[static_cast<std::size_t>(graph.inputs[i][0])];
      arena.output[i] = b;
      buffers[b].last = std::max(buffers[b].last, last);
      buffers[b].size = std::max(buffers[b].size, graph.output_bytes[i]);
    } else if (const int k = in_copy(i); k >= 0) {
      // The reader's copy: from this forward to the copy's last read (its reader's backward).
      const auto u = static_cast<std::size_t>(k);
      arena.output[i] =
          add(graph.input_copy_bytes[u][0], own_forward(i), std::max(last, reads(u, 0) ? backward(u) : forward(u)));
    } else {
      arena.output[i] = add(graph.output_bytes[i], own_forward(i), last);
    }
  }
  // Output gradients, last layer first: a layer running in place hands its buffer to its input,
  // whose backward reads it last. Written first by the last reader's backward (the loss for the
  // output).
  arena.output_grad.assign(n, TransientArena::kNone);
  // No gradient where a layer's passes are done by an earlier one (pooled_by).
  for (std::size_t i = n; i-- > 0;) {
    std::size_t& b = arena.output_grad[i];
    if (unwritten[i]) continue;
    const int written = static_cast<int>(i) == graph.output ? loss
                        : last_reader[i] >= 0           ? backward(static_cast<std::size_t>(last_reader[i]))
                                                        : backward(i);
    if (b == TransientArena::kNone) {
      // (an output in its reader's copy: the copy's gradient, written by that reader)
      const int k = in_copy(i);
      b = add(k >= 0 ? graph.input_copy_bytes[static_cast<std::size_t>(k)][0] : graph.output_bytes[i], written,
              own_backward(i));
    } else {
      buffers[b].first = std::min(buffers[b].first, written);
      buffers[b].last = std::max(buffers[b].last, own_backward(i));
      buffers[b].size = std::max(buffers[b].size, graph.output_bytes[i]);
    }
    if (graph.in_place[i]) arena.output_grad[static_cast<std::size_t>(graph.inputs[i][0])] = b;
  }
  // bf16 copies of what backward reads, from the last forward read to just before the first
  // backward read (two steps apart at least: one layer between, or the loss): `from` ends at
  // `packed`, the copy spans the gap, `to` lives from the widening to `last`.
  const auto keep_in_bf16 = [&](std::size_t layer, std::size_t input, std::size_t from, int packed, int widened,
                                int last) {
    const std::int64_t size = buffers[from].size;
    buffers[from].last = packed;
    ArenaStash s;
    s.layer = static_cast<int>(layer);
    s.input = input;
    s.from = from;
    s.packed = packed / 2;
    s.widened = widened / 2;
    s.stash = add((size / 4 + 1) / 2 * 4, packed, widened - 1);  // bf16 of fp32 bytes
    s.to = add(size, widened - 1, last);
    arena.stashes.push_back(s);
  };
  if (stash) {
    // An in-place chain's buffer: what its layers' outputs see together.
    std::vector<Reads> chain(buffers.size());
    for (std::size_t i = 0; i < n; ++i) {
      if (arena.output[i] == TransientArena::kNone) continue;  // never written
      Reads& c = chain[arena.output[i]];
      c.forward_last = std::max(c.forward_last, read[i].forward_last);
      if (read[i].backward_last >= 0) {
        c.in_backward(read[i].backward_first, read[i].fp32);
        c.in_backward(read[i].backward_last, false);
      }
    }
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t b = arena.output[i];
      if (b == TransientArena::kNone || graph.in_place[i] || in_copy(i) >= 0 || chain[b].fp32 ||
          chain[b].backward_first == kNever || chain[b].backward_first - chain[b].forward_last < 4)
        continue;
      keep_in_bf16(i, TransientArena::kNone, b, chain[b].forward_last, chain[b].backward_first, buffers[b].last);
    }
  }
  arena.input_copy.resize(n);
  arena.input_copy_grad.resize(n);
  arena.partial.assign(n, TransientArena::kNone);
  arena.partial_grad.assign(n, TransientArena::kNone);
  for (std::size_t k = 0; k < n; ++k) {
    TESSERA_CHECK(graph.input_copy_bytes[k].size() == graph.inputs[k].size(),
                  "transient_arena: layer {} has {} inputs but {} copy sizes", k, graph.inputs[k].size(),
                  graph.input_copy_bytes[k].size());
    for (std::size_t a = 0; a < graph.inputs[k].size(); ++a) {
      const int j = graph.inputs[k][a];
      if (j >= 0 && in_copy(static_cast<std::size_t>(j)) == static_cast<int>(k)) {
        // Its producer's output and gradient are this copy and its gradient.
        arena.input_copy[k].push_back(arena.output[static_cast<std::size_t>(j)]);
        arena.input_copy_grad[k].push_back(arena.output_grad[static_cast<std::size_t>(j)]);
        continue;
      }
      const std::int64_t size = graph.input_copy_bytes[k][a];
      const bool graded = size > 0 && j >= 0;
      arena.input_copy[k].push_back(size > 0 ? add(size, forward(k), reads(k, a) ? backward(k) : forward(k))
                                             : TransientArena::kNone);
      if (stash && size > 0 && reads(k, a) && !needs_fp32(k))
        keep_in_bf16(k, a, arena.input_copy[k].back(), forward(k), backward(k), backward(k));
      arena.input_copy_grad[k].push_back(graded ? add(size, backward(k), backward(k)) : TransientArena::kNone);
    }
    if (graph.partial_bytes[k] > 0) {
      arena.partial[k] = add(graph.partial_bytes[k], forward(k), forward(k));
      arena.partial_grad[k] = add(graph.partial_bytes[k], backward(k), backward(k));
    }
  }
  arena.layout = lay_out_arena(buffers, kArenaAlignment);
  arena.buffers = std::move(buffers);
  return arena;
}

}  // namespace

TransientArena transient_arena(const TransientGraph& graph) {
  TransientArena plain = build_arena(graph, false);
  if (!graph.bf16_stash) return plain;
  // The bf16 copies add passes and buffers; where the peak is elsewhere (a layer's backward with
  // its fp32 input and gradients) the layout can come out larger with them: keep the smaller.
  TransientArena stashed = build_arena(graph, true);
  return stashed.layout.size < plain.layout.size ? stashed : plain;
}

}  // namespace tessera
