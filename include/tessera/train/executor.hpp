#pragma once
// Runs a model under a plan: each rank computes its tile of every layer (tile_geometry.hpp) and
// carries out the step plan of its tensors (step_plan.hpp); TileExchanges move halos,
// redistributions and channel splits' partial sums, and the GradReducer sums weight gradients
// while backward continues. How a plan runs: parallel/README.md.
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/layers/dnn_backend.hpp"
#include "tessera/layers/layer.hpp"
#include "tessera/parallel/delayed_communicator.hpp"
#include "tessera/parallel/grad_reducer.hpp"
#include "tessera/parallel/step_plan.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/tile_exchange.hpp"
#include "tessera/tensor/box.hpp"
#include "tessera/train/halo_overlap.hpp"
#include "tessera/train/model.hpp"

namespace tessera {

struct ExecutorOptions {
  std::int64_t global_batch = 64;
  std::uint64_t seed = 0;
  /// Initialises the parameters with this seed after the split, on the host (Model::init_parameters:
  /// each rank draws only its blocks): what a model parsed without allocating its weights needs.
  /// Every parameter is initialised again, also on a second executor over a trained model.
  std::optional<std::uint64_t> init_seed;
  GradReducerOptions reducer;
  /// Whether spatially split layers compute while their halos travel (see halo_overlap.hpp).
  HaloOverlap halo_overlap = HaloOverlap::Automatic;
  /// Which ranks share a node, for HaloOverlap::Automatic: 0 from the host names (gathered once);
  /// N: consecutive blocks of N ranks (launchers that place ranks so, and tests).
  int ranks_per_node = 0;
  /// Where the layers run: the host (oneDNN), or a GPU (cuDNN, cuBLAS and Tessera's CUDA
  /// kernels): Device::cuda(i), or Device::cuda(kNodeLocalGpu): GPU (node-local rank mod the GPUs
  /// the rank sees). On a GPU the executor moves the model's parameters there; train_step and
  /// evaluate take inputs and targets on the host or on that GPU (host ones are copied over), and
  /// the optimizer updates them there. Halo exchanges, redistributions and the gradient
  /// allreduce of GPU tensors travel as `gpu_comm` says.
  Device device = Device::host();
  static constexpr int kNodeLocalGpu = -1;
  /// How messages between GPUs travel (device on a GPU; ignored on the host):
  ///   Automatic: NCCL when there are two ranks or more and each has a GPU of its own (compared
  ///     by UUID), else MPI through host copies (ranks that share a GPU, which NCCL cannot serve);
  ///   Nccl: NCCL, straight between GPUs on their communication streams (the gradient allreduce
  ///     and the exchanges overlap the compute queued after them); refused when ranks share a GPU;
  ///   Mpi: MPI, each packed message and gradient bucket copied through host memory.
  /// MPI stays for control either way (the loss and the plan checks, batch-norm statistics).
  enum class GpuComm { Automatic, Nccl, Mpi };
  GpuComm gpu_comm = GpuComm::Automatic;
  /// The CUDA backend's options (device on a GPU): TF32 for fp32, how bf16 convolutions run
  /// (Bf16Convolutions::Native by default: bf16 tensor cores, bf16 results), the workspace limit.
  CudaBackendOptions cuda;
  /// Layers run in place where the step plan lets them (StepOptions::in_place), and on the host
  /// producers write into their reader's halo window where it lets them (StepOptions::
  /// outputs_into_windows). False: every layer keeps an output and a gradient of its own, to
  /// check that this changes nothing but memory.
  bool in_place = true;
  /// With in_place: producers write into their reader's halo window where they can. False: to
  /// measure what that saves (the window's copy of the tile, and of its gradient).
  bool into_windows = true;
  /// Leaky ReLUs running in place fuse into their producer's forward and their reader's backward
  /// where the step plan lets them (StepOptions::fuse). False: to measure what fusing saves.
  bool fuse = true;
  /// With fuse: a convolution of the model's input does the backward of the max pooling that reads
  /// it where the step plan lets it (StepOptions::pooled_gradients). False: to measure what that saves.
  bool pooled_gradients = true;
  /// Time every layer of every training step (Executor::layer_profile). Costs a clock read per
  /// layer on the host; on a GPU it also waits for each layer's kernels, which slows the step.
  bool profile = false;
  /// Replica groups (a job of a multiple of the plan's ranks): sum gradients, batch-norm
  /// statistics and the training loss within each group only, for the synchronization modes in
  /// which a Synchronizer carries what crosses groups (Synchronizer::within_groups); false (bsp):
  /// over all groups every step.
  bool within_groups = false;
  /// A testing aid: every collective of a training step that spans replica groups takes this much
  /// longer (--inject-comm-delay; delayed_communicator.hpp).
  CommDelay cross_group_delay;
  /// Fills each of a training step's tensors with NaNs as soon as its lifetime in the arena ends
  /// (step_plan.hpp), so that a layer reading a tensor the arena let go computes NaNs. For tests.
  bool poison_dead_tensors = false;
};

/// "auto", "nccl" or "mpi" (command-line spellings of ExecutorOptions::GpuComm); an InputError otherwise.
ExecutorOptions::GpuComm parse_gpu_comm(const std::string& text);

/// Sums over the whole batch (all ranks).
struct BatchResult {
  double loss_sum = 0;       ///< sum of the per-sample losses
  std::int64_t correct = 0;  ///< correctly classified samples (-1: not a classifier)
  std::int64_t samples = 0;
  /// Seconds this rank waited for communication that backward could not hide (gradient
  /// reductions still running after backward, and the loss reduction). With NCCL between GPUs
  /// (uses_nccl()) it also counts the GPU finishing backward, which the host waits for there.
  double comm_wait_seconds = 0;
  /// Seconds this rank spent in halo exchanges and redistributions (forward and backward),
  /// packing and waiting included: the exchange time the step exposes (what overlaps a layer's
  /// compute is not counted). Host time: with NCCL between GPUs (uses_nccl()) it counts packing
  /// and queuing; the transfers themselves run on the communication stream.
  double exchange_seconds = 0;
  /// The part of exchange_seconds spent in halo exchanges (an input split as its producer's
  /// output, or as the data is read, grown by the layer's halo); the rest is redistributions
  /// between differing splits and channel-split layers' partial sums.
  double halo_seconds = 0;
  double mean_loss() const { return samples ? loss_sum / static_cast<double>(samples) : 0.0; }
};

/// Where a layer's training steps went (ExecutorOptions::profile), summed over the steps timed.
struct LayerTiming {
  std::string name;
  double forward_seconds = 0;   ///< the layer's forward, its input exchanges included
  double backward_seconds = 0;  ///< its backward, the exchanges of its input gradients included
  double exchange_seconds = 0;  ///< of both: halo exchanges, redistributions, partial sums (exposed)
  double cpu_seconds = 0;       ///< the CPU time of both, all the rank's threads (less where ranks share cores)
};

class Executor {
 public:
  /// Checks the plan against the model and the job (collectively: every rank fails together). A
  /// job of a multiple of the plan's ranks runs it as replica groups (Plan::for_job), each group
  /// a block of every batch's samples, every gradient summed over all groups every step.
  Executor(Model& model, const Plan& plan, std::shared_ptr<Communicator> world, ExecutorOptions options);
  ~Executor();

