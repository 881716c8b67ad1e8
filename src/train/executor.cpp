// The executor's set-up: the plan checked against the model, the communicators of every layer's
// groups, the tiles and the weight blocks; and what the executor reports of its steps.
#include "tessera/train/executor.hpp"

#include <algorithm>
#include <string>

#include <unistd.h>

#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/layers/runtime.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/parallel/nccl_communicator.hpp"
#include "tessera/parallel/tile_geometry.hpp"
#include "tessera/tensor/grid.hpp"

namespace tessera {
namespace {

constexpr const char* kSpatialNames[3] = {"D", "H", "W"};


/// The node of each rank from the host names (one allgather of fixed-size names).
std::vector<int> nodes_by_host_name(Communicator& world) {
  constexpr std::size_t kName = 256;
  std::vector<char> mine(kName, '\0'), all(kName * static_cast<std::size_t>(world.size()));
  gethostname(mine.data(), kName - 1);
  world.allgather(mine.data(), all.data(), kName, DType::U8);
  std::vector<std::string> names;
  std::vector<int> node;
  for (int r = 0; r < world.size(); ++r) {
    const std::string name(all.data() + static_cast<std::size_t>(r) * kName);
    const auto it = std::find(names.begin(), names.end(), name);
    node.push_back(static_cast<int>(it - names.begin()));
    if (it == names.end()) names.push_back(name);
  }
  return node;
}

std::vector<int> nodes_in_blocks(int ranks, int per_node) {
  std::vector<int> node;
  for (int r = 0; r < ranks; ++r) node.push_back(r / per_node);
  return node;
}

/// Runs `work` while `exchange` is in flight; if it throws, finishes the exchange (its messages
/// must not outlive it: every rank runs the same layers, so the peers have started theirs) and
/// rethrows the first error.

}  // namespace

ExecutorOptions::GpuComm parse_gpu_comm(const std::string& text) {
  if (text == "auto") return ExecutorOptions::GpuComm::Automatic;
  if (text == "nccl") return ExecutorOptions::GpuComm::Nccl;
  if (text == "mpi") return ExecutorOptions::GpuComm::Mpi;
  throw InputError(fmt::format("GPU communication '{}': choose auto, nccl or mpi", text));
}

Executor::Executor(Model& model, const Plan& given_plan, std::shared_ptr<Communicator> world, ExecutorOptions options)
    : model_(model), world_(std::move(world)), options_(options), reducer_(options.reducer) {
  Plan plan;
  collectively(*world_, [&] {
    plan = given_plan.for_job(world_->size());
    replica_groups_ = world_->size() / given_plan.ranks();
    plan.validate(world_->size(), model_.plan_info(options_.global_batch));
  });
  exchange_comm_ = world_->duplicate();
  node_of_rank_ = options_.ranks_per_node > 0 ? nodes_in_blocks(world_->size(), options_.ranks_per_node)
                                              : nodes_by_host_name(*world_);
  // The ranks on each host (whatever ranks_per_node pretends): they share its caches, and a GPU
  // goes to each rank by its node-local rank among them; gathered before the checks below, which
  // may fail on some ranks only.
  const std::vector<int> hosts = options_.ranks_per_node == 0 ? node_of_rank_ : nodes_by_host_name(*world_);
  const int me_on_host = hosts[static_cast<std::size_t>(world_->rank())];
  if (options_.device.is_host())
    set_ranks_on_node(static_cast<int>(std::count(hosts.begin(), hosts.end(), me_on_host)));
  collectively(*world_, [&] {
    Device& device = options_.device;
    if (device.is_host()) {
      backend_ = make_host_backend();
      return;
    }
    const int gpus = cuda::device_count();
    if (gpus == 0) fail_input("the executor on a GPU needs one, but {}", cuda::unavailable_reason());
    if (device.index == ExecutorOptions::kNodeLocalGpu) {
      const int me = world_->rank();
      const auto local_rank = std::count(hosts.begin(), hosts.begin() + me, hosts[static_cast<std::size_t>(me)]);
      device.index = cuda::select_device_for_local_rank(static_cast<int>(local_rank));
    } else if (device.index < 0 || device.index >= gpus) {
      fail_input("the executor on {} needs that GPU, but this rank sees {} GPU(s)", device.to_string(), gpus);
    } else {
      cuda::set_device(device.index);
    }
    backend_ = make_cuda_backend(options_.cuda);
  });
  choose_gpu_comm();
  const Device device = options_.device;
  auto& nodes = model_.nodes();
  const std::size_t n = nodes.size();
  outputs_.resize(n);
  grads_.resize(n);
  partials_.resize(n);
  partial_grads_.resize(n);
  windows_.resize(n);
  window_grads_.resize(n);
  placement_.resize(n);

  bool found_input = false;
  for (std::size_t i = 0; i < n; ++i) {
    Placement& p = placement_[i];
    p.split = normalised(plan.split_for(nodes[i].layer->name()));
    p.grid = layer_grid(p.split);
    p.tiled = p.split.spatial_product() > 1;
    p.windows = nodes[i].layer->spatial_windows(nodes[i].output.spatial_dims());
    windows_[i].resize(nodes[i].inputs.size());
    window_grads_[i].resize(nodes[i].inputs.size());
    if (!found_input && std::find(nodes[i].inputs.begin(), nodes[i].inputs.end(), Model::kModelInput) !=
                            nodes[i].inputs.end()) {
      input_node_ = i;
      found_input = true;
    }
  }
  collectively(*world_, [&] {
    const auto out = static_cast<std::size_t>(model_.output_node());
    if (!placement_[out].split.sample_only())
      fail_input("plan: the output layer '{}' must be split by sample only (the loss is computed per sample), "
                 "got {}",
                 nodes[out].layer->name(), plan.split_for(nodes[out].layer->name()).to_string());
    check_halos();
  });

  // Communicators (created collectively, in the same order on every rank) and tiles.
  const int me = world_->rank();
  self_comm_ = world_->split(me, 0);
  if (options_.within_groups && replica_groups_ > 1) {
    group_comm_ = world_->split(replica_group_index(), me);
    loss_comm_ = group_comm_.get();
  } else {
    loss_comm_ = world_.get();
  }
  for (std::size_t i = 0; i < n; ++i) {
    Placement& p = placement_[i];
    const std::vector<int> replicas{kSampleAxis, kFirstSpatialAxis, kFirstSpatialAxis + 1, kFirstSpatialAxis + 2};
    p.sample_comm = group(p.grid, replicas, options_.within_groups);
    p.buffer_comm = options_.within_groups ? group(p.grid, replicas) : p.sample_comm;
    p.spatial_comm = group(p.grid, {kFirstSpatialAxis, kFirstSpatialAxis + 1, kFirstSpatialAxis + 2});
    if (p.split.channel > 1)
      p.bias_comm = group(p.grid, {kSampleAxis, kChannelAxis, kFirstSpatialAxis, kFirstSpatialAxis + 1,
                                   kFirstSpatialAxis + 2}, options_.within_groups);
    const std::vector<int> c = grid_coords(p.grid, me);
    p.model = ModelSplit{p.split.filter, c[kFilterAxis], p.split.channel, c[kChannelAxis]};
    if (!p.tiled) continue;
    const Shape& out = nodes[i].output;
    const Box box = output_box(i, me, 1);
    const Box window = input_box(i, 0, me, 1);
    const int first = nodes[i].inputs.front();
    const Shape& in = first == Model::kModelInput ? model_.input_shape(1)
                                                  : nodes[static_cast<std::size_t>(first)].output;
    for (int d = 2; d < out.rank(); ++d) {
      const auto u = static_cast<std::size_t>(d);
      p.tile.input_global.push_back(in[d]);
      p.tile.window_begin.push_back(window.begin[u]);
      p.tile.output_global.push_back(out[d]);
      p.tile.output_begin.push_back(box.begin[u]);
      p.tile.output_extent.push_back(box.extent[u]);
    }
  }

  // Model-parallel layers keep only their blocks of the weights: sliced from whole tensors already
  // initialised, or (deferred) allocated as blocks and initialised here, each block's values drawn
  // by global index, so both ways hold the 1-rank weights.
  collectively(*world_, [&] {
    for (std::size_t i = 0; i < n; ++i) nodes[i].layer->set_model_split(placement_[i].model);
    model.allocate_parameters();
    if (options.init_seed) model.init_parameters(*options.init_seed);
  });
  // Parameters, their gradients and buffers live where the layers run (before the reducer takes
  // the gradients into its buckets there).
  if (!device.is_host())
    for (auto& node : nodes) node.layer->move_to(device);

  // Register gradients in the order backward produces them (last layer first). Every block of a
  // weight is replicated over its layer's sample and spatial ranks (a channel-split layer's bias
  // over its channel ranks too).
  collectively(*world_, [&] {  // with NCCL, creates its communicators (every rank the same way)
    for (std::size_t k = n; k-- > 0;)
      for (auto* param : nodes[k].layer->parameters()) reducer_.add(param->grad, reduction_group(k, *param));
  });
  reducer_.build();
  reset_layer_profile();
}

Executor::~Executor() = default;

void Executor::choose_gpu_comm() {
  using GpuComm = ExecutorOptions::GpuComm;
  const GpuComm wanted = options_.gpu_comm;
  if (options_.device.is_host() || wanted == GpuComm::Mpi) return;
  if (wanted == GpuComm::Automatic) {
    if (world_->size() == 1) return;  // no messages between GPUs
    if (ranks_sharing_a_gpu(*world_)) return;  // NCCL cannot serve them: MPI
  }
  // Refuses, on every rank, when ranks share a GPU (naming them).
  collectively(*world_, [&] { gpu_exchange_comm_ = make_nccl_communicator(*world_); });
}

Communicator& Executor::reduction_group(std::size_t node, const Parameter& param) {
  Communicator& group = replica_group(node, param);
  if (!uses_nccl() || group.size() == 1) return group;
  // Every rank reaches this for the same parameters in the same order, and the groups of one
  // layer partition the ranks (the same partition on every rank, so either every rank has its
  // twin already or none has): the split is collective over all ranks, as the MPI one was.
  auto& twin = gpu_groups_[&group];
  if (!twin) twin = gpu_exchange_comm_->split(group_colors_.at(&group), world_->rank());
  return *twin;
}

Communicator* Executor::group(const std::vector<int>& grid, const std::vector<int>& axes, bool within) {
  // The partition of all ranks into groups, the same vector on every rank: the key of the cache,
  // so that every rank creates the same communicators in the same order.
  const int size = world_->size();
  std::vector<int> colors(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) {
    std::vector<int> c = grid_coords(grid, r);
    for (int a : axes) c[static_cast<std::size_t>(a)] = 0;
    colors[static_cast<std::size_t>(r)] =
        grid_rank(grid, c) + (within ? size * replica_place(r, size, replica_groups_).group : 0);
  }
  const int me = world_->rank();
  const int color = colors[static_cast<std::size_t>(me)];
  if (std::count(colors.begin(), colors.end(), color) == 1) return nullptr;
  auto& slot = groups_[colors];
  if (!slot) {
    bool spans_groups = false;
    for (int r = 0; r < size; ++r)
      spans_groups = spans_groups || (colors[static_cast<std::size_t>(r)] == color &&
                                      replica_place(r, size, replica_groups_).group != replica_group_index());
    slot = world_->split(color, me);
    if (spans_groups) slot = delayed(std::move(slot), options_.cross_group_delay);
    group_colors_[slot.get()] = color;
  }
  return slot.get();
}

Communicator& Executor::group_or_self(Communicator* group) { return group ? *group : *self_comm_; }

Communicator& Executor::replica_group(std::size_t node, const Parameter& param) {
  const Placement& p = placement_[node];
  return group_or_self(param.replicated_over_channels ? p.bias_comm : p.sample_comm);
}

Communicator& Executor::buffer_group(std::size_t node) { return group_or_self(placement_[node].buffer_comm); }

void Executor::check_halos() const {
  // A tiled layer reads halos from its direct neighbours only: each window must lie within the
  // blocks of the neighbouring ranks (of the layer's own split of its input) and the padding.
  const auto& nodes = model_.nodes();
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const Placement& p = placement_[i];
    if (!p.tiled) continue;
    const int producer = nodes[i].inputs.front();
    const Shape in = producer == Model::kModelInput ? model_.input_shape(1)
                                                    : nodes[static_cast<std::size_t>(producer)].output;
    const int dims = in.rank() - 2;
    for (int rank = 0; rank < world_->size(); ++rank) {
      const std::vector<int> c = grid_coords(p.grid, rank);
      const Box window = input_box(i, 0, rank, 1);
      for (int j = 0; j < dims; ++j) {
        const int axis = spatial_axis(j, dims);
        const int parts = p.grid[static_cast<std::size_t>(axis)];
        if (parts == 1) continue;
        const int coord = c[static_cast<std::size_t>(axis)];
        const std::int64_t extent = in[j + 2];
        const std::int64_t own_begin = block_begin(extent, parts, coord), own_end = block_begin(extent, parts, coord + 1);
        const std::int64_t lo = std::max<std::int64_t>(window.begin[static_cast<std::size_t>(j + 2)], 0);
        const std::int64_t hi = std::min(window.begin[static_cast<std::size_t>(j + 2)] +
                                             window.extent[static_cast<std::size_t>(j + 2)],
                                         extent);
        const std::int64_t reach_lo = coord > 0 ? block_begin(extent, parts, coord - 1) : 0;
        const std::int64_t reach_hi = coord + 1 < parts ? block_begin(extent, parts, coord + 2) : extent;
        if (lo < reach_lo || hi > reach_hi) {
          const std::int64_t thinnest = block_extent(extent, parts, parts - 1) < block_extent(extent, parts, 0)
                                            ? block_extent(extent, parts, parts - 1)
                                            : block_extent(extent, parts, 0);
          fail_input("layer '{}' ({}): spatial dimension {} of its input ({} positions) is cut into {} blocks as thin "
                     "as {}, but the block [{}, {}) of rank {} needs input positions [{}, {}), beyond its neighbours' "
                     "blocks: the halo is wider than a block; use fewer parts along {}",
                     nodes[i].layer->name(), nodes[i].layer->type(), kSpatialNames[3 - dims + j], extent, parts,
                     thinnest, own_begin, own_end, rank, lo, hi, kSpatialNames[3 - dims + j]);
        }
      }
    }
  }
}

