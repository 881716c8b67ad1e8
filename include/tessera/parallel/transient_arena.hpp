#pragma once
// Where a training step's tensors live: one arena per rank, laid out by lifetimes.
//
// Nothing a step computes outlives it: forward writes every layer's output (and the copies of
// inputs a layer reads through an exchange: halo windows, redistributions), backward reads them
// and writes the gradients, and the next step starts afresh. Each tensor lives for a while only:
// an output from its layer's forward to the backward of its earliest reader whose backward reads
// its values (or, when no backward does or every reader copies it, to its readers' last
// forward); a copy from its reader's forward to that reader's backward (its forward, when that
// backward does not read it); an output gradient from the backward step that first writes it
// (its last reader's, or the loss) to the layer's own backward; a copy's gradient and a
// channel-split layer's partial sums (and their gradient) during their layer's forward or
// backward only; an output its reader's window holds is that window, from its own forward on
// (TransientGraph::output_in_copy). Backward runs the layers in reverse order, so as it writes the large gradients
// of the first layers, the outputs of the last ones are dead. The executor places all of these in one buffer, at offsets where tensors alive
// at the same time never overlap; the planner lays out the same arena to price memory. Both call
// transient_arena, so they agree by construction.
#include <cstdint>
#include <vector>

namespace tessera {

/// A buffer of `size` bytes alive at the times first..last (inclusive; TransientArena's
/// half-steps).
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

/// Greedy: each buffer at the lowest aligned offset clear of every placed buffer alive at a common
/// time, in three orders (the largest first, of equal sizes the longest-lived; the longest-lived
/// first; the first born first), the smallest layout kept: deterministic, and on layer graphs
/// close to the most bytes alive at once (its lower bound). `alignment` > 0.
ArenaLayout lay_out_arena(const std::vector<ArenaBuffer>& buffers, std::int64_t alignment);

/// One training step's layer graph, as transient_arena reads it (sizes in bytes, this rank's).
struct TransientGraph {
  /// Per layer (model order): the layers it reads (negative: the model's input, no gradient).
  std::vector<std::vector<int>> inputs;
  /// Per layer: it runs in place over its one input: its output is its input's tensor, and its
  /// input's gradient its own output gradient.
  std::vector<bool> in_place;
  /// The layer whose output the loss reads (its gradient is written by the loss).
  int output = 0;
  /// Per layer: the size of its output (and of its output gradient).
  std::vector<std::int64_t> output_bytes;
  /// Per layer: every reader copies its output (its backward never reads it): the output is let
  /// go after the last reader's forward.
  std::vector<bool> released;
  /// Per layer and input: the size of its copy of that input, and of the copy's gradient (0: read
  /// as produced; the model's input has no gradient).
  std::vector<std::vector<std::int64_t>> input_copy_bytes;
  /// Per layer: the size of its partial sums and of their gradient (channel splits; 0: none).
  std::vector<std::int64_t> partial_bytes;
  /// Per layer and input: its backward reads the values of that input (Layer::
  /// backward_reads_inputs; a layer whose backward its reader does reads nothing). Empty: all do.
  std::vector<std::vector<bool>> backward_reads;
  /// Per layer: its backward reads its own output (max pooling through a leaky ReLU, LayerContext::
  /// leaky_relu_before). Empty: none does.
  std::vector<bool> reads_own_output;
  /// Per layer: its backward needs the fp32 values of what it reads (LayerTraits::backward_reads_fp32):
  /// no bf16 copy of those. Empty: none does.
  std::vector<bool> backward_reads_fp32;
  /// Per layer: the reader whose copy of its one input holds this output (StepPlan::
  /// output_in_window): output and copy are one buffer, from this layer's forward to the later
  /// of their lives, and so are their gradients. -1: none. Empty: none has one.
  std::vector<int> output_in_copy;
  /// Per layer: the earlier layer whose passes do this one's (StepPlan::pooled_by): its forward
  /// writes this layer's output, which is born then; its backward reads this layer's output
  /// gradient (and its output where it reads its own). Its input's output and gradient (down
  /// through layers in place to that earlier one) are never written: no buffers (kNone). -1: none.
  /// Empty: none.
  std::vector<int> pooled_by;
  /// Keep what backward reads in bf16 between its last forward read and its first backward read
  /// (Model::activation_precision; ArenaStash), where that makes the arena smaller (where the
  /// peak is a layer's backward with its fp32 input and gradients, the copies only add buffers).
  bool bf16_stash = false;
};

/// A tensor that backward reads, kept in bf16 between forward and backward (TransientGraph::
/// bf16_stash): its fp32 buffer `from` lives until the last time forward reads it, `packed` (the
/// executor then rounds it into `stash`, half the bytes); just before step `widened`, the first
/// backward that reads it (time 2 widened - 1, when the gradients that step writes are not yet
/// alive), the executor widens `stash` into the fp32 buffer `to`, which backward reads from then
/// on. Only where the gap is two steps or more. Steps as TransientArena's.
struct ArenaStash {
  int layer = 0;
  /// kNone: the layer's output (shared by the layers of an in-place chain); else its copy of
  /// that input.
  std::size_t input = static_cast<std::size_t>(-1);
  std::size_t from = 0, stash = 0, to = 0;
  int packed = 0, widened = 0;
};

/// The arena of a step. Steps: layer i's forward is step i, the loss step n (the number of
/// layers), layer k's backward step 2n - k. Buffers' times are half-steps: step s is time 2s, and
/// time 2s - 1 the moment just before it (ArenaStash). A chain of layers running in place shares
/// one output buffer and one gradient buffer. kNone: no such tensor.
struct TransientArena {
  static constexpr std::size_t kNone = static_cast<std::size_t>(-1);
  std::vector<ArenaBuffer> buffers;                       ///< every buffer's size and lifetime
  ArenaLayout layout;
  std::vector<std::size_t> output;                        ///< per layer: its output's buffer
  std::vector<std::size_t> output_grad;                   ///< per layer: its output gradient's
  std::vector<std::vector<std::size_t>> input_copy;       ///< per layer and input: its copy's
  std::vector<std::vector<std::size_t>> input_copy_grad;  ///< per layer and input: its copy's gradient's
  std::vector<std::size_t> partial;                       ///< per layer: its partial sums'
  std::vector<std::size_t> partial_grad;                  ///< per layer: its partial sums' gradient's
  std::vector<ArenaStash> stashes;                        ///< the bf16 copies (TransientGraph::bf16_stash)
  /// Byte offset of buffer `b`.
  std::int64_t offset(std::size_t b) const { return layout.offsets[b]; }
};

/// Alignment of the arena's buffers (bytes): SIMD loads on the host, cuDNN and coalescing on GPUs.
constexpr std::int64_t kArenaAlignment = 256;

TransientArena transient_arena(const TransientGraph& graph);

}  // namespace tessera