  /// The samples [begin, end) of a batch of `batch_size` whose inputs this rank reads (the input
  /// layer's sample block); train_step and evaluate take the inputs and targets of these samples.
  std::pair<std::int64_t, std::int64_t> local_samples(std::int64_t batch_size) const;
  /// Where the layers run (ExecutorOptions::device).
  Device device() const { return options_.device; }
  /// How many replica groups run the plan (1: the job's ranks are the plan's).
  int replica_groups() const { return replica_groups_; }
  /// Whether gradients, batch-norm statistics and the training loss are summed within each replica
  /// group only (ExecutorOptions::within_groups).
  bool within_groups() const { return options_.within_groups; }
  /// This rank's replica group (ranks [g P, (g + 1) P) of a plan of P ranks form group g).
  int replica_group_index() const { return replica_place(world_->rank(), world_->size(), replica_groups_).group; }
  /// The kernels the layers run on (its implementations(), how bf16 convolutions ran).
  const DnnBackend& backend() const { return *backend_; }
  /// Whether messages between this job's GPUs go over NCCL (ExecutorOptions::gpu_comm).
  bool uses_nccl() const { return gpu_exchange_comm_ != nullptr; }
  /// Per layer (model order), this rank's time in the training steps since the executor was made or
  /// the profile reset; empty unless ExecutorOptions::profile.
  const std::vector<LayerTiming>& layer_profile() const { return profile_; }
  void reset_layer_profile();
  /// The part of each sample this rank reads: a box over C, (D), H, W (the whole sample unless
  /// the input layer is split spatially).
  Box input_sample_box() const;

