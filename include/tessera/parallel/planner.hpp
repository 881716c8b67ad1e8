#pragma once
// The planner: a cost model of one training step under a plan, and a search for the cheapest
// plan. Pure code (no MPI, no layers): it sees a model as a PlannerGraph (what the train level's
// Model::planner_graph writes) and the machine as a Machine file, so it can plan for any rank
// count on any machine from one process.
//
// Cost of a step = sum over layers of
//   compute      forward + backward of this rank's tile: the machine file's measured time for
//                exactly this local workload with this many ranks sharing the node when
//                `tessera calibrate` cached one, else a roofline (FLOPs at the rank's share of
//                the machine's rate, or bytes at its share of the memory bandwidth for
//                element-wise layers) plus the per-call overhead;
//   exchange     moving the producer's tiles to what this layer reads (halo exchange point to
//                point when the layouts agree, else an alltoallv redistribution), forward and
//                its reverse in backward; channel splits' partial-sum reduce-scatter and
//                output-gradient gather; batch-norm statistics allreduces;
// plus the gradient allreduce of each weight block over its replica group, of which the part
// the machine's grad_overlap hides behind backward is not counted, the loss allreduce and the
// optimizer update. Memory per rank (weights, gradients, optimizer state, saved activations,
// halo windows, the largest layer's transient buffers) is a hard limit.
//
// Search: every layer's candidate splits are the factorizations of the rank count into sample x
// filter x channel x D x H x W that the layer and its shapes allow (the rules of
// Plan::validate); dynamic programming over the layers in model order with the exchange costs
// on the edges, exact on chains; on DAGs the state is the splits of the layers whose outputs
// are still to be read (PaSE's frontier), exact unless more than `max_states` states arise, in
// which case the cheapest are kept (the result says so). The memory limit is met by a
// Lagrangian penalty on memory raised until the plan fits.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/core/precision.hpp"
#include "tessera/parallel/halo_overlap_mode.hpp"
#include "tessera/parallel/machine.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/step_plan.hpp"
#include "tessera/parallel/tile_geometry.hpp"
#include "tessera/tensor/shape.hpp"

