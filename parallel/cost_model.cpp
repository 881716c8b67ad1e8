// The planner's cost model: what one training step costs a rank under a plan (see planner.hpp).
// The tiles and exchanges it prices are those the executor builds (src/train/executor.cpp): every
// layer's grid is [sample, filter, channel, D, H, W] in row-major rank order, outputs are held as
// sample x (filter block, cut again by channel rank) x spatial blocks, and a layer reads its
// sample block, its channel block (channel split), its filter block (a point-wise layer split by
// filter) or all channels, and the window of its spatial tile.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "tessera/core/error.hpp"
#include "tessera/parallel/planner.hpp"
#include "tessera/parallel/tile_geometry.hpp"
#include "tessera/parallel/tile_exchange.hpp"
#include "tessera/parallel/transient_arena.hpp"
#include "tessera/tensor/box.hpp"
#include "tessera/tensor/grid.hpp"

namespace tessera {
namespace {

constexpr double kBytes = 4;  // fp32
/// Up to this many source tiles per rank an exchange is priced message by message (each on or
/// off the node); above, in aggregate.
constexpr double kListSources = 64;

/// A split's spatial parts, one per spatial dimension of a tensor with `dims` of them.
std::vector<int> spatial_parts(const LayerSplit& split, int dims) {
  const std::vector<int> grid = layer_grid(split);
  std::vector<int> parts;
  for (int j = 0; j < dims; ++j) parts.push_back(grid[static_cast<std::size_t>(spatial_axis(j, dims))]);
  return parts;
}

struct Interval {
  std::int64_t begin = 0, end = 0;
  std::int64_t size() const { return std::max<std::int64_t>(0, end - begin); }
};

Interval intersect(Interval a, Interval b) { return {std::max(a.begin, b.begin), std::min(a.end, b.end)}; }

Interval block(std::int64_t extent, int parts, int part) {
  const std::int64_t b = block_begin(extent, parts, part);
  return {b, b + block_extent(extent, parts, part)};
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

/// allreduce of `bytes` over `p` ranks at one level.
double allreduce_time(const AlphaBeta& ab, int p, double bytes) {
  if (p <= 1) return 0;
  return 2.0 * std::ceil(std::log2(static_cast<double>(p))) * ab.alpha +
         2.0 * (p - 1.0) / p * bytes * ab.beta;
}

}  // namespace

std::vector<PlanLayerInfo> PlannerGraph::plan_info() const {
  std::vector<PlanLayerInfo> info;
  for (const auto& l : layers)
    info.push_back({l.name, l.type, l.output, l.input, l.spatially_splittable, l.model_splittable,
                    l.filter_splittable});
  return info;
}

std::string Workload::key(const PlannerGraph& graph) const {
  std::string extents;
  for (auto e : output_extent) {
    if (!extents.empty()) extents.push_back('x');
    extents.append(std::to_string(e));
  }
  return fmt::format("{}|n{}|o{}|f{}c{}|t{}|r{}", graph.layers.at(static_cast<std::size_t>(layer)).signature, samples,
                     extents.empty() ? "-" : extents, filter_parts, channel_parts, threads, ranks_on_node);
}

CostModel::CostModel(const PlannerGraph& graph, const Machine& machine, PlannerOptions options)
    : graph_(graph), machine_(machine), options_(options) {
  if (options_.ranks < 1) fail_input("the planner needs at least 1 rank, got {}", options_.ranks);
  const std::int64_t capacity = static_cast<std::int64_t>(machine_.nodes) * machine_.ranks_per_node;
  if (options_.ranks > capacity)
    fail_input("machine '{}' has {} nodes x {} ranks per node = {} ranks; cannot plan for {}", machine_.name,
               machine_.nodes, machine_.ranks_per_node, capacity, options_.ranks);
  std::vector<std::vector<int>> inputs;
  std::vector<LayerTraits> traits;
  for (const PlannerLayer& layer : graph_.layers) {
    inputs.push_back(layer.inputs);
    traits.push_back(layer.traits);
  }
  may_run_in_place_ = in_place_candidates(inputs, traits, graph_.output);
}

Workload CostModel::workload(int layer, const LayerSplit& split) const {
  const auto& l = graph_.layers.at(static_cast<std::size_t>(layer));
  Workload w;
  w.layer = layer;
  w.samples = std::max<std::int64_t>(1, ceil_div(l.output[0], split.sample));
  const int dims = l.output.spatial_dims();
  const auto parts = spatial_parts(split, dims);
  for (int j = 0; j < dims; ++j)
    w.output_extent.push_back(ceil_div(l.output[j + 2], parts[static_cast<std::size_t>(j)]));
  w.filter_parts = split.filter;
  w.channel_parts = split.channel;
  w.threads = machine_.threads_per_rank(options_.ranks);
  w.ranks_on_node = machine_.ranks_on_node(options_.ranks);
  return w;
}

bool CostModel::gpu_bf16_convolution(const PlannerLayer& l) const {
  // bf16_flops: the machine has bf16 tensor cores (compute capability 8.0 and newer); without
  // them the executor runs bf16 convolutions Exact, at the fp32 rate.
  return machine_.device == "gpu" && machine_.bf16_flops > 0 && l.type == "conv" && l.precision == Precision::BF16;
}

bool CostModel::exact_on_tf32(const PlannerLayer& l) const {
  return gpu_bf16_convolution(l) && options_.exact_bf16_convolutions;
}

LayerEstimate CostModel::layer_cost(int layer, const LayerSplit& split) const {
  const auto& l = graph_.layers.at(static_cast<std::size_t>(layer));
  const int P = options_.ranks;
  LayerEstimate e;
  e.name = l.name;
  e.split = split;
  const Workload w = workload(layer, split);
  // Local output elements (the largest tile) and input elements read (window included).
  const std::int64_t filters = l.output.rank() > 1 ? l.output[1] : 1;
  const std::int64_t filter_block = ceil_div(filters, split.filter);
  double out_local = static_cast<double>(w.samples) * static_cast<double>(filter_block);
  double in_local = static_cast<double>(w.samples);
  double spatial_share = 1;  // local output positions / global output positions
  for (std::size_t j = 0; j < w.output_extent.size(); ++j) {
    out_local *= static_cast<double>(w.output_extent[j]);
    spatial_share *= static_cast<double>(w.output_extent[j]) / static_cast<double>(l.output[static_cast<int>(j) + 2]);
    // The window of the tile, at most the whole (padded) input.
    const auto& win = l.windows.at(j);
    std::int64_t window = (w.output_extent[j] - 1) * win.stride + win.kernel;
    const int d = static_cast<int>(j) + 2;
    if (l.input.rank() > d) window = std::min(window, l.input[d] + 2 * win.pad);
    in_local *= static_cast<double>(window);
  }
  const std::int64_t in_channels = l.input.rank() > 1 ? l.input[1] : 1;
  const double channels_read = static_cast<double>(l.model_splittable ? ceil_div(in_channels, split.channel)
                                                   : split.filter > 1 ? ceil_div(in_channels, split.filter)
                                                                      : in_channels);
  // The layer's block of its input (unpadded) and whether it reads more than that (halos, padding).
  double block = static_cast<double>(w.samples) * channels_read;
  in_local *= channels_read;
  // Input dimensions the output does not have (flatten): read whole.
  for (int d = 2 + static_cast<int>(w.output_extent.size()); d < l.input.rank(); ++d) {
    in_local *= static_cast<double>(l.input[d]);
    block *= static_cast<double>(l.input[d]);
  }
  const auto parts = spatial_parts(split, static_cast<int>(w.output_extent.size()));
  // Uneven blocks: a block's window is cut by its outputs, its producer's block by its inputs,
  // and the two part ways (a pooling layer's input blocks no longer line up) unless each output
  // reads its own position only (a point-wise layer's blocks are its producer's).
  bool uneven = false;
  for (std::size_t j = 0; j < w.output_extent.size(); ++j) {
    const int d = static_cast<int>(j) + 2;
    if (l.input.rank() <= d) continue;
    block *= static_cast<double>(ceil_div(l.input[d], parts[j]));
    const bool point_wise = j < l.windows.size() && l.windows[j] == SpatialWindow{};
    if (parts[j] > 1 && l.input[d] % parts[j] != 0 && !point_wise) uneven = true;
  }
  const bool tiled = split.spatial_product() > 1;
  // What the layer reads, and what a copy of its input holds when it makes one: a spatially split
  // layer's window (its block grown by the halo, padding included), else its block.
  const double read = tiled ? in_local : block;
  e.input_bytes = kBytes * read;
  e.halo = tiled && (in_local != block || uneven);
  e.gathers = (split.filter > 1 && l.model_splittable) || split.channel > 1;
  // A channel-split layer computes a partial sum of its filter block (out_local) and keeps its
  // channel rank's sub-block of the reduced output.
  e.partial_bytes = split.channel > 1 ? kBytes * out_local : 0.0;
  e.output_bytes = kBytes * out_local / static_cast<double>(filter_block) *
                   static_cast<double>(ceil_div(filter_block, split.channel));

  // This rank's block of the weights (a bias follows the filter split only: every channel rank
  // of a channel split holds its filter block's).
  const std::int64_t bias_elements = l.has_bias ? filters : 0;
  const double params_local = static_cast<double>(l.parameters - bias_elements) / (split.filter * split.channel) +
                              static_cast<double>(bias_elements) / split.filter;

  // bf16 operands (conv and linear): what the executor's kernels round: the input as the layer
  // reads it, and the weights without the bias (filters x input channels x kernel volume, the
  // largest block).
  const bool rounds = l.precision == Precision::BF16 && (l.type == "conv" || l.type == "linear");
  const double rounded_weights =
      rounds ? static_cast<double>(l.parameters - bias_elements) / static_cast<double>(filters * in_channels) *
                   static_cast<double>(filter_block) * static_cast<double>(ceil_div(in_channels, split.channel))
             : 0.0;

  // Compute: a calibrated timing of exactly this workload, else the roofline. On GPUs a bf16
  // convolution is timed as it runs by default, on bf16 tensors (tessera calibrate --device
  // cuda): run exact (--bf16-convolutions exact), it takes the roofline at its own rate.
  const auto found = exact_on_tf32(l) ? machine_.kernels.end() : machine_.kernels.find(w.key(graph_));
  if (found != machine_.kernels.end()) {
    e.compute = found->second;
    e.measured = true;
    const int on_node = machine_.ranks_on_node(P);
    if (machine_.device == "cpu" && on_node > machine_.cores_per_node) {
      // Timed with every rank of the node running this (the largest) tile: on an oversubscribed
      // node the cores are shared, so when the tiles are uneven the step takes the node's total
      // work over its cores, or the largest tile on a core of its own, whichever is longer.
      double balance = 1;
      auto share = [&](std::int64_t extent, int n) {
        return static_cast<double>(extent) / n / static_cast<double>(std::max<std::int64_t>(1, ceil_div(extent, n)));
      };
      balance *= share(l.output[0], split.sample);
      if (l.output.rank() > 1) balance *= share(l.output[1], split.filter);
      for (std::size_t j = 0; j < w.output_extent.size(); ++j)
        balance *= share(l.output[static_cast<int>(j) + 2], parts[j]);
      e.compute *= std::max(static_cast<double>(machine_.cores_per_node) / on_node, balance);
    }
  } else {
    const double sample_share = static_cast<double>(w.samples) / static_cast<double>(std::max<std::int64_t>(1, l.output[0]));
    const double flops = 3.0 * l.forward_flops * sample_share * spatial_share / (split.filter * split.channel);
    // Forward reads the input and writes the output; backward reads both and the output gradient
    // and writes the input gradient.
    const double bytes = kBytes * (2.0 * in_local + 3.0 * out_local);
    // Exact bf16 convolutions on GPUs run on TF32 tensor cores: half the bf16 rate.
    const double rate = machine_.rank_flops(P, l.precision) * (exact_on_tf32(l) ? 0.5 : 1.0);
    e.compute = std::max(flops / rate, bytes / machine_.rank_memory_bandwidth(P)) + 2.0 * machine_.kernel_overhead;
    if (rounds) {
      // Passes of their own that round the operands (each element read and written): the input
      // twice (forward, weight gradient), the output gradient and the weights (forward, input
      // gradient).
      e.compute += 2.0 * kBytes * (2.0 * read + out_local + 2.0 * rounded_weights) /
                   machine_.rank_memory_bandwidth(P);
    }
  }

  // Model-parallel communication of a channel split: the partial sums of the filter block are
  // reduce-scattered over the channel ranks (forward) and the output gradient gathered back
  // (backward), point to point within the channel group.
  const int rpn = machine_.ranks_on_node(P);
  if (split.channel > 1) {
    const int c = split.channel;
    const double partial = kBytes * out_local;
    // The channel group's ranks are adjacent in the grid unless spatial parts sit between them.
    const int stride = std::max(1, split.spatial_product());
    const AlphaBeta& ab = stride * c > rpn ? machine_.inter.p2p : machine_.intra.p2p;
    e.model_comm += 2.0 * ((c - 1) * ab.alpha + (c - 1.0) / c * partial * ab.beta +
                           2.0 * partial / machine_.rank_memory_bandwidth(P) + machine_.sync_wait_for(P));
  }
  // Batch-norm statistics: an allreduce of 2 x channels values forward and one backward over the
  // sample x spatial group.
  if (l.batch_norm) {
    const int g = P / (split.filter * split.channel);
    const double bytes = kBytes * 2.0 * static_cast<double>(ceil_div(l.output[1], split.filter));
    const AlphaBeta& ab = P > rpn ? machine_.inter.allreduce : machine_.intra.allreduce;
    if (g > 1) e.model_comm += 2.0 * (allreduce_time(ab, g, bytes) + machine_.sync_wait_for(P));
  }

  // Gradient allreduce of the weight blocks over the ranks with the same filter and channel
  // coordinates (sample x spatial); it spans nodes when the group's last rank is off node 0.
  {
    const int g = P / (split.filter * split.channel);
    const int span = (split.sample - 1) * split.filter * split.channel * split.spatial_product() +
                     (split.spatial_product() - 1) + 1;
    const AlphaBeta& ab = span > rpn ? machine_.inter.allreduce : machine_.intra.allreduce;
    if (l.parameters > 0) e.grad_allreduce = allreduce_time(ab, g, kBytes * params_local);
  }

  // The optimizer reads weights, gradients and state and writes weights and state.
  e.optimizer = kBytes * params_local * (3.0 + 2.0 * options_.optimizer_state) / machine_.rank_memory_bandwidth(P);
  // Memory: weights, their gradients and optimizer state; the saved output and input window.
  e.memory = kBytes * params_local * (2.0 + options_.optimizer_state) + e.output_bytes + e.input_bytes;
  if (rounds) {
    // On GPUs with bf16 tensor cores convolutions keep the operands and results as bf16
    // (Bf16Convolutions::Native, the executor's default there): 2 bytes an element, where the
    // host (and Exact) keeps rounded fp32 copies.
    const bool native = gpu_bf16_convolution(l) && !options_.exact_bf16_convolutions;
    const double element = native ? 2.0 : kBytes;
    e.scratch_input = element * read;
    e.scratch_output = element * out_local;
    e.scratch_weights = element * rounded_weights;
    e.scratch_of_linear = l.type == "linear";
  }
  return e;
}

double CostModel::exchange_cost(int producer, const LayerSplit& held_split, int consumer,
                                const LayerSplit& split) const {
  const auto& c = graph_.layers.at(static_cast<std::size_t>(consumer));
  const int P = options_.ranks;
  const bool from_data = producer < 0;
  // The model's input is read as the consumer's own tiles (its halos come by exchange).
  const LayerSplit& hs = from_data ? split : held_split;
  const Shape shape = from_data ? c.input : graph_.layers.at(static_cast<std::size_t>(producer)).output;
  const int dims = shape.spatial_dims();
  const bool held_tiled = hs.spatial_product() > 1;
  const auto hgrid = layer_grid(hs);
  const auto ngrid = layer_grid(split);
  const auto axis = [dims](int j) { return static_cast<std::size_t>(spatial_axis(j, dims)); };
  const bool point_to_point = from_data || hs == split || P > TileExchange::kAllToAllVUpTo;
  const int rpn = machine_.ranks_on_node(P);
  const double bandwidth = machine_.rank_memory_bandwidth(P);
  const std::int64_t channels = shape.rank() > 1 ? shape[1] : 1;

  // Per dimension of the tensor, the held partition's intervals and which grid coordinates own them.
  struct Part {
    Interval range;
    int s = 0, f = 0, ch = 0, sp = 0;
  };
  auto held_intervals = [&](int d) {
    std::vector<Part> parts;
    if (d == 0) {
      for (int i = 0; i < hs.sample; ++i) parts.push_back({block(shape[0], hs.sample, i), i});
    } else if (d == 1 && from_data) {
      // Every rank reads all channels of its sample x spatial block from the file.
      parts.push_back({{0, channels}});
    } else if (d == 1) {
      const std::int64_t cext = channels;
      for (int f = 0; f < hs.filter; ++f) {
        const Interval fb = block(cext, hs.filter, f);
        for (int ch = 0; ch < hs.channel; ++ch) {
          const Interval cb = block(fb.size(), hs.channel, ch);
          parts.push_back({{fb.begin + cb.begin, fb.begin + cb.end}, 0, f, ch});
        }
      }
    } else {
      const int j = d - 2;
      const int n = held_tiled ? hgrid[axis(j)] : 1;
      for (int i = 0; i < n; ++i) parts.push_back({block(shape[d], n, i), 0, 0, 0, i});
    }
    return parts;
  };
  std::vector<std::vector<Part>> held(static_cast<std::size_t>(shape.rank()));
  for (int d = 0; d < shape.rank(); ++d) held[static_cast<std::size_t>(d)] = held_intervals(d);

  // Ranks to evaluate: all of them, or 12 spread over a large job.
  std::vector<int> ranks;
  if (P <= 24) {
    for (int r = 0; r < P; ++r) ranks.push_back(r);
  } else {
    for (int i = 0; i < 12; ++i) ranks.push_back(static_cast<int>((static_cast<std::int64_t>(P - 1) * i) / 11));
  }
  // Elements of `need` that rank r holds itself: its own block of the held layout (from the data:
  // every rank reads all channels of its sample x spatial block).
  auto own_overlap = [&](int r, const std::vector<Interval>& need) {
    const auto hc = grid_coords(hgrid, r);
    const Box mine = from_data ? sample_spatial_block(hs, shape, hc) : output_box(hs, shape, hc);
    double elems = 1;
    for (std::size_t d = 0; d < need.size(); ++d)
      elems *= static_cast<double>(intersect({mine.begin[d], mine.begin[d] + mine.extent[d]}, need[d]).size());
    return elems;
  };
  double worst = 0;
  for (int r : ranks) {
    const auto cc = grid_coords(ngrid, r);
    // The consumer's needed box, within the tensor.
    const Box box = input_box(split, c.model_splittable, shape, c.output, c.windows, cc);
    std::vector<Interval> need;
    for (int d = 0; d < shape.rank(); ++d) {
      const auto u = static_cast<std::size_t>(d);
      need.push_back(intersect({box.begin[u], box.begin[u] + box.extent[u]}, {0, shape[d]}));
    }
    double needed = 1;
    for (const auto& n : need) needed *= static_cast<double>(n.size());
    if (needed == 0) continue;
    if (!point_to_point) {
      // A redistribution (one alltoallv): what this rank does not hold itself, from anywhere.
      const double own_elems = own_overlap(r, need);
      const double moved = kBytes * (needed - own_elems);
      if (moved == 0) continue;
      const AlphaBeta& ab = P > rpn ? machine_.inter.alltoall : machine_.intra.alltoall;
      worst = std::max(worst, (P - 1) * ab.alpha + moved * ab.beta + 2.0 * kBytes * needed / bandwidth +
                                  machine_.kernel_overhead);
      continue;
    }
    // Intersections per dimension with the held parts.
    std::vector<std::vector<std::pair<const Part*, std::int64_t>>> hits(need.size());
    double sources = 1;
    for (std::size_t d = 0; d < need.size(); ++d) {
      // The held parts of a dimension are in order and tile it: find the first that reaches
      // into the needed interval, then walk while they start inside it.
      const auto& parts = held[d];
      auto it = std::partition_point(parts.begin(), parts.end(),
                                     [&](const Part& p) { return p.range.end <= need[d].begin; });
      for (; it != parts.end() && it->range.begin < need[d].end; ++it) {
        const std::int64_t o = intersect(it->range, need[d]).size();
        if (o > 0) hits[d].push_back({&*it, o});
      }
      sources *= static_cast<double>(hits[d].size());
    }
    double bytes_intra = 0, bytes_inter = 0, own = 0;
    int msgs_intra = 0, msgs_inter = 0;
    if (sources <= kListSources) {
      // Few sources (halos, most redistributions): each one, on this node or another.
      std::vector<std::size_t> idx(need.size(), 0);
      std::vector<int> hc(hgrid.size(), 0);
      while (true) {
        double elems = 1;
        for (std::size_t d = 0; d < need.size(); ++d) {
          const auto& [part, o] = hits[d][idx[d]];
          elems *= static_cast<double>(o);
          if (d == 0) hc[0] = part->s;
          else if (d == 1) hc[1] = part->f, hc[2] = part->ch;
          else hc[axis(static_cast<int>(d) - 2)] = part->sp;
        }
        if (from_data) hc[1] = cc[1], hc[2] = cc[2];  // its own filter/channel group's reader
        const int q = grid_rank(hgrid, hc);
        if (q == r) own += elems;
        else if (q / rpn == r / rpn) bytes_intra += kBytes * elems, ++msgs_intra;
        else bytes_inter += kBytes * elems, ++msgs_inter;
        std::size_t d = 0;
        while (d < idx.size() && ++idx[d] == hits[d].size()) idx[d++] = 0;
        if (d == idx.size()) break;
      }
    } else {
      // Many sources: what this rank does not hold itself, in one message from each of the others,
      // across nodes when the job spans nodes.
      const double own_elems = own_overlap(r, need);
      own = own_elems;
      const double moved = kBytes * (needed - own_elems);
      const int messages = static_cast<int>(std::min(sources, 1e9)) - (own_elems > 0 ? 1 : 0);
      if (P > rpn) bytes_inter = moved, msgs_inter = messages;
      else bytes_intra = moved, msgs_intra = messages;
    }
    if (bytes_intra + bytes_inter == 0 && own == needed) continue;  // nothing moves for this rank
    double t = msgs_intra * machine_.intra.p2p.alpha + bytes_intra * machine_.intra.p2p.beta +
               msgs_inter * machine_.inter.p2p.alpha + bytes_inter * machine_.inter.p2p.beta;
    // The window is assembled in a buffer of its own: copy in (and out, for the reverse); and the
    // exchange is one more call to dispatch.
    t += 2.0 * kBytes * needed / bandwidth + machine_.kernel_overhead;
    worst = std::max(worst, t);
  }
  // Forward, and its reverse in backward; each waits for its peers.
  return worst > 0 ? 2.0 * (worst + machine_.sync_wait_for(P)) : 0.0;
}

bool CostModel::copies_input(int producer, const LayerSplit& held, int consumer, const LayerSplit& split,
                             const LayerEstimate& e) const {
  if (producer < 0) return e.halo || (graph_.layers[static_cast<std::size_t>(consumer)].model_splittable && split.channel > 1);
  // A layer split by channel alone holds its summed output in channel-rank blocks of the output
  // channels: the tiles of a filter split into as many parts.
  LayerSplit tiles = normalised(held);
  if (tiles.channel > 1 && tiles.filter == 1) std::swap(tiles.channel, tiles.filter);
  return !(tiles == normalised(split)) || e.halo || e.gathers;
}

double CostModel::overlap_region_bytes(int producer, const LayerSplit& held, int consumer,
                                       const LayerSplit& split) const {
  const auto& c = graph_.layers.at(static_cast<std::size_t>(consumer));
  if (options_.halo_overlap == HaloOverlap::Never || !halo_overlap_candidate(c.traits, split, producer < 0 ? nullptr : &held))
    return 0;
  std::vector<int> key{consumer, producer, split.sample, split.filter, split.channel};
  for (int p : normalised(split).spatial) key.push_back(p);
  // (held equals split where it matters: a producer's; the model's input has none)
  const auto cached = overlap_cache_.find(key);
  if (cached != overlap_cache_.end()) return cached->second;
  const int P = options_.ranks;
  const int dims = c.output.spatial_dims();
  const auto grid = layer_grid(split);
  const auto axis = [dims](std::size_t u) { return static_cast<std::size_t>(spatial_axis(static_cast<int>(u), dims)); };
  const int rpn = machine_.ranks_on_node(P);
  const std::int64_t samples = ceil_div(c.output[0], split.sample);
  const std::int64_t in_channels = c.input[1];
  const std::int64_t out_channels = ceil_div(c.output[1], split.filter);
  // Per spatial dimension u and tile coordinate: the tile's outputs, and those that read below
  // and above the input block the rank holds before its halos arrive (the global edges' padding
  // is ready).
  struct Row {
    std::int64_t extent = 0, below = 0, above = 0;
    bool operator==(const Row&) const = default;
  };
  std::vector<std::vector<Row>> rows(static_cast<std::size_t>(dims));
  for (std::size_t u = 0; u < rows.size(); ++u) {
    const int j = static_cast<int>(u);
    const auto& win = c.windows.at(u);
    for (int coord = 0; coord < grid[axis(u)]; ++coord) {
      const Interval out = block(c.output[j + 2], grid[axis(u)], coord);
      const Interval ready = block(c.input[j + 2], grid[axis(u)], coord);
      const std::int64_t low = ready.begin == 0 ? std::numeric_limits<std::int64_t>::min() : ready.begin;
      const std::int64_t high = ready.end == c.input[j + 2] ? std::numeric_limits<std::int64_t>::max() : ready.end;
      Row row{out.size(), 0, 0};
      for (std::int64_t o = out.begin; o < out.end; ++o) {
        const std::int64_t first = o * win.stride - win.pad;
        if (first < low) ++row.below;
        else if (first + win.kernel > high) ++row.above;
      }
      rows[u].push_back(row);
    }
  }
  // The copies of a tile (one row per dimension) that overlaps: the boundary boxes of
  // split_at_halos (along dimension j the outputs below and above the interior, within the
  // interior along the dimensions before j, any along those after); the copies grow to the
  // largest box's input (its window) and output. 0 where the tile has no interior or no boundary,
  // or (Automatic) a boundary above kMaxRecomputedShare of it.
  auto tile_region = [&](const std::vector<Row>& tile) {
    double outputs = 1, inner = 1;
    bool boundary = false;
    for (const Row& r : tile) {
      const std::int64_t interior = r.extent - r.below - r.above;
      if (interior <= 0) return 0.0;
      boundary = boundary || r.below > 0 || r.above > 0;
      outputs *= static_cast<double>(r.extent);
      inner *= static_cast<double>(interior);
    }
    if (!boundary) return 0.0;
    if (options_.halo_overlap == HaloOverlap::Automatic && 1.0 - inner / outputs > kMaxRecomputedShare) return 0.0;
    double region_in = 0, region_out = 0;
    for (int j = 0; j < dims; ++j) {
      const Row& along = tile[static_cast<std::size_t>(j)];
      for (const std::int64_t side : {along.below, along.above}) {
        if (side == 0) continue;
        double in = static_cast<double>(samples * in_channels), out = static_cast<double>(samples * out_channels);
        for (int i = 0; i < dims; ++i) {
          const Row& r = tile[static_cast<std::size_t>(i)];
          const std::int64_t e = i < j ? r.extent - r.below - r.above : i == j ? side : r.extent;
          const auto& win = c.windows.at(static_cast<std::size_t>(i));
          out *= static_cast<double>(e);
          in *= static_cast<double>((e - 1) * win.stride + win.kernel);
        }
        region_in = std::max(region_in, in);
        region_out = std::max(region_out, out);
      }
    }
    return kBytes * (region_in + region_out);
  };
  // Whether rank r (grid coordinates `coords`) has a peer on another node (TileExchange::
  // peer_ranks): a rank of a neighbouring tile this tile's window reaches into, or whose window
  // reaches into this tile. Read from the model's input under a filter split, every filter rank
  // of a tile holds it and the exchange spreads the receivers over them: any of them may be the
  // peer.
  const bool any_filter_rank = producer < 0 && split.filter > 1;
  auto off_node_peer = [&](int r, const std::vector<int>& coords) {
    const int me = r / rpn;
    std::vector<int> offset(static_cast<std::size_t>(dims), -1);
    while (true) {
      std::vector<int> q = coords;
      bool moved = false, exists = true, incoming = true, outgoing = true;
      for (std::size_t u = 0; u < offset.size() && exists; ++u) {
        const int o = offset[u];
        if (o == 0) continue;
        moved = true;
        q[axis(u)] += o;
        if (q[axis(u)] < 0 || q[axis(u)] >= grid[axis(u)]) {
          exists = false;
          break;
        }
        const Row& mine = rows[u][static_cast<std::size_t>(coords[axis(u)])];
        const Row& theirs = rows[u][static_cast<std::size_t>(q[axis(u)])];
        incoming = incoming && (o < 0 ? mine.below > 0 : mine.above > 0);
        outgoing = outgoing && (o < 0 ? theirs.above > 0 : theirs.below > 0);
      }
      if (moved && exists && (incoming || outgoing)) {
        for (int f = any_filter_rank ? 0 : q[1]; f < (any_filter_rank ? split.filter : q[1] + 1); ++f) {
          q[1] = f;
          if (grid_rank(grid, q) / rpn != me) return true;
        }
      }
      std::size_t u = 0;
      while (u < offset.size() && ++offset[u] > 1) offset[u++] = -1;
      if (u == offset.size()) return false;
    }
  };
  double largest = 0;
  if (P <= 4096) {
    // Every rank.
    for (int r = 0; r < P; ++r) {
      const std::vector<int> coords = grid_coords(grid, r);
      std::vector<Row> tile;
      for (std::size_t u = 0; u < rows.size(); ++u) tile.push_back(rows[u][static_cast<std::size_t>(coords[axis(u)])]);
      const double region = tile_region(tile);
      if (region > largest && (options_.halo_overlap == HaloOverlap::Always || off_node_peer(r, coords)))
        largest = region;
    }
  } else {
    // A large job: every combination of the dimensions' distinct rows (a handful each), each tile
    // taken to have a peer on another node where the job spans nodes.
    if (options_.halo_overlap == HaloOverlap::Automatic && P <= rpn) return 0;
    std::vector<std::vector<Row>> distinct(rows.size());
    for (std::size_t u = 0; u < rows.size(); ++u)
      for (const Row& r : rows[u])
        if (std::find(distinct[u].begin(), distinct[u].end(), r) == distinct[u].end()) distinct[u].push_back(r);
    std::vector<std::size_t> pick(rows.size(), 0);
    while (true) {
      std::vector<Row> tile;
      for (std::size_t u = 0; u < rows.size(); ++u) tile.push_back(distinct[u][pick[u]]);
      largest = std::max(largest, tile_region(tile));
      std::size_t u = 0;
      while (u < pick.size() && ++pick[u] == distinct[u].size()) pick[u++] = 0;
      if (u == pick.size()) break;
    }
  }
  overlap_cache_.emplace(std::move(key), largest);
  return largest;
}

double CostModel::input_copy_bytes(int consumer, std::size_t input, const LayerEstimate& e) const {
  const PlannerLayer& l = graph_.layers.at(static_cast<std::size_t>(consumer));
  const int producer = l.inputs.at(input);
  if (input == 0 || producer < 0 || l.input.rank() < 2) return e.input_bytes;
  const Shape& read = graph_.layers.at(static_cast<std::size_t>(producer)).output;
  return e.input_bytes * static_cast<double>(read[1]) / static_cast<double>(l.input[1]);
}

double CostModel::activation_bytes(const PlanEstimate& estimate) const {
  // As the executor holds them: the step plan of this plan's largest tiles (step_plan.hpp), whose
  // arena holds every output, copy, partial sum and gradient by lifetime; beside it, the layers'
  // own buffers (max pooling's maxima, dropout's scales, a convolution's boundary regions when its
  // halos overlap its forward).
  const std::size_t n = estimate.layers.size();
  const auto whole = [](double bytes) { return static_cast<std::int64_t>(std::llround(bytes)); };
  const auto held = [&](int j) { return j < 0 ? LayerSplit{} : estimate.layers[static_cast<std::size_t>(j)].split; };
  StepGraph step;
  step.output = graph_.output;
  step.bf16_activations = graph_.bf16_activations;
  double bytes = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const LayerEstimate& e = estimate.layers[i];
    const PlannerLayer& layer = graph_.layers[i];
    StepLayer& l = step.layers.emplace_back();
    l.inputs = layer.inputs;
    l.traits = layer.traits;
    for (std::size_t a = 0; a < layer.inputs.size(); ++a) {
      const int j = layer.inputs[a];
      const bool copied = copies_input(j, held(j), static_cast<int>(i), e.split, e);
      l.copies_input.push_back(copied);
      l.input_copy_bytes.push_back(copied ? whole(input_copy_bytes(static_cast<int>(i), a, e)) : 0);
    }
    l.output_bytes = whole(e.output_bytes);
    l.partial_bytes = whole(e.partial_bytes);
    l.channel_split = layer.model_splittable && e.split.channel > 1;
    if (layer.type == "maxpool" || layer.type == "dropout") bytes += e.output_bytes;
    if (layer.inputs.size() == 1)
      bytes += overlap_region_bytes(layer.inputs[0], held(layer.inputs[0]), static_cast<int>(i), e.split);
  }
  return bytes + static_cast<double>(plan_step(step, StepOptions{}).arena.layout.size);
}

void CostModel::finish(PlanEstimate& estimate) const {
  const int P = options_.ranks;
  estimate.compute = estimate.exchange = estimate.model_comm = estimate.grad_allreduce = 0;
  double optimizer = 0, last_grad = 0;
  for (const auto& l : estimate.layers) {
    optimizer += l.optimizer;
    estimate.compute += l.compute;
    estimate.exchange += l.exchange;
    estimate.model_comm += l.model_comm;
    estimate.grad_allreduce += l.grad_allreduce;
    if (l.grad_allreduce > 0) last_grad = l.grad_allreduce;  // the first layer's: reduced last
  }
  // Backward (two thirds of the compute) hides grad_overlap of itself; the last bucket never hides.
  const double hideable = std::max(0.0, estimate.grad_allreduce - last_grad);
  const double hidden = std::min(hideable, machine_.grad_overlap * estimate.compute * 2.0 / 3.0);
  estimate.grad_exposed = estimate.grad_allreduce - hidden;
  // The loss allreduce, and the optimizer's pass over weights, gradients and state.
  const int rpn = machine_.ranks_on_node(P);
  // The loss allreduce and the wait for the last gradient bucket are blocking.
  const double waits = P > 1 ? machine_.sync_wait_for(P) * (estimate.grad_allreduce > 0 ? 2.0 : 1.0) : 0.0;
  estimate.other = allreduce_time(P > rpn ? machine_.inter.allreduce : machine_.intra.allreduce, P, 16) + optimizer + waits;
  estimate.step_seconds =
      estimate.compute + estimate.exchange + estimate.model_comm + estimate.grad_exposed + estimate.other;
  estimate.memory_bytes = memory_bytes(estimate, &estimate.scratch_bytes);
  estimate.fits = estimate.memory_bytes <= machine_.memory_per_rank;
}

double CostModel::memory_bytes(const PlanEstimate& estimate, double* scratch_bytes) const {
  double memory = 0;
  double scratch_input[2] = {0, 0}, scratch_output[2] = {0, 0}, scratch_weights[2] = {0, 0};  // conv, linear
  for (const auto& l : estimate.layers) {
    const int kind = l.scratch_of_linear ? 1 : 0;
    scratch_input[kind] = std::max(scratch_input[kind], l.scratch_input);
    scratch_output[kind] = std::max(scratch_output[kind], l.scratch_output);
    scratch_weights[kind] = std::max(scratch_weights[kind], l.scratch_weights);
    memory += l.memory - l.output_bytes - l.input_bytes;  // weights, gradients, optimizer state
  }
  // Activations and their transient gradients; and the bf16 operands' scratch.
  double scratch = 0;
  for (int kind : {0, 1}) scratch += scratch_input[kind] + scratch_output[kind] + scratch_weights[kind];
  if (scratch_bytes) *scratch_bytes = scratch;
  return memory + activation_bytes(estimate) + scratch;
}

PlanEstimate CostModel::estimate(const Plan& plan) const {
  plan.validate(options_.ranks, graph_.plan_info());
  PlanEstimate e;
  for (std::size_t i = 0; i < graph_.layers.size(); ++i) {
    const auto& l = graph_.layers[i];
    LayerSplit split = plan.split_for(l.name);
    split.spatial = split.spatial_product() > 1 ? spatial_parts(split, l.output.spatial_dims()) : std::vector<int>{};
    LayerEstimate le = layer_cost(static_cast<int>(i), split);
    for (int input : l.inputs) {
      LayerSplit held;
      if (input >= 0) {
        held = plan.split_for(graph_.layers[static_cast<std::size_t>(input)].name);
        const int dims = graph_.layers[static_cast<std::size_t>(input)].output.spatial_dims();
        held.spatial = held.spatial_product() > 1 ? spatial_parts(held, dims) : std::vector<int>{};
      }
      le.exchange += exchange_cost(input, held, static_cast<int>(i), split);
    }
    e.layers.push_back(std::move(le));
  }
  finish(e);
  return e;
}

std::string format_estimate(const PlanEstimate& e) {
  std::string s = fmt::format("{:<14} {:<34} {:>10} {:>10} {:>10} {:>10} {:>10}\n", "layer", "split",
                              "compute ms", "exch. ms", "model ms", "grad ms", "mem MiB");
  for (const auto& l : e.layers)
    s += fmt::format("{:<14} {:<34} {:>9.3f}{} {:>10.3f} {:>10.3f} {:>10.3f} {:>10.1f}\n", l.name, l.split.to_string(),
                     1e3 * l.compute, l.measured ? "m" : "r", 1e3 * l.exchange, 1e3 * l.model_comm,
                     1e3 * l.grad_allreduce, l.memory / (1 << 20));
  s += fmt::format(
      "step {:.3f} ms = compute {:.3f} + exchange {:.3f} + model {:.3f} + exposed gradient allreduce {:.3f} (of {:.3f}) "
      "+ loss/optimizer {:.3f}; memory per rank {:.1f} MiB{}\n",
      1e3 * e.step_seconds, 1e3 * e.compute, 1e3 * e.exchange, 1e3 * e.model_comm, 1e3 * e.grad_exposed,
      1e3 * e.grad_allreduce, 1e3 * e.other, e.memory_bytes / (1 << 20), e.fits ? "" : " (does NOT fit)");
  s += "(compute: m = calibrated timing of this workload, r = roofline of the machine file; mem: the layer's "
       "weights, their gradients and optimizer state, its output and input while it runs; memory per rank counts "
       "each tensor once, the step's activations and gradients in one arena by their lifetimes)\n";
  return s;
}

}  // namespace tessera