  /// Forward, loss, backward and gradient reduction for one batch. `inputs`: this rank's samples
  /// (local_samples) restricted to input_sample_box(); `targets`: the same samples' targets.
  /// `step` keys the dropout masks. Gradients are left in the model's parameters, reduced.
  BatchResult train_step(const Tensor& inputs, const Tensor& targets, std::int64_t batch_size, std::int64_t step);
  /// Forward and loss only (inference mode), summed over all ranks (every group's samples).
  BatchResult evaluate(const Tensor& inputs, const Tensor& targets, std::int64_t batch_size);

  /// Averages the layers' non-trainable state (batch-norm running statistics) over the ranks, so
  /// that every rank evaluates the same model. With local batch-norm statistics each sample
  /// group's running averages differ; with global ones this changes nothing but rounding.
  void average_buffers();

  Communicator& world() { return *world_; }
  const GradReducer& reducer() const { return reducer_; }
  /// Names the blocking points of a step (gradient and loss allreduces) to `watchdog` (null: none).
  void set_watchdog(Watchdog* watchdog);
  Watchdog* watchdog() const { return watchdog_; }
  /// The most bytes of activations, their gradients, halo windows and the layers' own buffers
  /// (Layer::workspace_bytes: pooling maxima, dropout scales) this rank held at once during the
  /// last training step.
  std::int64_t activation_bytes() const;
  /// Bytes the layers' kernels keep between calls on this rank (the rounded operands of bf16
  /// convolutions and linear layers: each kind's largest input, output gradient and weights), as
  /// the training steps since the last evaluate() made them (evaluate lets its own go).
  std::int64_t scratch_bytes() const;
  /// Elements this rank sends per training step in halo exchanges, redistributions and the
  /// reductions of channel-split layers' partial sums (forward and backward) for a batch of
  /// `batch_size` (0 before its first step).
  std::int64_t exchange_elements_per_step(std::int64_t batch_size);
  /// The layers whose halo exchange overlaps their forward on this rank (halo_overlap.hpp), for
  /// a batch of `batch_size` (empty before its first step).
  std::vector<std::string> overlapped_layers(std::int64_t batch_size) const;
  /// The layers that run in place over their input (StepPlan::in_place) for a batch of
  /// `batch_size` (empty before its first step).
  std::vector<std::string> in_place_layers(std::int64_t batch_size) const;
  /// The layers running in place whose forward their producer does, in the same pass (a
  /// convolution's leaky ReLU), for a batch of `batch_size` (empty before its first step).
  std::vector<std::string> fused_layers(std::int64_t batch_size) const;
  /// The layers running in place whose backward their reader does, in the same pass (a leaky
  /// ReLU before max pooling whose windows do not overlap), for a batch of `batch_size`.
  std::vector<std::string> backward_fused_layers(std::int64_t batch_size) const;
  /// The layers that write their output into their reader's halo window (StepPlan::
  /// output_in_window) for a batch of `batch_size` (empty before its first step).
  std::vector<std::string> window_output_layers(std::int64_t batch_size) const;
  /// The convolutions that do the forward and backward of the max pooling reading them (StepPlan::
  /// gradient_from_pooling, pooled_by) for a batch of `batch_size` (empty before its first step).
  std::vector<std::string> pooled_gradient_layers(std::int64_t batch_size) const;
  /// The layers whose output, or a copy of whose inputs, a training step keeps in bf16 between
  /// forward and backward (Model::activation_precision, ArenaStash) for a batch of `batch_size`
  /// (empty before its first step, for fp32 activations, and where the copies would not make the
  /// arena smaller).
  std::vector<std::string> bf16_kept_layers(std::int64_t batch_size) const;
  /// The layers whose input exchange's reverse overlaps their parameter gradients in backward,
  /// for a batch of `batch_size` (empty before its first step): the same on every rank.
  std::vector<std::string> backward_overlapped_layers(std::int64_t batch_size) const;
  /// The communicator over which parameter `param` of layer `node`'s gradient is summed: the
  /// ranks that hold the same block of it (within this rank's replica group under
  /// ExecutorOptions::within_groups; size 1: none).
  Communicator& replica_group(std::size_t node, const Parameter& param);
  /// The ranks that hold the same block of layer `node`'s buffers (batch-norm running
  /// statistics): all ranks unless the layer is split by filter (over every replica group).
  Communicator& buffer_group(std::size_t node);