std::pair<std::int64_t, std::int64_t> Executor::local_samples(std::int64_t batch_size) const {
  const Box box = data_box(world_->rank(), batch_size);
  return {box.begin[0], box.begin[0] + box.extent[0]};
}

Box Executor::input_sample_box() const {
  Box box = data_box(world_->rank(), 1);
  box.begin.erase(box.begin.begin());
  box.extent.erase(box.extent.begin());
  return box;
}

void Executor::set_watchdog(Watchdog* watchdog) {
  watchdog_ = watchdog;
  reducer_.set_watchdog(watchdog);
}

void Executor::reset_layer_profile() {
  profile_.clear();
  if (!options_.profile) return;
  for (const auto& node : model_.nodes()) profile_.push_back(LayerTiming{node.layer->name()});
}

std::int64_t Executor::activation_bytes() const { return std::max(peak_bytes_, current_bytes()); }

std::int64_t Executor::scratch_bytes() const {
  return backend_->convolution().scratch_bytes() + backend_->linear().scratch_bytes();
}

std::vector<std::string> Executor::layers_where(std::int64_t batch_size,
                                               const std::function<bool(const Exchanges&, std::size_t)>& chosen) const {
  std::vector<std::string> names;
  auto it = exchanges_.find(batch_size);
  if (it == exchanges_.end()) return names;
  for (std::size_t i = 0; i < model_.nodes().size(); ++i)
    if (chosen(it->second, i)) names.push_back(model_.nodes()[i].layer->name());
  return names;
}