namespace tessera {

/// What the planner knows of one layer.
struct PlannerLayer {
  std::string name;
  std::string type;
  /// Producers (indices into PlannerGraph::layers); -1: the model's input.
  std::vector<int> inputs;
  Shape output;  ///< global, dimension 0 = the global batch
  Shape input;   ///< global shape of the first input
  /// Forward FLOPs of the whole batch: 2 x multiply-adds for conv and linear; for the others
  /// 0 (they are costed by the bytes they move).
  double forward_flops = 0;
  /// Elements of the whole weight tensors (weights and biases, gamma and beta).
  std::int64_t parameters = 0;
  /// conv and linear: `parameters` includes a bias of output[1] elements besides the weights.
  bool has_bias = false;
  /// One entry per spatial dimension of the output (empty: no spatial dimensions).
  std::vector<SpatialWindow> windows;
  bool spatially_splittable = false;
  bool model_splittable = false;
  bool filter_splittable = false;
  /// Batch norm: two allreduces of 2 x channels values per step (forward and backward).
  bool batch_norm = false;
  /// What the step plan may do with it (Layer::traits): run in place, fuse, let inputs go.
  LayerTraits traits;
  /// conv and linear: fp32, or bf16 operands (priced at the machine's bf16_flops, plus the passes
  /// that round the operands).
  Precision precision = Precision::F32;
  /// Keys kernel timings: "<model>/<layer>", "<model>/<layer>@bf16" for bf16 operands.
  std::string signature;
};

struct PlannerGraph {
  std::string model;
  std::vector<PlannerLayer> layers;  ///< in model order (topological)
  int output = -1;                   ///< the layer whose output the loss reads
  std::int64_t batch = 0;            ///< global batch the shapes are for
  /// The activations that backward reads are kept in bf16 (Model::activation_precision).
  bool bf16_activations = false;
  std::vector<PlanLayerInfo> plan_info() const;
  /// Per layer, what it reads and its traits: what the step plan's rules take (step_plan.hpp).
  std::vector<std::vector<int>> inputs() const;
  std::vector<LayerTraits> traits() const;
};

/// One rank's work in one layer under one split: what `tessera calibrate` times and the cost
/// model looks up.
struct Workload {
  int layer = 0;
  std::int64_t samples = 0;                 ///< local samples (the largest block)
  std::vector<std::int64_t> output_extent;  ///< local output extents per spatial dimension
  int filter_parts = 1, channel_parts = 1;
  int threads = 1;
  /// Ranks sharing the node while it runs (each with `threads` threads): the timing under that
  /// contention is what the key stands for.
  int ranks_on_node = 1;
  /// The key of this workload in Machine::kernels.
  std::string key(const PlannerGraph& graph) const;
};

struct PlannerOptions {
  int ranks = 1;
  /// Optimizer state elements per weight element: 1 (SGD with momentum), 2 (Adam, AdamW).
  int optimizer_state = 1;
  /// On GPU machines with bf16 tensor cores (bf16_flops), bf16 convolutions as the executor runs
  /// them: Native (false: bf16 buffers, 2 bytes an element of scratch, the bf16 rate) or Exact
  /// (true: rounded fp32 copies, 4 bytes, as the host; TF32 tensor cores, half the bf16 rate).
  bool exact_bf16_convolutions = false;
  /// The job's --halo-overlap: a convolution whose halo exchange overlaps its forward keeps
  /// copies of its largest boundary region's input and output (overlap_region_bytes).
  HaloOverlap halo_overlap = HaloOverlap::Automatic;
  /// Producers write their outputs into their readers' halo windows where the step plan keeps
  /// them (the executor's default on the host); false: as an executor with
  /// ExecutorOptions::into_windows off runs, where the windows' arena would not fit a rank.
  bool outputs_into_windows = true;
  bool allow_spatial = true;
  bool allow_model = true;
  bool allow_sample = true;
  /// Bound of the DAG search's state count (chains never reach it).
  std::int64_t max_states = 200000;
};

/// The predicted cost of one layer under its split (seconds per training step, bytes per rank).
struct LayerEstimate {
  std::string name;
  LayerSplit split;
  double compute = 0;
  bool measured = false;    ///< compute from a calibrated timing (else the roofline)
  double exchange = 0;      ///< halo exchange / redistribution of its inputs, forward + backward
  double model_comm = 0;    ///< channel-split reduce-scatter + gather, batch-norm statistics
  double grad_allreduce = 0;  ///< allreduce of its weight gradient blocks (before overlap)
  double optimizer = 0;       ///< the optimizer's update of its weight blocks
  /// Bytes per rank of the layer on its own: weights, gradients, optimizer state, output and input
  /// copy (a plan's total counts each tensor once, see CostModel::activation_bytes).
  double memory = 0;
  double output_bytes = 0;  ///< its output block (the largest rank's)
  double partial_bytes = 0; ///< split by channel: its partial sum of the filter block (else 0)
  double input_bytes = 0;   ///< its input as a copy would hold it (window with halo, or block)
  bool halo = false;        ///< split spatially with a window larger than its block
  bool gathers = false;     ///< reads more (filter split) or other (channel split) channels than its producer holds
  /// Machine::sync_wait_share of its compute: a descheduled peer is late by that much at the next
  /// blocking exchange after it (0 where its largest tile has cores of its own).
  double wait = 0;
  /// bf16 operands: bytes of its rounded input, output gradient and weights. The backend keeps one
  /// scratch buffer per operand for its convolutions and another for its linear layers, each as
  /// large as the largest layer's, so a plan adds each one's maximum over the layers of its kind.
  double scratch_input = 0, scratch_output = 0, scratch_weights = 0;
  bool scratch_of_linear = false;  ///< whose buffers: the linear layers' (else the convolutions')
  /// A leaky ReLU the step plan may fuse (fusion_candidates): the seconds of its forward that its
  /// producer's kernels take over, and of its backward its reader's. `compute` leaves them out;
  /// estimate() adds back what the step plan does not fuse, the search prices them on the edges
  /// that decide it (CostModel::unfused_seconds).
  double fused_forward = 0, fused_backward = 0;
  /// A max pooling whose forward and backward the convolution it reads may do (FusionCandidates::
  /// pooled_by): the seconds that saves, left out of `compute` the same way (the search puts them
  /// back where the pooling's own input is copied).
  double by_convolution = 0;
  double total() const { return compute + exchange + model_comm + wait; }
};

struct PlanEstimate {
  std::vector<LayerEstimate> layers;
  double compute = 0, exchange = 0, model_comm = 0;
  double wait = 0;            ///< waits for late peers (the layers' LayerEstimate::wait)
  double grad_allreduce = 0;  ///< all of it
  double grad_exposed = 0;    ///< what backward does not hide
  double other = 0;           ///< loss allreduce, optimizer update, the machine's step overhead
  double step_seconds = 0;
  double memory_bytes = 0;    ///< peak per rank
  double scratch_bytes = 0;   ///< of which the bf16 operands' scratch (what Executor::scratch_bytes measures)
  bool fits = true;           ///< memory_bytes <= machine.memory_per_rank
  /// False where the plan fits the rank only with no output written into a halo window (the
  /// windows may grow the arena a little): priced so, and the executor must run so
  /// (ExecutorOptions::into_windows off).
  bool outputs_into_windows = true;
};

class CostModel {
 public:
  /// Keeps references to `graph` and `machine`, which must not change while it lives (it caches
  /// exchange costs).
  CostModel(const PlannerGraph& graph, const Machine& machine, PlannerOptions options);