 private:
  /// Where one layer runs on this rank.
  struct Placement {
    LayerSplit split;            ///< spatial normalised to three entries (D, H, W)
    std::vector<int> grid;       ///< [sample, filter, channel, D, H, W]
    bool tiled = false;          ///< split spatially: runs on SpatialTiles
    std::vector<SpatialWindow> windows;  ///< what its outputs read along each spatial dimension
    SpatialTile tile;            ///< this rank's tile (when tiled)
    Communicator* sample_comm = nullptr;   ///< replica group of the weights: sample x spatial
    /// The same ranks over every replica group (sample_comm's whole extent without within_groups).
    Communicator* buffer_comm = nullptr;
    Communicator* spatial_comm = nullptr;  ///< spatial tiles of the same samples
    /// Model parallelism: this rank's filter and channel blocks (none: whole layer).
    ModelSplit model;
    /// Replica group of a channel-split layer's bias: sample x spatial x channel.
    Communicator* bias_comm = nullptr;
  };
  /// The exchanges of one batch size: per node and input (null: the producer's tile is exactly
  /// what the layer reads), and the targets' move from the input layer's samples to the output's.
  struct Exchanges {
    std::vector<std::vector<std::unique_ptr<TileExchange>>> inputs;
    /// Per node and input: whether its exchange is a halo exchange (the input split as its
    /// producer's output) rather than a redistribution.
    std::vector<std::vector<bool>> halo;
    std::unique_ptr<TileExchange> targets;
    /// Per node split by channel: the exchange whose reverse sums the layer's partial outputs
    /// (over its sample x filter block x tile, the same on every rank of the channel group) into
    /// the output tiles, each rank one channel sub-block (a reduce-scatter); its forward gathers
    /// the output gradient back to the partial box. Null when the layer is not split by channel.
    std::vector<std::unique_ptr<TileExchange>> reduce;
    /// Per node: its one input's halo exchange overlaps its forward (interior set): the output
    /// regions to recompute once the halos arrived.
    std::vector<HaloSplit> overlap;
    /// Per node: whether its one input's exchange overlaps backward (overlaps(), agreed by every
    /// rank: any rank's answer).
    std::vector<bool> overlapping;
    /// Per node: the exchange whose reverse runs while the layer's parameter gradients are
    /// computed (see split_backward), or null.
    std::vector<TileExchange*> split_backward;
    /// What the step does with each layer's tensors (in place, fused, released, the arena).
    StepPlan step;
    /// Extents of the step's tensors: per node its output's (and its gradient's), per node and
    /// input its copy's (exchanged inputs only), per channel-split node its partial sums'.
    std::vector<std::vector<std::int64_t>> output_extent, partial_extent;
    std::vector<std::vector<std::vector<std::int64_t>>> copy_extent;
    /// Per node whose output its reader's window holds (StepPlan::output_in_window): where in
    /// that window (spatial offsets; LayerContext::output_offset); else empty.
    std::vector<std::vector<std::int64_t>> output_offset;
  };

