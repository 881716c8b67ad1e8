// The cost model's exchanges and memory: what moving a producer's tiles to what a layer reads
// costs, and the bytes of a step's tensors, on the tiles the executor builds (tile_geometry.hpp)
// and by the step plan it carries out (step_plan.hpp).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "parallel/cost_model_internal.hpp"
#include "tessera/core/error.hpp"
#include "tessera/parallel/planner.hpp"
#include "tessera/parallel/step_plan.hpp"
#include "tessera/parallel/tile_exchange.hpp"
#include "tessera/parallel/tile_geometry.hpp"
#include "tessera/tensor/box.hpp"
#include "tessera/tensor/grid.hpp"

namespace tessera {

using namespace cost_detail;

double CostModel::exchange_cost(int producer, const LayerSplit& held_split, int consumer, const LayerSplit& split,
                                bool windows) const {
  const auto& c = graph_.layers.at(static_cast<std::size_t>(consumer));
  const bool from_data = producer < 0;
  const Shape& shape = from_data ? c.input : graph_.layers.at(static_cast<std::size_t>(producer)).output;
  std::vector<std::int64_t> key{from_data, c.model_splittable};
  const auto add_split = [&key](const LayerSplit& s) {
    key.insert(key.end(), {s.sample, s.channel, s.filter, static_cast<std::int64_t>(s.spatial.size())});
    key.insert(key.end(), s.spatial.begin(), s.spatial.end());
  };
  add_split(split);
  if (!from_data) add_split(held_split);
  for (const Shape* t : {&shape, &c.output}) {
    key.push_back(t->rank());
    key.insert(key.end(), t->dims().begin(), t->dims().end());
  }
  for (const auto& w : c.windows) key.insert(key.end(), {w.kernel, w.stride, w.pad});
  const bool in_window = windows && into_window(producer, held_split, consumer, split);
  key.push_back(in_window);
  const auto cached = exchange_cache_.find(key);
  if (cached != exchange_cache_.end()) return cached->second;
  const double seconds = exchange_cost_uncached(producer, held_split, consumer, split, in_window);
  exchange_cache_.emplace(std::move(key), seconds);
  return seconds;
}

bool CostModel::into_window(int producer, const LayerSplit& held_split, int consumer, const LayerSplit& split) const {
  return producer >= 0 && may_write_into_window_[static_cast<std::size_t>(producer)] &&
         window_holds_tile(producer, held_split, consumer, split);
}

double CostModel::exchange_cost_uncached(int producer, const LayerSplit& held_split, int consumer,
                                         const LayerSplit& split, bool in_window) const {
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
    // The window is assembled in a buffer of its own (and its gradient taken back, for the
    // reverse): a box copy of it, a run per row of its last dimension; of what others hold only
    // where the producer wrote its tile into the window (and its gradient is summed there).
    const double rows = needed / static_cast<double>(need.back().size());
    const auto copy_of = [&](double elements) { return machine_.box_copy_seconds(P, kBytes * elements, rows * elements / needed); };
    const double copy = copy_of(needed);
    if (!point_to_point) {
      // A redistribution (one alltoallv): what this rank does not hold itself, from anywhere.
      const double own_elems = own_overlap(r, need);
      const double moved = kBytes * (needed - own_elems);
      if (moved == 0) continue;
      const AlphaBeta& ab = P > rpn ? machine_.inter.alltoall : intra_.alltoall;
      worst = std::max(worst, (P - 1) * ab.alpha + moved * ab.beta + copy + machine_.kernel_overhead);
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
    double t = msgs_intra * intra_.p2p.alpha + bytes_intra * intra_.p2p.beta +
               msgs_inter * machine_.inter.p2p.alpha + bytes_inter * machine_.inter.p2p.beta;
    // The window's copy; and the exchange is one more call to dispatch.
    t += (in_window ? copy_of(needed - own) : copy) + machine_.kernel_overhead;
    worst = std::max(worst, t);
  }
  // Forward, and its reverse in backward; each waits for its peers.
  return worst > 0 ? 2.0 * (worst + machine_.sync_wait_for(P)) : 0.0;
}

namespace {

/// Whether a consumer split as `split` reads the tiles a producer split as `held` holds (before
/// halos): a layer split by channel alone holds its summed output in channel-rank blocks of the
/// output channels, the tiles of a filter split into as many parts.
bool reads_held_tiles(const LayerSplit& held, const LayerSplit& split) {
  LayerSplit tiles = normalised(held);
  if (tiles.channel > 1 && tiles.filter == 1) std::swap(tiles.channel, tiles.filter);
  return tiles == normalised(split);
}

}  // namespace

bool CostModel::copies_input(int producer, const LayerSplit& held, int consumer, const LayerSplit& split,
                             const LayerEstimate& e) const {
  if (producer < 0) return e.halo || (graph_.layers[static_cast<std::size_t>(consumer)].model_splittable && split.channel > 1);
  return !reads_held_tiles(held, split) || e.halo || e.gathers;
}

StepOptions CostModel::step_options() const {
  StepOptions options = default_step_options(machine_.device == "gpu");
  options.outputs_into_windows = options.outputs_into_windows && options_.outputs_into_windows;
  return options;
}

double CostModel::unfused_seconds(int producer, const LayerSplit& held, const LayerEstimate& produced, int consumer,
                                  const LayerSplit& split, const LayerEstimate& consumed) const {
  if (producer < 0) return 0.0;
  const auto p = static_cast<std::size_t>(producer), c = static_cast<std::size_t>(consumer);
  const bool copied = copies_input(producer, held, consumer, split, consumed);
  // The consumer runs in place reading as produced, unsplit by channel; its producer applies it
  // unless split by channel; its one reader does its backward reading it as produced.
  const bool in_place = !copied && !channel_split(consumer, split);
  double seconds = 0;
  if (fusion_.forward[c] && !(in_place && !channel_split(producer, held))) seconds += consumed.fused_forward;
  if (fusion_.backward[c] && !in_place) seconds += consumed.fused_backward;
  if (fusion_.backward[p] && fusion_.reader[p] == consumer && copied) seconds += produced.fused_backward;
  // A max pooling reading its input through an exchange, or split by channel, runs its own passes.
  if (fusion_.pooled_by[c] >= 0 && (copied || channel_split(consumer, split))) seconds += consumed.by_convolution;
  return seconds;
}

bool CostModel::channel_split(int layer, const LayerSplit& split) const {
  return graph_.layers.at(static_cast<std::size_t>(layer)).model_splittable && split.channel > 1;
}

bool CostModel::gathers_channels(int consumer, const LayerSplit& split) const {
  return (split.filter > 1 && graph_.layers.at(static_cast<std::size_t>(consumer)).model_splittable) || split.channel > 1;
}

bool CostModel::window_holds_tile(int producer, const LayerSplit& held, int consumer, const LayerSplit& split) const {
  // Its own tiles' split (a halo window of them, where it copies), its samples and channels.
  return producer >= 0 && !gathers_channels(consumer, split) && reads_held_tiles(held, split);
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

double CostModel::activation_bytes(const PlanEstimate& estimate, const StepPlan* step) const {
  // As the executor holds them: the step plan of this plan's largest tiles (step_plan.hpp), whose
  // arena holds every output, copy, partial sum and gradient by lifetime; beside it, the layers'
  // own buffers (max pooling's maxima, dropout's scales, a convolution's boundary regions when its
  // halos overlap its forward, unless it makes its pooling's output: StepPlan::pooled_by).
  StepPlan own;
  const StepPlan& plan = step ? *step : (own = step_plan(estimate));
  double bytes = 0;
  for (std::size_t i = 0; i < estimate.layers.size(); ++i) {
    const LayerEstimate& e = estimate.layers[i];
    const PlannerLayer& layer = graph_.layers[i];
    if (layer.type == "maxpool" || layer.type == "dropout") bytes += e.output_bytes;
    const int pooling = plan.gradient_from_pooling[i];
    if (layer.inputs.size() == 1 && pooling < 0) {
      const int j = layer.inputs[0];
      bytes += overlap_region_bytes(j, j < 0 ? LayerSplit{} : estimate.layers[static_cast<std::size_t>(j)].split,
                                    static_cast<int>(i), e.split);
    }
  }
  return bytes + static_cast<double>(plan.arena.layout.size);
}

StepPlan CostModel::step_plan(const PlanEstimate& estimate) const {
  const std::size_t n = estimate.layers.size();
  const auto whole = [](double bytes) { return static_cast<std::int64_t>(std::llround(bytes)); };
  const auto held = [&](int j) { return j < 0 ? LayerSplit{} : estimate.layers[static_cast<std::size_t>(j)].split; };
  StepGraph step;
  step.output = graph_.output;
  step.bf16_activations = graph_.bf16_activations;
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
      l.copy_holds_tile.push_back(copied && window_holds_tile(j, held(j), static_cast<int>(i), e.split));
    }
    l.output_bytes = whole(e.output_bytes);
    l.partial_bytes = whole(e.partial_bytes);
    l.channel_split = channel_split(static_cast<int>(i), e.split);
    // The largest tile's rows (a spatial split's last part count along the innermost dimension).
    const int dims = layer.output.spatial_dims();
    const int row_parts = dims > 0 && e.split.spatial_product() > 1 ? spatial_parts(e.split, dims).back() : 1;
    l.output_row = block_extent(layer.output[layer.output.rank() - 1], row_parts, 0);
  }
  return plan_step(step, step_options());
}

}  // namespace tessera
