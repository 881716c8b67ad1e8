#pragma once
// Where a training step's transient tensors live: one arena per rank, laid out by lifetimes.
//
// Backward runs the layers in reverse order. A layer's output gradient is needed from the step
// that first writes it (its last reader's backward, or the loss) to the layer's own backward; the
// gradients of a layer's copies of its inputs (halo windows, redistributions) and of its partial
// sums (channel splits) only during that layer's backward. So most gradients are dead long before
// the earliest layers' are written. Forward has transients too: an output that every reader
// copies lives until the last copy is made, a channel-split layer's partial sums until they are
// summed; and no gradient is alive during forward. The executor places all of these in one
// buffer, at offsets where tensors alive at the same time never overlap; the planner lays out the
// same arena to price memory. Both call transient_arena, so they agree by construction.
#include <cstdint>
#include <vector>

namespace tessera {

/// A buffer of `size` bytes alive at the times first..last (inclusive).
struct ArenaBuffer {
  std::int64_t size = 0;
  int first = 0, last = 0;
};

/// Offsets into one buffer (each a multiple of the alignment) at which buffers alive at a common
/// time never overlap, and that buffer's size.
struct ArenaLayout {
  std::vector<std::int64_t> offsets;
  std::int64_t size = 0;
};

/// Greedy by size (the largest buffer first, each at the lowest aligned offset clear of every
/// placed buffer alive at a common time): deterministic, and on layer graphs close to the most
/// bytes alive at once. `alignment` > 0.
ArenaLayout lay_out_arena(const std::vector<ArenaBuffer>& buffers, std::int64_t alignment);

/// One training step's layer graph, as transient_arena reads it (sizes in bytes, this rank's).
struct TransientGraph {
  /// Per layer (model order): the layers it reads (negative: the model's input, no gradient).
  std::vector<std::vector<int>> inputs;
  /// Per layer: it runs in place over its one input, whose gradient is its own output gradient.
  std::vector<bool> in_place;
  /// The layer whose output the loss reads (its gradient is written before backward).
  int output = 0;
  /// Per layer: the size of its output (and of its output gradient).
  std::vector<std::int64_t> output_bytes;
  /// Per layer: the layer after whose forward its output is let go (every reader copies it; that
  /// reader makes the last copy), or -1: kept for backward.
  std::vector<int> released_after;
  /// Per layer and input: the size of the gradient of its copy of that input (0: read as produced).
  std::vector<std::vector<std::int64_t>> input_copy_grad;
  /// Per layer: the size of its partial sums and of their gradient (channel splits; 0: none).
  std::vector<std::int64_t> partial_bytes;
};

/// The arena of a step's transients. Times: layer k's backward is time k, the loss time n (the
/// number of layers), layer i's forward time n + 1 + i. Each layer's output gradient is one buffer,
/// shared along a chain of layers running in place. kNone: no such tensor.
struct TransientArena {
  static constexpr std::size_t kNone = static_cast<std::size_t>(-1);
  ArenaLayout layout;
  std::vector<std::size_t> output_grad;                   ///< per layer: its output gradient's buffer
  std::vector<std::vector<std::size_t>> input_copy_grad;  ///< per layer and input: its copy's gradient's
  std::vector<std::size_t> partial_grad;                  ///< per layer: its partial sums' gradient's
  std::vector<std::size_t> released_output;               ///< per layer: its output's, when let go in forward
  std::vector<std::size_t> partial;                       ///< per layer: its partial sums' (forward)
  /// Byte offset of buffer `b`.
  std::int64_t offset(std::size_t b) const { return layout.offsets[b]; }
};

/// Alignment of the arena's buffers (bytes): SIMD loads on the host, cuDNN and coalescing on GPUs.
constexpr std::int64_t kArenaAlignment = 256;

TransientArena transient_arena(const TransientGraph& graph);

}  // namespace tessera