  /// The tile of node `node`'s output that `rank` computes, for a batch of `batch`.
  Box output_box(std::size_t node, int rank, std::int64_t batch) const;
  /// The box of node `node`'s output a channel-split layer computes a partial sum of on `rank`.
  Box partial_box(std::size_t node, int rank, std::int64_t batch) const;
  /// The box of input `input` of node `node` that `rank` reads (its tile plus halos).
  Box input_box(std::size_t node, std::size_t input, int rank, std::int64_t batch) const;
  /// The tile of the model's input that `rank` reads from the data.
  Box data_box(int rank, std::int64_t batch) const;
  /// The communicator of the ranks that differ from this one only along `axes` of `grid` (and,
  /// with `within`, in the same replica group); null when no other rank does. One that spans
  /// replica groups is delayed by ExecutorOptions::cross_group_delay.
  Communicator* group(const std::vector<int>& grid, const std::vector<int>& axes, bool within = false);
  Communicator& group_or_self(Communicator* group);
  void check_halos() const;
  std::int64_t current_bytes() const;
  Exchanges& exchanges(std::int64_t batch, const Tensor& targets);
  /// Lays out a training step's tensors for a batch of `batch` (Exchanges::arena; at the end of
  /// exchanges()).
  void lay_out_transients(Exchanges& ex, std::int64_t batch) const;
  /// Points every output, copy, partial sum and gradient at its place in arena_ for a step of
  /// Exchanges `ex`: training grows the arena if need be; evaluation (`grow` false), whose
  /// batches may be larger, uses it where the layout fits and else lets forward allocate (and
  /// evaluate() let go) its own.
  void place_transients(const Exchanges& ex, bool grow);
  /// A view of `extent` at `buffer` of the arena laid out as `arena` (none for kNone).
  Tensor arena_view(const TransientArena& arena, std::size_t buffer, const std::vector<std::int64_t>& extent);
  /// Before step `time` of a training step (TransientArena: forward i at i, the loss at n,
  /// backward k at 2n - k): the bf16 copies of what forward read for the last time at step
  /// time - 1 (ArenaStash), the widening of those whose first backward read is now (their views
  /// then point at the widened tensors), and, with ExecutorOptions::poison_dead_tensors, NaNs into
  /// the buffers that died since step time - 1 began.
  void begin_time(const Exchanges& ex, int time);
  /// The names of the layers `chosen` picks from the exchanges of a batch of `batch_size` (none
  /// before its first step).
  std::vector<std::string> layers_where(std::int64_t batch_size,
                                        const std::function<bool(const Exchanges&, std::size_t)>& chosen) const;
  /// Whether halo overlap applies to `exchange` on this rank under the options (Automatic: a
  /// peer on another node). Exchanges::overlapping holds the answer every rank agreed on.
  bool overlaps(const TileExchange& exchange) const;
  /// The exchange of node `node`'s one input when its backward splits around the exchange's
  /// reverse (point to point, a layer that splits_backward, Exchanges::overlapping); else null.
  TileExchange* split_backward(const Exchanges& ex, std::size_t node) const;
  LayerContext context(std::size_t node, std::int64_t batch_size, std::int64_t step, bool training);
  void forward(const Tensor& inputs, Exchanges& ex, std::int64_t batch_size, std::int64_t step, bool training);
  /// Sums a batch's results over `comm`'s ranks.
  BatchResult reduce(Communicator& comm, double loss_sum, std::int64_t correct, std::int64_t samples, const char* label);
  /// The ranks of this rank's replica group (the world without within_groups).
  Communicator* loss_comm_ = nullptr;
  /// This rank's targets for the output layer's samples.
  const Tensor& output_targets(const Tensor& targets, Exchanges& ex);