  /// The estimate of a whole plan (validated against the graph first: InputError when it does not
  /// fit). Where the plan does not fit the rank's memory with outputs written into halo windows
  /// but fits without them, the estimate without them (PlanEstimate::outputs_into_windows);
  /// where it fits neither way, the one that needs less.
  PlanEstimate estimate(const Plan& plan) const;
  /// The candidate splits of layer `layer` (see the search above).
  std::vector<LayerSplit> candidates(int layer) const;
  /// Cost of layer `layer` under `split` with its inputs already where it reads them.
  LayerEstimate layer_cost(int layer, const LayerSplit& split) const;
  /// Seconds (forward + backward) to move the output of `producer` under `held` to what
  /// `consumer` reads under `split` (0 when nothing moves; the model's input: 0, read from the file);
  /// with the producer's tile written into the consumer's window where into_window says it may
  /// be (`windows` false: never; estimate() asks the step plan).
  double exchange_cost(int producer, const LayerSplit& held, int consumer, const LayerSplit& split,
                       bool windows = true) const;
  /// Bytes per rank of a plan's activations as the executor holds them: each tensor once (a
  /// layer's output, or its consumers' copies where every consumer copies it), every layer's
  /// output gradient, and the largest input copy's gradient in flight.
  double activation_bytes(const PlanEstimate& estimate, const StepPlan* step = nullptr) const;
  /// The step plan of an estimate's largest tiles, as the executor would make it.
  StepPlan step_plan(const PlanEstimate& estimate) const;
  /// Bytes of the copies a convolution `consumer` under `split` keeps when its halo exchange from
  /// `producer` (held under `held`; < 0: the model's input) overlaps its forward on some rank, as
  /// the executor decides under options.halo_overlap: its largest boundary region's input and
  /// output (Layer::workspace_bytes); 0 where no rank overlaps.
  double overlap_region_bytes(int producer, const LayerSplit& held, int consumer, const LayerSplit& split) const;
  /// Whether `consumer` under `split` (its estimate `e`) keeps a copy of what it reads from
  /// `producer` held under `held` (producer < 0: the model's input, read from the file): a window
  /// with halos, another split (a redistribution), a gather of channels.
  bool copies_input(int producer, const LayerSplit& held, int consumer, const LayerSplit& split,
                    const LayerEstimate& e) const;
  /// Whether `producer` (held under `held_split`) writes its tile into `consumer`'s halo window
  /// under `split` (StepPlan::output_in_window): its exchange then copies only what others hold.
  bool into_window(int producer, const LayerSplit& held_split, int consumer, const LayerSplit& split) const;
  /// Whether that copy, where it makes one, is a halo window holding the producer's whole tile
  /// (StepLayer::copy_holds_tile).
  bool window_holds_tile(int producer, const LayerSplit& held, int consumer, const LayerSplit& split) const;
  /// Whether `layer` under `split` computes partial sums that an exchange sums (a conv or linear
  /// layer split by channel: StepLayer::channel_split).
  bool channel_split(int layer, const LayerSplit& split) const;
  /// Whether `consumer` under `split` reads more (filter split) or other (channel split) channels
  /// than its producer holds (LayerEstimate::gathers).
  bool gathers_channels(int consumer, const LayerSplit& split) const;
  /// The step plan's options as the executor sets them on this machine's devices.
  StepOptions step_options() const;
  /// Bytes of `consumer`'s copy of its input `input` (estimate `e`): LayerEstimate::input_bytes,
  /// the first input's, scaled by that input's channels (a concat's inputs differ in width).
  double input_copy_bytes(int consumer, std::size_t input, const LayerEstimate& e) const;
  /// Seconds of fused work (LayerEstimate::fused_forward, fused_backward) that a step runs after
  /// all because `consumer` under `split` (estimate `consumed`) reads `producer` under `held`
  /// (estimate `produced`; < 0: the model's input) through a copy, or one of them is split by
  /// channel: the search prices them on this edge. A layer that copies its input and is read
  /// through a copy is priced its backward twice (never the cheaper plan: two exchanges around
  /// an element-wise layer); estimate() prices what the step plan does.
  double unfused_seconds(int producer, const LayerSplit& held, const LayerEstimate& produced, int consumer,
                         const LayerSplit& split, const LayerEstimate& consumed) const;
  /// Whether `layer` runs in place (no output or gradient of its own) wherever it reads its input
  /// as produced (copies_input false): in_place_candidates of the step plan.
  bool may_run_in_place(int layer) const { return may_run_in_place_.at(static_cast<std::size_t>(layer)); }
  /// The local workload of `layer` under `split`.
  Workload workload(int layer, const LayerSplit& split) const;
  /// The step-level terms given the per-layer ones (gradient overlap, loss, optimizer); `step`:
  /// the estimate's step plan when the caller has it.
  void finish(PlanEstimate& estimate, const StepPlan* step = nullptr) const;
  /// Bytes per rank of a plan given its layers' estimates (in layer order): weights, gradients and
  /// optimizer state, activation_bytes, the bf16 scratch (also into *scratch_bytes when given).
  double memory_bytes(const PlanEstimate& estimate, double* scratch_bytes = nullptr, const StepPlan* step = nullptr) const;

