// The exchanges of a batch size: per layer, what moves its producers' tiles to the boxes it reads
// (halo exchanges, redistributions, channel splits' partial sums), which halos overlap compute,
// and the step plan of its tensors.
#include <limits>

#include "tessera/core/error.hpp"
#include "tessera/parallel/tile_geometry.hpp"
#include "tessera/tensor/grid.hpp"
#include "tessera/train/executor.hpp"

namespace tessera {

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
    const LayerSplit* held = producer == Model::kModelInput ? nullptr : &placement_[static_cast<std::size_t>(producer)].split;
    if (!exchange || !overlaps(*exchange) || !halo_overlap_candidate(nodes[i].layer->traits(), placement_[i].split, held))
      continue;
    // Ready before the halos: the own block with all its samples and channels (a second reader of
    // the model's input may read other samples than the input layer's), and whatever lies outside
    // the global input (padding, filled at start).
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

namespace {

/// Whether an exchange's needed box has the samples and channels of its held box (differs in
/// spatial extents only: a halo window).
bool same_samples_and_channels(const TileExchange& exchange) {
  const Box& held = exchange.held_box();
  const Box& need = exchange.needed_box();
  for (std::size_t d = 0; d < 2 && d < held.begin.size(); ++d)
    if (held.begin[d] != need.begin[d] || held.extent[d] != need.extent[d]) return false;
  return true;
}

}  // namespace

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
    l.output_row = ex.output_extent[i].empty() ? 0 : ex.output_extent[i].back();
    ex.copy_extent[i].assign(nodes[i].inputs.size(), {});
    for (std::size_t a = 0; a < nodes[i].inputs.size(); ++a) {
      const TileExchange* exchange = ex.inputs[i][a].get();
      if (exchange) ex.copy_extent[i][a] = exchange->needed_box().extent;
      l.copies_input.push_back(exchange != nullptr);
      l.input_copy_bytes.push_back(exchange ? bytes(ex.copy_extent[i][a]) : 0);
      l.copy_holds_tile.push_back(exchange && exchange->holds_own_tile() && same_samples_and_channels(*exchange));
    }
    l.channel_split = ex.reduce[i] != nullptr;
    if (l.channel_split) ex.partial_extent[i] = partial_box(i, me, batch).extent;
    l.partial_bytes = l.channel_split ? bytes(ex.partial_extent[i]) : 0;
  }
  StepOptions options = default_step_options(!options_.device.is_host());
  options.in_place = options_.in_place;
  options.fuse = options_.fuse;
  options.fuses_zero_slope = backend_->convolution().fuses_leaky_relu(0.0f);  // what this backend does
  options.outputs_into_windows = options.outputs_into_windows && options_.in_place && options_.into_windows;
  options.pooled_gradients = options.pooled_gradients && options_.pooled_gradients;
  ex.step = plan_step(graph, options);
  // A convolution that makes its pooling's output computes its tile in one pass: no halo overlap.
  for (std::size_t k = 0; k < n; ++k)
    if (const int j = ex.step.pooled_by[k]; j >= 0) ex.overlap[static_cast<std::size_t>(j)] = HaloSplit{};
  // Where each output written into its reader's window lies in it (spatial offsets).
  ex.output_offset.assign(n, {});
  for (std::size_t j = 0; j < n; ++j) {
    const int k = ex.step.output_in_window[j];
    if (k < 0) continue;
    const TileExchange& exchange = *ex.inputs[static_cast<std::size_t>(k)][0];
    for (std::size_t d = 2; d < exchange.held_box().begin.size(); ++d)
      ex.output_offset[j].push_back(exchange.held_box().begin[d] - exchange.needed_box().begin[d]);
  }
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

}  // namespace tessera