  Model& model_;
  std::shared_ptr<Communicator> world_;
  /// A duplicate of the world for exchanges, so their messages never meet anything else.
  std::unique_ptr<Communicator> exchange_comm_;
  /// With NCCL (uses_nccl()): its communicator of all ranks, for the exchanges, and one per
  /// gradient replica group of more than one rank (keyed by that group's MPI communicator), split
  /// from it.
  std::unique_ptr<Communicator> gpu_exchange_comm_;
  std::map<const Communicator*, std::unique_ptr<Communicator>> gpu_groups_;
  /// This rank's color in the split that made each group of groups_.
  std::map<const Communicator*, int> group_colors_;
  /// The communicator the exchanges run on.
  Communicator& exchange_communicator() { return uses_nccl() ? *gpu_exchange_comm_ : *exchange_comm_; }
  /// The communicator the gradient reducer sums parameter `param` of layer `node` over: its
  /// replica group, or with NCCL that group's NCCL twin (split here, collectively over all ranks).
  Communicator& reduction_group(std::size_t node, const Parameter& param);
  /// Decides ExecutorOptions::gpu_comm (collectively) and creates the NCCL communicator of all ranks.
  void choose_gpu_comm();
  ExecutorOptions options_;
  std::unique_ptr<DnnBackend> backend_;
  GradReducer reducer_;
  std::vector<Placement> placement_;
  /// The node that reads the model's input (decides which tile of the data each rank reads).
  std::size_t input_node_ = 0;
  std::map<std::vector<int>, std::unique_ptr<Communicator>> groups_;
  std::map<std::int64_t, Exchanges> exchanges_;
  /// A training step's tensors (outputs, the copies of inputs read through exchanges, partial
  /// sums, every gradient) are views into this one buffer, laid out by their lifetimes
  /// (Exchanges::arena); kept from step to step, grown as needed.
  Tensor arena_;
  /// Per node: its output (shared along a chain of layers running in place) and its gradient.
  std::vector<Tensor> outputs_, grads_;
  /// Per node split by channel: its partial output and that output's gradient.
  std::vector<Tensor> partials_, partial_grads_;
  std::unique_ptr<Communicator> self_comm_;
  /// The ranks of this rank's replica group (ExecutorOptions::within_groups with two groups or more).
  std::unique_ptr<Communicator> group_comm_;
  /// The node of every rank (indices in order of first appearance).
  std::vector<int> node_of_rank_;
  /// Per node and input: the box the layer reads (when exchanged) and its gradient.
  std::vector<std::vector<Tensor>> windows_, window_grads_;
  Tensor targets_;
  /// Host inputs and targets copied to the executor's GPU.
  Tensor staged_inputs_, staged_targets_;
  /// `given` when it is on the executor's device, else its copy there in `staging`.
  const Tensor& on_device(const Tensor& given, Tensor& staging) const;
  double exchange_seconds_ = 0;
  double halo_seconds_ = 0;
  std::vector<LayerTiming> profile_;
  /// The layer whose exchanges count_exchange adds to profile_ (profiling training steps only).
  LayerTiming* profiled_ = nullptr;
  /// Adds the time since its start to `seconds` when it ends (at any exit of a layer's step).
  class LayerTimer;
  /// Adds the seconds since `start` to the exchange time (and to the halo time when `halo`).
  void count_exchange(std::chrono::steady_clock::time_point start, bool halo);
  std::int64_t peak_bytes_ = 0;
  int replica_groups_ = 1;
  Watchdog* watchdog_ = nullptr;
};

}  // namespace tessera