  const PlannerGraph& graph() const { return graph_; }
  const Machine& machine() const { return machine_; }
  const PlannerOptions& options() const { return options_; }

 private:
  /// A bf16 convolution on a GPU machine with bf16 tensor cores (bf16_flops set): Native or Exact
  /// as options().exact_bf16_convolutions says.
  bool gpu_bf16_convolution(const PlannerLayer& layer) const;
  /// Such a convolution run Exact: on TF32 tensor cores, at half the bf16 rate.
  bool exact_on_tf32(const PlannerLayer& layer) const;

  const PlannerGraph& graph_;
  const Machine& machine_;
  PlannerOptions options_;
  /// The machine's costs within a node at this job's rank count (Machine::intra_for).
  CommLevel intra_;
  std::vector<bool> may_run_in_place_;
  /// What the step plan may fuse (its fusion_candidates with step_options()).
  FusionCandidates fusion_;
  /// Per layer: it may write its output into its one reader's halo window (the step plan also
  /// weighs the arena: priced as if it always did).
  std::vector<bool> may_write_into_window_;
  /// The estimate as options() say (estimate() tries without windows too).
  PlanEstimate estimate_as_set(const Plan& plan) const;
  /// The same model with no outputs written into halo windows (made when first needed).
  mutable std::unique_ptr<CostModel> without_windows_;
  /// overlap_region_bytes by (consumer, producer, split, held split): it looks at every rank,
  /// and the memory descents ask again and again.
  mutable std::map<std::vector<int>, double> overlap_cache_;
  /// exchange_cost by what it depends on (the tensor's shape, both splits, the consumer's windows
  /// and output): a network's repeated blocks ask the same question at every repetition.
  mutable std::map<std::vector<std::int64_t>, double> exchange_cache_;
  double exchange_cost_uncached(int producer, const LayerSplit& held, int consumer, const LayerSplit& split,
                                bool in_window) const;
};

struct PlanResult {
  Plan plan;
  PlanEstimate estimate;
  double search_seconds = 0;
  std::int64_t candidates = 0;  ///< candidate splits over all layers
  std::int64_t states = 0;      ///< DP states visited
  bool exact = true;            ///< false when the DAG search had to drop states
  double memory_penalty = 0;    ///< the Lagrangian weight that made it fit (0: none needed)
  /// Set by choose_plan when it preferred a pure plan ("pure batch", ...) to the search's optimum,
  /// whose predicted step is then `optimum_seconds`.
  std::string simpler_choice;
  double optimum_seconds = 0;
};

/// The cheapest plan for `options.ranks` ranks. InputError when no plan fits the machine's memory.
PlanResult plan_search(const PlannerGraph& graph, const Machine& machine, const PlannerOptions& options);

/// The commands' choice: the search's optimum, unless a pure plan (batch, spatial or model;
/// fitting in memory) is predicted within `margin` of it (a fraction of its step time). Then that
/// pure plan (pure batch if it is one of them, else the cheapest): its fewer exchanges expose it less to what the cost model does not see (waits for
/// slower or descheduled ranks, kernel-timing noise); the planner's median error measured on this
/// project's machines is ~10 %, the commands' default margin. `margin` 0 gives the optimum.
PlanResult choose_plan(const PlannerGraph& graph, const Machine& machine, const PlannerOptions& options,
                       double margin);

/// The plans --explain compares with: every layer split by sample (as far as the batch goes);
/// every splittable layer split spatially (the rest by sample); every model-splittable layer by
/// filter (the rest by sample). Empty when the rank count does not allow it.
std::vector<std::pair<std::string, Plan>> reference_plans(const CostModel& model);

/// Every distinct local workload the search can consider at `options.ranks` ranks (for calibrate).
std::vector<Workload> all_workloads(const CostModel& model);

/// A table of the estimate, one row per layer.
std::string format_estimate(const PlanEstimate& estimate);

}  // namespace tessera
