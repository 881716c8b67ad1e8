#pragma once
// The step plan: what a training step does with each layer's tensors on one rank, decided once
// for the executor that runs it and the cost model that prices it (parallel/README.md).
#include <cstdint>
#include <optional>
#include <vector>

#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/transient_arena.hpp"

namespace tessera {

/// What a layer's kind lets the step plan do with it (Layer::traits, PlannerLayer::traits).
struct LayerTraits {
  /// Forward may write its output over its input, backward its input gradient over its output
  /// gradient (relu and leaky_relu with a slope >= 0, whose output has the sign of its input).
  bool runs_in_place = false;
  /// relu (0) or leaky_relu: the slope a producer's kernels can apply instead.
  std::optional<float> leaky_relu_slope;
  /// Its forward kernels can apply a leaky ReLU to its output in the same pass (convolution;
  /// which slopes, StepOptions::fuses_zero_slope says).
  bool fuses_leaky_relu = false;
  /// Its backward can do the backward of a leaky ReLU it reads (max pooling whose windows do not
  /// overlap), and then reads its own output.
  bool fuses_leaky_relu_backward = false;
  /// Its backward reads the values of its inputs (else only their shapes).
  bool backward_reads_inputs = true;
  /// ...and needs them in fp32 (a convolution or linear layer computing in fp32).
  bool backward_reads_fp32 = false;
  /// It can recompute part of its output tile once halos arrived (convolution).
  bool computes_output_regions = false;
  /// Its backward splits into input gradients and parameter gradients (convolution).
  bool splits_backward = false;
  /// Its host kernels can write its output into a part of a larger tensor, its reader's halo
  /// window, and read the output and its gradient there in backward (pooling).
  bool writes_into_window = false;
  /// Its backward-weights can read, instead of its output gradient, the gradient and maxima of a
  /// max pooling of its output (a convolution of one input channel in fp32 on the host kernels:
  /// ConvolutionKernels::reads_pooled_gradient).
  bool reads_pooled_gradient = false;
  /// Max pooling whose windows are 2 wide and high (1 or 2 deep) at their own stride, without
  /// padding: a producer that reads_pooled_gradient can do its backward (in rows of
  /// kPooledRowWindows or more).
  bool pools_in_pairs = false;
};

/// One layer of a step as this rank runs it (sizes in bytes).
struct StepLayer {
  /// The layers it reads (negative: the model's input).
  std::vector<int> inputs;
  LayerTraits traits;
  /// Per input: it reads a copy an exchange makes (a window with halos, a redistribution, a
  /// gather of channels), not the producer's tensor as produced.
  std::vector<bool> copies_input;
  /// Split by channel: it computes partial sums that an exchange reduce-scatters into its output.
  bool channel_split = false;
  std::int64_t output_bytes = 0;
  /// Per input: the size of its copy (0 where it reads the tensor as produced).
  std::vector<std::int64_t> input_copy_bytes;
  /// Per input: its copy is a halo window that holds the producer's whole tile (samples and
  /// channels alike; TileExchange::holds_own_tile), so the producer may write into it. Empty: none.
  std::vector<bool> copy_holds_tile;
  /// Its partial sums' size (channel splits; else 0).
  std::int64_t partial_bytes = 0;
  /// The innermost extent of its output tile (a row's elements; 0: not said).
  std::int64_t output_row = 0;
};

/// The fewest windows in a row of the max pooling whose backward its convolution does
/// (StepPlan::gradient_from_pooling): shorter rows cost more to make one by one than the pooling's
/// own backward (Fashion-MNIST's rows of 14: 2.3 ms against 1.3 ms, docs/benchmarks.md).
constexpr std::int64_t kPooledRowWindows = 16;

struct StepGraph {
  std::vector<StepLayer> layers;  ///< in model order (topological)
  int output = 0;                 ///< the layer whose output the loss reads
  /// The activations backward reads are kept in bf16 between forward and backward where that
  /// makes the arena smaller (Model::activation_precision).
  bool bf16_activations = false;
};

struct StepOptions {
  /// Layers run in place where they can (false: every layer keeps an output of its own).
  bool in_place = true;
  /// Leaky ReLUs running in place fuse into their producer's forward or their reader's backward.
  bool fuse = true;
  /// The backend's convolutions also fuse a slope of 0 (a plain ReLU): on GPUs; oneDNN's relu
  /// post-op drops NaNs, so on the host only slopes > 0 fuse.
  bool fuses_zero_slope = false;
  /// Producers that can (LayerTraits::writes_into_window) write their output into their one
  /// reader's halo window (the host; the GPU kernels write dense outputs).
  bool outputs_into_windows = true;
  /// A max pooling's backward done by the convolution it reads (StepPlan::gradient_from_pooling;
  /// the host's kernels; needs `fuse`).
  bool pooled_gradients = true;
};

/// The options the executor's backends give on the host or on GPUs, for those who plan or time
/// a step without running one (the cost model, calibrate's probes).
StepOptions default_step_options(bool gpu);

/// How much larger (a share of its size) the arena may grow for outputs written into their
/// readers' windows (StepPlan::output_in_window; the trade measured in docs/benchmarks.md).
constexpr double kWindowArenaGrowth = 0.05;

/// The step plan of one rank: per layer, what its forward and backward do with its tensors.
struct StepPlan {
  /// It runs in place over its one input: its output is that tensor, its input gradient its own
  /// output gradient.
  std::vector<bool> in_place;
  /// It runs in place and its producer applies it in its own forward (its forward is skipped).
  std::vector<bool> fused;
  /// The leaky ReLU slope its forward applies for the layer fused into it.
  std::vector<std::optional<float>> leaky_relu_after;
  /// It runs in place and its one reader does its backward (its backward is skipped).
  std::vector<bool> backward_fused;
  /// The leaky ReLU whose backward its backward applies (it then reads its own output).
  std::vector<std::optional<float>> leaky_relu_before;
  /// The reader after whose input exchange its output is let go (every reader copies it); -1:
  /// kept for the step.
  std::vector<int> release_after;
  /// The reader whose halo window holds its output (it writes there, reads it and its gradient
  /// there in backward, and the exchanges run in place: no copy of its tile either way); -1: none.
  std::vector<int> output_in_window;
  /// A convolution's: the max pooling whose backward its backward-weights does (rows of
  /// kPooledRowWindows or more), reading that pooling's gradient, maxima and (through the leaky
  /// ReLU between them) output instead of its own output gradient, which nothing then writes;
  /// -1: none. The pooling's backward (and the activation's, fused into it) is skipped.
  std::vector<int> gradient_from_pooling;
  /// A max pooling's: the convolution that does both its passes (gradient_from_pooling), pooling
  /// its output rows as it makes them, so that neither the convolution's output nor the
  /// activation's in place over it is ever written; -1: none. The pooling's forward and backward
  /// (and the activation's, fused into the convolution and the pooling) are skipped.
  std::vector<int> pooled_by;
  /// Where every tensor of the step lives.
  TransientArena arena;
};

/// Per layer: whether it runs in place wherever it reads its input as produced: it can, and it
/// is the only reader of its one input, another layer's output that the loss does not read.
std::vector<bool> in_place_candidates(const std::vector<std::vector<int>>& inputs,
                                      const std::vector<LayerTraits>& traits, int output);

/// Per layer: whether it writes its output into its reader's halo window wherever that window
/// holds its tile (StepLayer::copy_holds_tile) and the arena allows (plan_step): it can
/// (LayerTraits::writes_into_window, StepOptions::outputs_into_windows), the activations are
/// fp32, and its one reader, which reads nothing else, is not the loss.
std::vector<bool> window_writer_candidates(const std::vector<std::vector<int>>& inputs,
                                           const std::vector<LayerTraits>& traits, int output,
                                           const StepOptions& options, bool bf16_activations);

/// Per layer, what plan_step fuses wherever the layers involved read their inputs as produced and
/// none of them is split by channel: `forward`, a leaky ReLU running in place whose producer's
/// kernels apply its slope (its forward is skipped); `backward`, one whose one reader, reading
/// nothing else, does its backward (its backward is skipped); `reader`, that reader (else -1);
/// `pooled_by`, see there.
struct FusionCandidates {
  std::vector<bool> forward, backward;
  std::vector<int> reader;
  /// A max pooling's (StepPlan::pooled_by): the convolution that can do both its passes
  /// (LayerTraits::pools_in_pairs, reads_pooled_gradient, StepOptions::pooled_gradients): it reads
  /// only the model's input and is read by the pooling alone, directly or through a leaky ReLU
  /// whose backward the pooling does (`backward`); -1: none.
  std::vector<int> pooled_by;
};
FusionCandidates fusion_candidates(const std::vector<std::vector<int>>& inputs, const std::vector<LayerTraits>& traits,
                                   int output, const StepOptions& options);

StepPlan plan_step(const StepGraph& graph, const StepOptions& options);

/// Whether backward computes the gradient of what a layer reads from `producer` (an index into
/// the step's layers; negative: the model's input, which has none). A layer reading only the
/// model's input (a network's first layer) computes its parameter gradients alone.
inline bool input_has_gradient(int producer) { return producer >= 0; }

/// Whether a layer's halo exchange may overlap its forward: it computes output regions, is split
/// spatially and not by channel, and reads the model's input (`producer` null) or the tiles of a
/// producer split as itself (no filter split).
bool halo_overlap_candidate(const LayerTraits& traits, const LayerSplit& split, const LayerSplit* producer);

}  // namespace tessera