std::vector<std::string> Executor::in_place_layers(std::int64_t batch_size) const {
  return layers_where(batch_size, [](const Exchanges& ex, std::size_t i) { return ex.step.in_place[i]; });
}

std::vector<std::string> Executor::fused_layers(std::int64_t batch_size) const {
  return layers_where(batch_size, [](const Exchanges& ex, std::size_t i) { return ex.step.fused[i]; });
}

std::vector<std::string> Executor::backward_fused_layers(std::int64_t batch_size) const {
  return layers_where(batch_size, [](const Exchanges& ex, std::size_t i) { return ex.step.backward_fused[i]; });
}

std::vector<std::string> Executor::window_output_layers(std::int64_t batch_size) const {
  return layers_where(batch_size, [](const Exchanges& ex, std::size_t i) { return ex.step.output_in_window[i] >= 0; });
}

std::vector<std::string> Executor::pooled_gradient_layers(std::int64_t batch_size) const {
  return layers_where(batch_size,
                      [](const Exchanges& ex, std::size_t i) { return ex.step.gradient_from_pooling[i] >= 0; });
}

std::vector<std::string> Executor::bf16_kept_layers(std::int64_t batch_size) const {
  return layers_where(batch_size, [](const Exchanges& ex, std::size_t i) {
    return std::any_of(ex.step.arena.stashes.begin(), ex.step.arena.stashes.end(),
                       [i](const ArenaStash& s) { return static_cast<std::size_t>(s.layer) == i; });
  });
}

std::vector<std::string> Executor::backward_overlapped_layers(std::int64_t batch_size) const {
  return layers_where(batch_size, [](const Exchanges& ex, std::size_t i) { return ex.split_backward[i]; });
}

std::vector<std::string> Executor::overlapped_layers(std::int64_t batch_size) const {
  return layers_where(batch_size, [](const Exchanges& ex, std::size_t i) { return ex.overlap[i].interior; });
}

std::int64_t Executor::exchange_elements_per_step(std::int64_t batch_size) {
  auto it = exchanges_.find(batch_size);
  if (it == exchanges_.end()) return 0;
  std::int64_t elements = 0;
  for (const auto& node : it->second.inputs)
    for (const auto& exchange : node)
      if (exchange) elements += exchange->send_elements() + exchange->recv_elements();  // forward + reverse
  for (const auto& exchange : it->second.reduce)
    if (exchange) elements += exchange->send_elements() + exchange->recv_elements();
  return elements;
}

}  // namespace tessera
