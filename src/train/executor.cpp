#include "tessera/train/executor.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <unordered_set>

#include <unistd.h>

#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/parallel/nccl_communicator.hpp"
#include "tessera/parallel/tile_geometry.hpp"
#include "tessera/parallel/watchdog.hpp"
#include "tessera/tensor/proc_grid.hpp"

namespace tessera {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kSpatialNames[3] = {"D", "H", "W"};
/// A node index no layer has: evaluation's forward is not profiled.
constexpr std::size_t kNotProfiled = static_cast<std::size_t>(-1);

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
template <typename Work>
void finishing_on_error(TileExchange& exchange, const Work& work) {
  try {
    work();
  } catch (...) {
    try {
      exchange.finish_pending();
    } catch (...) {
    }
    throw;
  }
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

ExecutorOptions::GpuComm parse_gpu_comm(const std::string& text) {
  if (text == "auto") return ExecutorOptions::GpuComm::Automatic;
  if (text == "nccl") return ExecutorOptions::GpuComm::Nccl;
  if (text == "mpi") return ExecutorOptions::GpuComm::Mpi;
  throw InputError(fmt::format("GPU communication '{}': choose auto, nccl or mpi", text));
}

Executor::Executor(Model& model, const Plan& plan, std::shared_ptr<Communicator> world, ExecutorOptions options)
    : model_(model), world_(std::move(world)), options_(options), reducer_(options.reducer) {
  collectively(*world_, [&] { plan.validate(world_->size(), model_.plan_info(options_.global_batch)); });
  exchange_comm_ = world_->duplicate();
  node_of_rank_ = options_.ranks_per_node > 0 ? nodes_in_blocks(world_->size(), options_.ranks_per_node)
                                              : nodes_by_host_name(*world_);
  // A GPU per rank by its node-local rank among the ranks on its host (whatever ranks_per_node
  // pretends); gathered before the checks below, which may fail on some ranks only.
  const std::vector<int> hosts = options_.device.is_host() || options_.ranks_per_node == 0
                                     ? node_of_rank_
                                     : nodes_by_host_name(*world_);
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
  for (std::size_t i = 0; i < n; ++i) {
    Placement& p = placement_[i];
    p.sample_comm = group(p.grid, {kSampleAxis, kFirstSpatialAxis, kFirstSpatialAxis + 1, kFirstSpatialAxis + 2});
    p.spatial_comm = group(p.grid, {kFirstSpatialAxis, kFirstSpatialAxis + 1, kFirstSpatialAxis + 2});
    if (p.split.channel > 1)
      p.bias_comm = group(p.grid, {kSampleAxis, kChannelAxis, kFirstSpatialAxis, kFirstSpatialAxis + 1,
                                   kFirstSpatialAxis + 2});
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

  // Model-parallel layers keep only their blocks of the weights (sliced from the whole, already
  // initialised tensors; init_parameters draws a block's values by global index).
  collectively(*world_, [&] {
    for (std::size_t i = 0; i < n; ++i) nodes[i].layer->set_model_split(placement_[i].model);
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

Communicator* Executor::group(const std::vector<int>& grid, const std::vector<int>& axes) {
  // The partition of all ranks into groups, the same vector on every rank: the key of the cache,
  // so that every rank creates the same communicators in the same order.
  const int size = world_->size();
  std::vector<int> colors(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) {
    std::vector<int> c = grid_coords(grid, r);
    for (int a : axes) c[static_cast<std::size_t>(a)] = 0;
    colors[static_cast<std::size_t>(r)] = grid_rank(grid, c);
  }
  const int me = world_->rank();
  if (std::count(colors.begin(), colors.end(), colors[static_cast<std::size_t>(me)]) == 1) return nullptr;
  auto& slot = groups_[colors];
  if (!slot) {
    slot = world_->split(colors[static_cast<std::size_t>(me)], me);
    group_colors_[slot.get()] = colors[static_cast<std::size_t>(me)];
  }
  return slot.get();
}

Communicator& Executor::group_or_self(Communicator* group) { return group ? *group : *self_comm_; }

Communicator& Executor::replica_group(std::size_t node, const Parameter& param) {
  const Placement& p = placement_[node];
  return group_or_self(param.replicated_over_channels ? p.bias_comm : p.sample_comm);
}

Communicator& Executor::buffer_group(std::size_t node) { return group_or_self(placement_[node].sample_comm); }

Box Executor::output_box(std::size_t node, int rank, std::int64_t batch) const {
  const Placement& p = placement_[node];
  return tessera::output_box(p.split, model_.nodes()[node].output.with(0, batch), grid_coords(p.grid, rank));
}

Box Executor::partial_box(std::size_t node, int rank, std::int64_t batch) const {
  const Placement& p = placement_[node];
  return tessera::partial_box(p.split, model_.nodes()[node].output.with(0, batch), grid_coords(p.grid, rank));
}

Box Executor::input_box(std::size_t node, std::size_t input, int rank, std::int64_t batch) const {
  const auto& n = model_.nodes()[node];
  const int producer = n.inputs[input];
  const Shape shape = producer == Model::kModelInput ? model_.input_shape(batch)
                                                     : model_.nodes()[static_cast<std::size_t>(producer)].output.with(0, batch);
  const Placement& p = placement_[node];
  return tessera::input_box(p.split, n.layer->model_splittable(), shape, n.output.with(0, batch), p.windows,
                            grid_coords(p.grid, rank));
}

Box Executor::data_box(int rank, std::int64_t batch) const {
  // The input layer's own blocks of the model's input (its halos come by exchange).
  const Placement& p = placement_[input_node_];
  return sample_spatial_block(p.split, model_.input_shape(batch), grid_coords(p.grid, rank));
}

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

Executor::Exchanges& Executor::exchanges(std::int64_t batch, const Tensor& targets) {
  auto it = exchanges_.find(batch);
  if (it != exchanges_.end()) return it->second;
  // Every rank derives every rank's boxes (pure code); the only communication is the agreement
  // on backward's overlap below (every rank builds the exchanges of a batch size in the same step).
  const auto& nodes = model_.nodes();
  const int size = world_->size();
  Exchanges ex;
  ex.inputs.resize(nodes.size());
  ex.halo.resize(nodes.size());
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    ex.inputs[i].resize(nodes[i].inputs.size());
    ex.halo[i].assign(nodes[i].inputs.size(), false);
    for (std::size_t a = 0; a < nodes[i].inputs.size(); ++a) {
      const int producer = nodes[i].inputs[a];
      const Shape global = producer == Model::kModelInput ? model_.input_shape(batch)
                                                          : nodes[static_cast<std::size_t>(producer)].output.with(0, batch);
      std::vector<Box> held, needed;
      for (int r = 0; r < size; ++r) {
        held.push_back(producer == Model::kModelInput ? data_box(r, batch)
                                                      : output_box(static_cast<std::size_t>(producer), r, batch));
        needed.push_back(input_box(i, a, r, batch));
      }
      // Same split as the producer: a halo exchange with the neighbours; otherwise a redistribution
      // (one alltoallv on small jobs, point to point with the ranks that intersect on large ones).
      const bool same = producer == Model::kModelInput
                            ? true
                            : placement_[static_cast<std::size_t>(producer)].split == placement_[i].split;
      auto exchange = std::make_unique<TileExchange>(
          exchange_communicator(), global, std::move(held), std::move(needed),
          same || size > TileExchange::kAllToAllVUpTo ? TileExchange::Transport::PointToPoint
                                                       : TileExchange::Transport::AllToAllV);
      exchange->set_device(options_.device);
      if (!exchange->is_identity()) ex.inputs[i][a] = std::move(exchange);
      ex.halo[i][a] = same;
    }
  }
  // Whether each layer's one input exchange overlaps backward, agreed by every rank (under
  // HaloOverlap::Automatic: when any rank's exchange has a peer on another node). Backward queues
  // an overlapped exchange's reverse before the layer's gradients are marked ready (which may
  // start a bucket's allreduce), the others after; NCCL runs both on one stream per GPU, in the
  // order queued, so every rank must queue them in the same order. (Forward overlap stays each
  // rank's own choice: the exchange is queued before the layer's compute either way.)
  std::vector<int> overlapping(nodes.size(), 0);
  for (std::size_t i = 0; i < nodes.size(); ++i)
    if (nodes[i].inputs.size() == 1 && ex.inputs[i][0]) overlapping[i] = overlaps(*ex.inputs[i][0]) ? 1 : 0;
  world_->allreduce(std::span<int>(overlapping), ReduceOp::Max);
  ex.overlapping.assign(overlapping.begin(), overlapping.end());
  // Halo exchanges that overlap their layer's forward.
  ex.overlap.resize(nodes.size());
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const TileExchange* exchange = nodes[i].inputs.size() == 1 ? ex.inputs[i][0].get() : nullptr;
    const int producer = nodes[i].inputs.empty() ? Model::kModelInput : nodes[i].inputs[0];
    if (!exchange || !overlaps(*exchange) || !placement_[i].tiled ||
        placement_[i].split.channel > 1 || !nodes[i].layer->traits().computes_output_regions ||
        exchange->transport() != TileExchange::Transport::PointToPoint ||
        (producer != Model::kModelInput && !(placement_[static_cast<std::size_t>(producer)].split == placement_[i].split)))
      continue;
    // Ready before the halos: the own block with all its samples and channels, and whatever lies
    // outside the global input (padding, filled at start).
    const Box& local = exchange->local_box();
    const Box& need = exchange->needed_box();
    const Shape& global = exchange->global_shape();
    if (local.numel() == 0 || local.extent[0] != need.extent[0] || local.extent[1] != need.extent[1]) continue;
    const std::size_t dims = static_cast<std::size_t>(global.rank() - 2);
    std::vector<std::int64_t> ready_begin(dims), ready_end(dims);
    for (std::size_t d = 0; d < dims; ++d) {
      const std::size_t g = d + 2;
      ready_begin[d] = local.begin[g] == 0 ? std::numeric_limits<std::int64_t>::min() : local.begin[g];
      ready_end[d] = local.begin[g] + local.extent[g] == global[static_cast<int>(g)] ? std::numeric_limits<std::int64_t>::max()
                                                                                    : local.begin[g] + local.extent[g];
    }
    const SpatialTile& tile = placement_[i].tile;
    HaloSplit split = split_at_halos(*nodes[i].layer, ready_begin, ready_end, tile.output_begin, tile.output_extent);
    if (!split.interior || split.boundary.empty() ||
        (options_.halo_overlap == HaloOverlap::Automatic && split.boundary_share > kMaxRecomputedShare))
      continue;
    ex.overlap[i] = std::move(split);
  }
  // Channel-split layers: their partial sums are reduce-scattered into the output tiles.
  ex.reduce.resize(nodes.size());
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (placement_[i].split.channel == 1) continue;
    std::vector<Box> held, needed;
    for (int r = 0; r < size; ++r) {
      held.push_back(output_box(i, r, batch));
      needed.push_back(partial_box(i, r, batch));
    }
    ex.reduce[i] = std::make_unique<TileExchange>(exchange_communicator(), nodes[i].output.with(0, batch), std::move(held),
                                                  std::move(needed), TileExchange::Transport::PointToPoint);
    ex.reduce[i]->set_device(options_.device);
  }
  ex.split_backward.resize(nodes.size());
  for (std::size_t i = 0; i < nodes.size(); ++i) ex.split_backward[i] = split_backward(ex, i);
  // Targets: read with the input layer's samples, needed with the output layer's.
  const auto out = static_cast<std::size_t>(model_.output_node());
  Shape target_shape = targets.shape().with(0, batch);
  std::vector<Box> held, needed;
  for (int r = 0; r < size; ++r) {
    Box h = data_box(r, batch), o = output_box(out, r, batch);
    Box th, tn;
    th.begin.assign(static_cast<std::size_t>(target_shape.rank()), 0);
    th.extent = target_shape.dims();
    tn = th;
    th.begin[0] = h.begin[0];
    th.extent[0] = h.extent[0];
    tn.begin[0] = o.begin[0];
    tn.extent[0] = o.extent[0];
    held.push_back(th);
    needed.push_back(tn);
  }
  auto exchange = std::make_unique<TileExchange>(exchange_communicator(), target_shape, std::move(held), std::move(needed),
                                                 TileExchange::Transport::AllToAllV);
  exchange->set_device(options_.device);
  if (!exchange->is_identity()) ex.targets = std::move(exchange);
  lay_out_transients(ex, batch);
  return exchanges_.emplace(batch, std::move(ex)).first->second;
}

void Executor::lay_out_transients(Exchanges& ex, std::int64_t batch) const {
  const auto& nodes = model_.nodes();
  const std::size_t n = nodes.size();
  const int me = world_->rank();
  const auto bytes = [](const std::vector<std::int64_t>& extent) {
    std::int64_t elements = 1;
    for (std::int64_t e : extent) elements *= e;
    return elements * static_cast<std::int64_t>(sizeof(float));
  };
  StepGraph graph;
  graph.output = model_.output_node();
  graph.bf16_activations = model_.activation_precision() == Precision::BF16;
  ex.output_extent.resize(n);
  ex.partial_extent.assign(n, {});
  ex.copy_extent.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    StepLayer& l = graph.layers.emplace_back();
    l.inputs = nodes[i].inputs;
    l.traits = nodes[i].layer->traits();
    ex.output_extent[i] = output_box(i, me, batch).extent;
    l.output_bytes = bytes(ex.output_extent[i]);
    ex.copy_extent[i].assign(nodes[i].inputs.size(), {});
    for (std::size_t a = 0; a < nodes[i].inputs.size(); ++a) {
      const TileExchange* exchange = ex.inputs[i][a].get();
      if (exchange) ex.copy_extent[i][a] = exchange->needed_box().extent;
      l.copies_input.push_back(exchange != nullptr);
      l.input_copy_bytes.push_back(exchange ? bytes(ex.copy_extent[i][a]) : 0);
    }
    l.channel_split = ex.reduce[i] != nullptr;
    if (l.channel_split) ex.partial_extent[i] = partial_box(i, me, batch).extent;
    l.partial_bytes = l.channel_split ? bytes(ex.partial_extent[i]) : 0;
  }
  StepOptions options;
  options.in_place = options_.in_place;
  options.fuse = options_.fuse;
  options.fuses_zero_slope = backend_->convolution().fuses_leaky_relu(0.0f);
  ex.step = plan_step(graph, options);
}

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
    outputs_[i] = view(arena.output[i], ex.output_extent[i]);
    grads_[i] = view(arena.output_grad[i], ex.output_extent[i]);
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

bool Executor::overlaps(const TileExchange& exchange) const {
  // On a GPU as on the host: the exchange packs and fills the local part at start (queued on the
  // GPU's stream), so the interior computes while the messages travel.
  if (options_.halo_overlap != HaloOverlap::Automatic) return options_.halo_overlap == HaloOverlap::Always;
  const int me = node_of_rank_[static_cast<std::size_t>(world_->rank())];
  for (int peer : exchange.peer_ranks())
    if (node_of_rank_[static_cast<std::size_t>(peer)] != me) return true;
  return false;
}

TileExchange* Executor::split_backward(const Exchanges& ex, std::size_t node) const {
  const auto& n = model_.nodes()[node];
  if (options_.halo_overlap == HaloOverlap::Never || n.inputs.size() != 1 || n.inputs[0] == Model::kModelInput ||
      ex.reduce[node] || !n.layer->traits().splits_backward)
    return nullptr;
  TileExchange* exchange = ex.inputs[node][0].get();
  return exchange && exchange->transport() == TileExchange::Transport::PointToPoint && ex.overlapping[node] ? exchange
                                                                                                         : nullptr;
}

LayerContext Executor::context(std::size_t node, std::int64_t batch_size, std::int64_t step, bool training) {
  const Placement& p = placement_[node];
  LayerContext ctx;
  ctx.backend = backend_.get();
  ctx.sample_comm = p.sample_comm;
  ctx.spatial_comm = p.spatial_comm;
  ctx.tile = p.tiled ? &p.tile : nullptr;
  ctx.sample_offset = block_begin(batch_size, p.split.sample, grid_coords(p.grid, world_->rank())[kSampleAxis]);
  ctx.global_batch = batch_size;
  ctx.seed = options_.seed;
  ctx.step = step;
  ctx.training = training;
  return ctx;
}

class Executor::LayerTimer {
 public:
  /// Times layer `node`'s forward (or backward) into the profile when `executor` profiles.
  LayerTimer(Executor& executor, std::size_t node, bool forward) : executor_(executor) {
    if (node >= executor.profile_.size()) return;  // not profiling, or kNotProfiled
    LayerTiming& timing = executor.profile_[node];
    seconds_ = forward ? &timing.forward_seconds : &timing.backward_seconds;
    executor.profiled_ = &timing;
    start_ = Clock::now();
  }
  ~LayerTimer() {
    if (!seconds_) return;
    if (!executor_.options_.device.is_host()) {
      try {
        cuda::synchronize();  // the layer's kernels, not only their launches
      } catch (...) {
      }
    }
    *seconds_ += seconds_since(start_);
    executor_.profiled_ = nullptr;
  }
  LayerTimer(const LayerTimer&) = delete;
  LayerTimer& operator=(const LayerTimer&) = delete;

 private:
  Executor& executor_;
  double* seconds_ = nullptr;
  Clock::time_point start_;
};

void Executor::forward(const Tensor& inputs, Exchanges& ex, std::int64_t batch_size, std::int64_t step,
                       bool training) {
  const auto [begin, end] = local_samples(batch_size);
  TESSERA_CHECK(inputs.dim(0) == end - begin, "Executor: {} local samples given, the plan gives this rank {}",
                inputs.dim(0), end - begin);
  auto& nodes = model_.nodes();
  std::vector<const Tensor*> in;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (training) begin_time(ex, static_cast<int>(i));
    const LayerTimer timer(*this, training ? i : kNotProfiled, /*forward=*/true);
    in.clear();
    const bool overlap = ex.overlap[i].interior;
    for (std::size_t a = 0; a < nodes[i].inputs.size(); ++a) {
      const int j = nodes[i].inputs[a];
      const Tensor* source = j == Model::kModelInput ? &inputs : &outputs_[static_cast<std::size_t>(j)];
      if (TileExchange* exchange = ex.inputs[i][a].get()) {
        const auto start = Clock::now();
        if (overlap)
          exchange->start_forward(*source, windows_[i][a]);  // finished after the interior
        else
          exchange->forward(*source, windows_[i][a]);
        count_exchange(start, ex.halo[i][a]);
        source = &windows_[i][a];
      }
      in.push_back(source);
    }
    // A producer whose every consumer has copied what it reads is not needed any more (backward
    // reads the copies): release it, so a split layer holds its tile once, not twice.
    for (std::size_t a = 0; a < nodes[i].inputs.size(); ++a) {
      const int j = nodes[i].inputs[a];
      if (j != Model::kModelInput && ex.step.release_after[static_cast<std::size_t>(j)] == static_cast<int>(i)) outputs_[static_cast<std::size_t>(j)] = Tensor();
    }
    // Its output is its input, overwritten (Layer::runs_in_place; in the arena, the same view).
    if (ex.step.in_place[i]) outputs_[i] = outputs_[static_cast<std::size_t>(nodes[i].inputs[0])];
    if (ex.step.fused[i]) continue;  // its producer computed its output
    LayerContext ctx = context(i, batch_size, step, training);
    ctx.leaky_relu_after = ex.step.leaky_relu_after[i];
    if (TileExchange* reduce = ex.reduce[i].get()) {
      // A partial sum over this rank's input channels: summed over the channel group into the
      // output tiles (backward never reads a layer's output, so the partial sum goes).
      nodes[i].layer->forward(in, partials_[i], ctx);
      peak_bytes_ = std::max(peak_bytes_, current_bytes());
      const auto start = Clock::now();
      reduce->reverse(partials_[i], outputs_[i]);
      count_exchange(start, /*halo=*/false);
      peak_bytes_ = std::max(peak_bytes_, current_bytes());
      partials_[i] = Tensor();
      continue;
    }
    if (!overlap) {
      nodes[i].layer->forward(in, outputs_[i], ctx);
    } else {
      TileExchange& exchange = *ex.inputs[i][0];
      finishing_on_error(exchange, [&] { nodes[i].layer->forward(in, outputs_[i], ctx); });
      // The interior is right; the boundary read halos that had not arrived: recompute it.
      const auto start = Clock::now();
      exchange.finish_forward();
      count_exchange(start, /*halo=*/true);
      for (const OutputRegion& region : ex.overlap[i].boundary)
        nodes[i].layer->forward_region(in, outputs_[i], ctx, region.begin, region.extent);
    }
    peak_bytes_ = std::max(peak_bytes_, current_bytes());
  }
}

const Tensor& Executor::output_targets(const Tensor& targets, Exchanges& ex) {
  if (!ex.targets) return targets;
  ex.targets->forward(targets, targets_);
  return targets_;
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

void Executor::count_exchange(Clock::time_point start, bool halo) {
  const double seconds = seconds_since(start);
  exchange_seconds_ += seconds;
  if (halo) halo_seconds_ += seconds;
  if (profiled_) profiled_->exchange_seconds += seconds;
}

void Executor::reset_layer_profile() {
  profile_.clear();
  if (!options_.profile) return;
  for (const auto& node : model_.nodes()) profile_.push_back(LayerTiming{node.layer->name()});
}

const Tensor& Executor::on_device(const Tensor& given, Tensor& staging) const {
  if (given.device() == options_.device) return given;
  staging.resize(given.shape(), options_.device);
  staging.copy_from(given);
  return staging;
}

BatchResult Executor::train_step(const Tensor& given_inputs, const Tensor& given_targets, std::int64_t batch_size,
                                 std::int64_t step) {
  const Tensor& inputs = on_device(given_inputs, staged_inputs_);
  const Tensor& targets = on_device(given_targets, staged_targets_);
  const WatchdogScope step_scope(watchdog_, "forward/backward (halo exchanges and batch-norm statistics are there)");
  exchange_seconds_ = 0;
  halo_seconds_ = 0;
  peak_bytes_ = 0;
  Exchanges& ex = exchanges(batch_size, targets);
  place_transients(ex, /*grow=*/true);
  forward(inputs, ex, batch_size, step, /*training=*/true);

  auto& nodes = model_.nodes();
  const auto out = static_cast<std::size_t>(model_.output_node());
  const Tensor& local_targets = output_targets(targets, ex);
  LayerContext loss_ctx = context(out, batch_size, step, /*training=*/true);
  begin_time(ex, static_cast<int>(nodes.size()));
  const double loss_sum = model_.loss().forward_backward(outputs_[out], local_targets, grads_[out], loss_ctx);
  const std::int64_t correct = model_.loss().correct(outputs_[out], local_targets);

  // Backward in reverse order. A node's output gradient is complete once every consumer ran
  // (consumers come later in the list); the first writer overwrites, later ones accumulate.
  std::vector<bool> has_grad(nodes.size(), false);
  has_grad[out] = true;
  std::vector<const Tensor*> in;
  std::vector<Tensor*> grad_in;
  std::vector<Tensor> extra;
  for (std::size_t k = nodes.size(); k-- > 0;) {
    begin_time(ex, static_cast<int>(2 * nodes.size() - k));
    const LayerTimer timer(*this, k, /*forward=*/false);
    auto& node = nodes[k];
    in.clear();
    grad_in.clear();
    extra.assign(node.inputs.size(), Tensor());
    for (std::size_t a = 0; a < node.inputs.size(); ++a) {
      // (A layer running in place finds its input's gradient in its output gradient's place:
      // the arena gives a chain of them one buffer.)
      const int j = node.inputs[a];
      const bool exchanged = ex.inputs[k][a] != nullptr;
      in.push_back(exchanged ? &windows_[k][a] : j == Model::kModelInput ? &inputs : &outputs_[static_cast<std::size_t>(j)]);
      if (j == Model::kModelInput) {
        grad_in.push_back(nullptr);
      } else if (exchanged) {
        grad_in.push_back(&window_grads_[k][a]);
      } else if (!has_grad[static_cast<std::size_t>(j)] &&
                 std::find(grad_in.begin(), grad_in.end(), &grads_[static_cast<std::size_t>(j)]) == grad_in.end()) {
        // (a layer reading the same producer twice writes its first gradient here, the second
        // into `extra`, summed below)
        grad_in.push_back(&grads_[static_cast<std::size_t>(j)]);
      } else {
        grad_in.push_back(&extra[a]);
      }
    }
    if (!has_grad[k]) fail("Executor: layer '{}' got no gradient", node.layer->name());
    if (ex.step.backward_fused[k]) {
      // Its reader applied its factor: the output gradient is its input gradient (in place).
      has_grad[static_cast<std::size_t>(node.inputs[0])] = true;
      continue;
    }
    LayerContext ctx = context(k, batch_size, step, /*training=*/true);
    ctx.leaky_relu_before = ex.step.leaky_relu_before[k];
    if (TileExchange* reduce = ex.reduce[k].get()) {
      // The gradient of a partial sum is the output gradient over the whole partial box.
      const auto start = Clock::now();
      reduce->forward(grads_[k], partial_grads_[k]);
      count_exchange(start, /*halo=*/false);
      node.layer->backward(in, partials_[k], partial_grads_[k], grad_in, ctx);
      peak_bytes_ = std::max(peak_bytes_, current_bytes());
    } else if (TileExchange* exchange = ex.split_backward[k]) {
      // The halo gradients travel to their owners while the parameter gradients are computed.
      node.layer->backward_inputs(in, grads_[k], grad_in, ctx);
      peak_bytes_ = std::max(peak_bytes_, current_bytes());
      const auto uj = static_cast<std::size_t>(node.inputs[0]);
      auto start = Clock::now();
      exchange->start_reverse(window_grads_[k][0], grads_[uj], /*accumulate=*/has_grad[uj]);
      count_exchange(start, ex.halo[k][0]);
      finishing_on_error(*exchange, [&] { node.layer->backward_parameters(in, grads_[k], ctx); });
      for (auto* p : node.layer->parameters()) reducer_.ready(p->grad);
      start = Clock::now();
      exchange->finish_reverse();
      count_exchange(start, ex.halo[k][0]);
      peak_bytes_ = std::max(peak_bytes_, current_bytes());
      has_grad[uj] = true;
      continue;
    } else {
      node.layer->backward(in, outputs_[k], grads_[k], grad_in, ctx);
      peak_bytes_ = std::max(peak_bytes_, current_bytes());
    }
    for (auto* p : node.layer->parameters()) reducer_.ready(p->grad);
    for (std::size_t a = 0; a < node.inputs.size(); ++a) {
      const int j = node.inputs[a];
      if (j == Model::kModelInput) continue;
      const auto uj = static_cast<std::size_t>(j);
      if (TileExchange* exchange = ex.inputs[k][a].get()) {
        // Halo gradients go back to their owners and are summed there.
        const auto start = Clock::now();
        exchange->reverse(window_grads_[k][a], grads_[uj], /*accumulate=*/has_grad[uj]);
        count_exchange(start, ex.halo[k][a]);
        peak_bytes_ = std::max(peak_bytes_, current_bytes());
      } else if (has_grad[uj] && grad_in[a] == &extra[a]) {
        backend_->elementwise().accumulate(extra[a].data(), grads_[uj].data(), grads_[uj].numel());
      }
      has_grad[uj] = true;
    }
  }
  const auto wait_start = Clock::now();
  reducer_.finish();
  if (uses_nccl()) {
    // NCCL's requests only make the GPU's compute wait: wait here for backward and the gradient
    // allreduce, so that a hung NCCL operation shows under its name (the watchdog) in this step.
    const WatchdogScope scope(watchdog_, "gradient allreduce (NCCL, with the rest of backward on the GPU)");
    cuda::synchronize();
  }
  BatchResult result = reduce(loss_sum, correct, outputs_[out].dim(0), "loss allreduce");
  result.comm_wait_seconds = seconds_since(wait_start);
  result.exchange_seconds = exchange_seconds_;
  result.halo_seconds = halo_seconds_;
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

BatchResult Executor::evaluate(const Tensor& given_inputs, const Tensor& given_targets, std::int64_t batch_size) {
  const Tensor& inputs = on_device(given_inputs, staged_inputs_);
  const Tensor& targets = on_device(given_targets, staged_targets_);
  exchange_seconds_ = 0;
  halo_seconds_ = 0;
  Exchanges& ex = exchanges(batch_size, targets);
  place_transients(ex, /*grow=*/false);  // in training's arena where it fits
  forward(inputs, ex, batch_size, /*step=*/0, /*training=*/false);
  const auto out = static_cast<std::size_t>(model_.output_node());
  const Tensor& local_targets = output_targets(targets, ex);
  const std::int64_t local = outputs_[out].dim(0);
  const double loss_sum = local > 0 ? model_.loss().forward(outputs_[out], local_targets) : 0.0;
  const std::int64_t correct = local > 0 ? model_.loss().correct(outputs_[out], local_targets) : 0;
  BatchResult result = reduce(loss_sum, correct, local, "validation (loss allreduce)");
  result.exchange_seconds = exchange_seconds_;
  result.halo_seconds = halo_seconds_;
  // Evaluation batches may be larger than training's: the tensors it allocated outside the arena
  // and its bf16 operands' scratch are let go, so that training keeps what the planner counted
  // (the next step makes its own scratch again).
  const auto outside_arena = [&](Tensor& t) {
    if (t.buffer_id() != arena_.buffer_id()) t = Tensor();
  };
  for (std::size_t i = 0; i < outputs_.size(); ++i) {
    outside_arena(outputs_[i]);
    outside_arena(partials_[i]);
    for (Tensor& t : windows_[i]) outside_arena(t);
  }
  backend_->convolution().release_scratch();
  backend_->linear().release_scratch();
  return result;
}

void Executor::average_buffers() {
  if (world_->size() == 1) return;
  const WatchdogScope scope(watchdog_, "averaging batch-norm statistics over the ranks");
  // Ranks holding tiles of the same samples have equal statistics, and every sample group has
  // as many ranks, so the average over the ranks holding the same block of the buffers (all
  // ranks unless the layer is split by filter) is the average over the sample groups.
  auto& nodes = model_.nodes();
  for (std::size_t k = 0; k < nodes.size(); ++k) {
    Communicator& group = buffer_group(k);
    if (group.size() == 1) continue;
    const float scale = 1.0f / static_cast<float>(group.size());
    for (Tensor* buffer : nodes[k].layer->buffers()) {
      Tensor host = buffer->to(Device::host());  // the buffer itself on the host, else a copy
      group.allreduce(host.data(), static_cast<std::size_t>(host.numel()), DType::F32, ReduceOp::Sum);
      float* b = host.data();
      for (std::int64_t i = 0; i < host.numel(); ++i) b[i] *= scale;
      if (!buffer->device().is_host()) buffer->copy_from(host);
    }
  }
}

std::int64_t Executor::activation_bytes() const { return std::max(peak_bytes_, current_bytes()); }

std::int64_t Executor::scratch_bytes() const {
  return backend_->convolution().scratch_bytes() + backend_->linear().scratch_bytes();
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
