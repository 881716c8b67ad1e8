// The planner's search (see planner.hpp): candidate splits per layer, dynamic programming over
// the layers in model order with exchange costs on the edges, a Lagrangian memory penalty.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <tuple>
#include <unordered_map>

#include "tessera/core/error.hpp"
#include "tessera/parallel/planner.hpp"

namespace tessera {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
/// Up to this many ranks every spatial factorization is a candidate (see candidates()).
constexpr int kAllSpatialUpTo = 64;

std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

/// Every way to write `n` as an ordered product of `count` factors, each at most its limit.
void factorizations(int n, const std::vector<std::int64_t>& limits, std::vector<int>& current,
                    std::vector<std::vector<int>>& out) {
  const std::size_t i = current.size();
  if (i + 1 == limits.size()) {
    if (n <= limits[i]) {
      current.push_back(n);
      out.push_back(current);
      current.pop_back();
    }
    return;
  }
  for (int d : divisors(n)) {
    if (d > limits[i]) break;
    current.push_back(d);
    factorizations(n / d, limits, current, out);
    current.pop_back();
  }
}

}  // namespace

std::vector<LayerSplit> CostModel::candidates(int layer) const {
  const auto& l = graph_.layers.at(static_cast<std::size_t>(layer));
  const int P = options_.ranks;
  const std::int64_t batch = l.output[0];
  const bool is_output = layer == graph_.output;
  const int dims = l.output.spatial_dims();
  // Limits per factor: sample, filter, channel, spatial dims.
  std::vector<std::int64_t> limits;
  limits.push_back(options_.allow_sample ? batch : 1);
  const bool model = options_.allow_model && !is_output;
  limits.push_back(model && l.filter_splittable && l.output.rank() > 1 ? l.output[1] : 1);
  limits.push_back(model && l.model_splittable && l.input.rank() > 1 ? l.input[1] : 1);
  const bool spatial = options_.allow_spatial && !is_output && l.spatially_splittable && dims > 0;
  for (int j = 0; j < dims; ++j) {
    std::int64_t limit = 1;
    if (spatial) {
      const auto& win = l.windows.at(static_cast<std::size_t>(j));
      const std::int64_t out_extent = l.output[j + 2];
      const std::int64_t in_extent = l.input.rank() == l.output.rank() ? l.input[j + 2] : out_extent;
      // Halos come from direct neighbours only: every input block at least a kernel wide.
      const std::int64_t reach = std::max<std::int64_t>(1, win.kernel);
      limit = std::min(out_extent, std::max<std::int64_t>(1, in_extent / reach));
    }
    limits.push_back(limit);
  }
  std::vector<std::vector<int>> all;
  std::vector<int> current;
  factorizations(P, limits, current, all);
  std::vector<LayerSplit> out;
  for (const auto& f : all) {
    LayerSplit s;
    s.sample = f[0];
    s.filter = f[1];
    s.channel = f[2];
    for (int j = 0; j < dims; ++j) s.spatial.push_back(f[static_cast<std::size_t>(3 + j)]);
    if (s.spatial_product() == 1) s.spatial.clear();
    // The partial sums of a filter block are scattered over the channel ranks by output channel.
    if (s.channel > 1 && s.channel > l.output[1] / s.filter) continue;
    out.push_back(s);
  }
  if (P > kAllSpatialUpTo && dims > 1) {
    // Large jobs: of the spatial factorizations with the same sample, filter and channel parts
    // and the same number of spatial parts, keep the one whose tiles have the smallest halo
    // surface (the others compute the same and exchange more).
    auto surface = [&](const LayerSplit& s) {
      double area = 0;
      for (int j = 0; j < dims; ++j) {
        double face = 1;
        for (int i = 0; i < dims; ++i)
          if (i != j) face *= static_cast<double>(l.output[i + 2]) / s.spatial[static_cast<std::size_t>(i)];
        const auto& win = l.windows.at(static_cast<std::size_t>(j));
        // Halo width, at least 1: point-wise layers then prefer the same compact tiles as the
        // convolutions around them (and redistributions move the least).
        const double width = static_cast<double>(std::max<std::int64_t>(1, win.kernel - win.stride));
        area += s.spatial[static_cast<std::size_t>(j)] > 1 ? face * width : 0.0;
      }
      return area;
    };
    std::map<std::tuple<int, int, int, int>, std::size_t> best;
    std::vector<LayerSplit> kept;
    for (const auto& s : out) {
      if (s.spatial_product() == 1) {
        kept.push_back(s);
        continue;
      }
      const auto key = std::make_tuple(s.sample, s.filter, s.channel, s.spatial_product());
      const auto it = best.find(key);
      if (it == best.end()) best.emplace(key, kept.size()), kept.push_back(s);
      else if (surface(s) < surface(kept[it->second])) kept[it->second] = s;
    }
    out = std::move(kept);
  }
  // More sample parts than samples leaves ranks idle in this layer: allowed as the plain sample
  // split, which is also what a layer gets that the options leave nothing else.
  const bool has_plain = std::any_of(out.begin(), out.end(), [&](const LayerSplit& s) {
    return s.sample_only() && s.sample == P;
  });
  if (!has_plain && (out.empty() || batch < P)) {
    LayerSplit s;
    s.sample = P;
    out.push_back(s);
  }
  return out;
}

std::vector<std::pair<std::string, Plan>> reference_plans(const CostModel& model) {
  std::vector<std::pair<std::string, Plan>> out;
  struct Kind {
    const char* name;
    bool sample, spatial, model;
  };
  for (const Kind k : {Kind{"pure batch", true, false, false}, Kind{"pure spatial", false, true, false},
                       Kind{"pure model", false, false, true}}) {
    PlannerOptions o = model.options();
    o.allow_sample = k.sample;
    o.allow_spatial = k.spatial;
    o.allow_model = k.model;
    try {
      PlanResult r = plan_search(model.graph(), model.machine(), o);
      // A reference plan must use its kind somewhere (else it is the batch plan again).
      bool uses = k.sample;
      for (const auto& l : r.estimate.layers)
        uses = uses || (k.spatial && l.split.spatial_product() > 1) || (k.model && (l.split.filter > 1 || l.split.channel > 1));
      if (uses) out.emplace_back(k.name, std::move(r.plan));
    } catch (const InputError&) {
      // This kind cannot run at this rank count (e.g. a batch smaller than the ranks).
    }
  }
  return out;
}

std::vector<Workload> all_workloads(const CostModel& model) {
  std::vector<Workload> out;
  std::set<std::string> seen;
  const auto& graph = model.graph();
  for (std::size_t i = 0; i < graph.layers.size(); ++i)
    for (const auto& s : model.candidates(static_cast<int>(i))) {
      Workload w = model.workload(static_cast<int>(i), s);
      if (seen.insert(w.key(graph)).second) out.push_back(std::move(w));
    }
  return out;
}

namespace {

struct Entry {
  /// Candidate index of each live layer, then 1 if some layer so far gives rank 0 samples (a
  /// plan where none does is refused: Plan::validate).
  std::vector<int> key;
  double cost = 0;
  int parent = -1;  ///< entry of the previous table
  int choice = -1;  ///< candidate of this layer
};

struct KeyHash {
  std::size_t operator()(const std::vector<int>& v) const {
    std::size_t h = 1469598103934665603ull;
    for (int x : v) h = (h ^ static_cast<std::size_t>(x)) * 1099511628211ull;
    return h;
  }
};

struct SearchOutcome {
  std::vector<int> choice;  ///< per layer
  std::int64_t states = 0;
  bool exact = true;
};

/// "12.5 GiB", "3.1 MiB", "13.1 KiB", "512 B".
std::string bytes_text(double bytes) {
  if (bytes >= 0.1 * (1 << 30)) return fmt::format("{:.1f} GiB", bytes / (1 << 30));
  if (bytes >= 0.1 * (1 << 20)) return fmt::format("{:.1f} MiB", bytes / (1 << 20));
  if (bytes >= 1024) return fmt::format("{:.1f} KiB", bytes / 1024);
  return fmt::format("{:.0f} B", bytes);
}

/// One dynamic-programming pass with memory weighted by `penalty` (seconds per byte); an input
/// copy's memory is priced on the edge that makes it.
SearchOutcome run_dp(const CostModel& model, const std::vector<std::vector<LayerSplit>>& cands,
                     const std::vector<std::vector<LayerEstimate>>& estimates,
                     const std::vector<std::vector<double>>& node_cost, const std::vector<std::vector<double>>& node_memory,
                     double penalty) {
  const auto& layers = model.graph().layers;
  const std::size_t L = layers.size();
  std::vector<std::size_t> last_use(L);
  for (std::size_t v = 0; v < L; ++v) last_use[v] = v;
  for (std::size_t v = 0; v < L; ++v)
    for (int u : layers[v].inputs)
      if (u >= 0) last_use[static_cast<std::size_t>(u)] = std::max(last_use[static_cast<std::size_t>(u)], v);
  // live[v]: layers <= v whose output a later layer still reads, in order.
  std::vector<std::vector<int>> live(L);
  for (std::size_t v = 0; v < L; ++v)
    for (std::size_t u = 0; u <= v; ++u)
      if (last_use[u] > v) live[v].push_back(static_cast<int>(u));

  SearchOutcome outcome;
  std::vector<std::vector<Entry>> tables(L);
  std::vector<Entry> prev{Entry{{0}, 0, -1, -1}};
  std::vector<int> prev_live;
  const std::int64_t max_states = model.options().max_states;
  for (std::size_t v = 0; v < L; ++v) {
    const auto& l = layers[v];
    const auto& cv = cands[v];
    std::vector<double> own(cv.size());
    for (std::size_t k = 0; k < cv.size(); ++k) own[k] = node_cost[v][k] + penalty * node_memory[v][k];
    // Where each input's choice sits in the previous key (-1: the model's input).
    std::vector<int> input_slot;
    for (int u : l.inputs) {
      int slot = -1;
      if (u >= 0) {
        const auto it = std::find(prev_live.begin(), prev_live.end(), u);
        TESSERA_CHECK(it != prev_live.end(), "planner: input {} of layer {} is not live", u, v);
        slot = static_cast<int>(it - prev_live.begin());
      }
      input_slot.push_back(slot);
    }
    // The new key: the previous live layers still live, then this one if it is.
    std::vector<int> keep;  // slots of prev key kept
    for (std::size_t i = 0; i < prev_live.size(); ++i)
      if (last_use[static_cast<std::size_t>(prev_live[i])] > v) keep.push_back(static_cast<int>(i));
    const bool v_live = last_use[v] > v;

    std::vector<Entry> next;
    std::unordered_map<std::vector<int>, std::size_t, KeyHash> index;
    // Cheapest previous entries first: once an entry alone costs more than the best found for a
    // key that only this layer's choice decides, no later entry can win it (edges cost >= 0).
    std::vector<std::size_t> order(prev.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return prev[a].cost < prev[b].cost; });
    const bool key_by_choice_only = keep.empty();
    const std::int64_t batch = l.output[0];
    // Edge costs repeat across entries that share a producer choice: cache them per input.
    std::vector<std::unordered_map<std::int64_t, double>> edge_cache(l.inputs.size());
    auto edge = [&](std::size_t a, int producer_choice, std::size_t k) {
      const int u = l.inputs[a];
      const std::int64_t key = static_cast<std::int64_t>(producer_choice) * static_cast<std::int64_t>(cv.size()) +
                               static_cast<std::int64_t>(k);
      auto& cache = edge_cache[a];
      const auto it = cache.find(key);
      if (it != cache.end()) return it->second;
      const LayerSplit held = u >= 0 ? cands[static_cast<std::size_t>(u)][static_cast<std::size_t>(producer_choice)] : LayerSplit{};
      // The exchange, and the memory of the copy it makes (if it makes one; a layer that may run
      // in place then keeps an output and its gradient of its own too).
      const LayerEstimate& consumer = estimates[v][k];
      const double copy_bytes = model.input_copy_bytes(static_cast<int>(v), a, consumer) +
                                (model.may_run_in_place(static_cast<int>(v)) ? 2.0 * consumer.output_bytes : 0.0);
      // And, where its halo exchange overlaps its forward, the region copies a convolution keeps.
      const double c =
          model.exchange_cost(u, held, static_cast<int>(v), cv[k]) +
          (u >= 0 ? model.unfused_seconds(
                        u, held, estimates[static_cast<std::size_t>(u)][static_cast<std::size_t>(producer_choice)],
                        static_cast<int>(v), cv[k], consumer)
                  : 0.0) +
          (penalty > 0 && model.copies_input(u, held, static_cast<int>(v), cv[k], consumer) ? penalty * copy_bytes
                                                                                            : 0.0) +
          (penalty > 0 && l.inputs.size() == 1
               ? penalty * model.overlap_region_bytes(u, held, static_cast<int>(v), cv[k])
               : 0.0);
      cache.emplace(key, c);
      return c;
    };
    // Chains: the cheapest entry per choice of the producer, and the producer's splits by name.
    std::vector<int> same_entry;
    std::unordered_map<std::string, std::size_t> producer_index;
    if (key_by_choice_only && input_slot.size() == 1 && input_slot[0] >= 0) {
      const auto& pc = cands[static_cast<std::size_t>(l.inputs[0])];
      same_entry.assign(pc.size(), -1);
      for (std::size_t j = 0; j < pc.size(); ++j) producer_index.emplace(pc[j].to_string(), j);
      for (auto it = order.rbegin(); it != order.rend(); ++it)
        same_entry[static_cast<std::size_t>(prev[*it].key[static_cast<std::size_t>(input_slot[0])])] =
            static_cast<int>(*it);
    }
    for (std::size_t k = 0; k < cv.size(); ++k) {
      const int holds = cv[k].sample <= batch ? 1 : 0;
      double best_here[2] = {kInf, kInf};  // per value of the key's last element
      // On a chain, the cheapest entry whose layer chose this very split first: its edge is at
      // most a halo exchange (and, with a price of memory, its window's copy), so the bound it
      // sets cuts the scan of `order` short. (Visiting it twice changes nothing.)
      std::ptrdiff_t same = -1;
      if (!same_entry.empty()) {
        const auto it = producer_index.find(cv[k].to_string());
        if (it != producer_index.end()) same = same_entry[it->second];
      }
      for (std::ptrdiff_t n = same >= 0 ? -1 : 0; n < static_cast<std::ptrdiff_t>(order.size()); ++n) {
        const std::size_t oi = n < 0 ? static_cast<std::size_t>(same) : order[static_cast<std::size_t>(n)];
        const Entry& e = prev[oi];
        // With no other live layer, the key is this choice and the flag: an entry that alone
        // costs more than the best of every key it could reach cannot win.
        if (key_by_choice_only && e.cost + own[k] >= (holds ? best_here[1] : std::max(best_here[0], best_here[1])))
          break;
        const int flag = std::max(holds, e.key.back());
        double cost = e.cost + own[k];
        for (std::size_t a = 0; a < l.inputs.size(); ++a)
          cost += edge(a, input_slot[a] >= 0 ? e.key[static_cast<std::size_t>(input_slot[a])] : -1, k);
        ++outcome.states;
        std::vector<int> key;
        for (int slot : keep) key.push_back(e.key[static_cast<std::size_t>(slot)]);
        if (v_live) key.push_back(static_cast<int>(k));
        key.push_back(flag);
        const auto [it, inserted] = index.emplace(key, next.size());
        if (inserted) next.push_back(Entry{std::move(key), cost, static_cast<int>(oi), static_cast<int>(k)});
        else if (cost < next[it->second].cost) {
          next[it->second].cost = cost;
          next[it->second].parent = static_cast<int>(oi);
          next[it->second].choice = static_cast<int>(k);
        }
        best_here[flag] = std::min(best_here[flag], cost);
      }
    }
    if (static_cast<std::int64_t>(next.size()) > max_states) {
      // Keep the cheapest states (the result is then not provably optimal).
      std::nth_element(next.begin(), next.begin() + max_states, next.end(),
                       [](const Entry& a, const Entry& b) { return a.cost < b.cost; });
      next.resize(static_cast<std::size_t>(max_states));
      outcome.exact = false;
    }
    tables[v] = next;
    prev = std::move(next);
    std::vector<int> live_now;
    for (int slot : keep) live_now.push_back(prev_live[static_cast<std::size_t>(slot)]);
    if (v_live) live_now.push_back(static_cast<int>(v));
    prev_live = std::move(live_now);
  }
  // The cheapest final entry that gives rank 0 samples somewhere, then back through the parents.
  std::size_t best = prev.size();
  for (std::size_t i = 0; i < prev.size(); ++i)
    if (prev[i].key.back() == 1 && (best == prev.size() || prev[i].cost < prev[best].cost)) best = i;
  if (best == prev.size())
    fail_input("no plan of model '{}' at {} ranks gives rank 0 a sample in some layer (the batch of {} is smaller "
               "than the ranks, and no layer can be split otherwise under these options)",
               model.graph().model, model.options().ranks, model.graph().batch);
  outcome.choice.assign(L, 0);
  int entry = static_cast<int>(best);
  for (std::size_t v = L; v-- > 0;) {
    const Entry& e = tables[v][static_cast<std::size_t>(entry)];
    outcome.choice[v] = e.choice;
    entry = e.parent;
  }
  return outcome;
}

Plan plan_of(const PlannerGraph& graph, const std::vector<std::vector<LayerSplit>>& cands,
             const std::vector<int>& choice, int ranks) {
  // The most common split is the default; every other layer is listed.
  std::map<std::string, int> counts;
  for (std::size_t v = 0; v < graph.layers.size(); ++v)
    ++counts[cands[v][static_cast<std::size_t>(choice[v])].to_string()];
  std::string common;
  int most = 0;
  for (const auto& [s, n] : counts)
    if (n > most) most = n, common = s;
  LayerSplit default_split;
  std::map<std::string, LayerSplit> layers;
  for (std::size_t v = 0; v < graph.layers.size(); ++v) {
    const LayerSplit& s = cands[v][static_cast<std::size_t>(choice[v])];
    if (s.to_string() == common) default_split = s;
  }
  for (std::size_t v = 0; v < graph.layers.size(); ++v) {
    const LayerSplit& s = cands[v][static_cast<std::size_t>(choice[v])];
    if (!(s == default_split)) layers[graph.layers[v].name] = s;
  }
  // A spatial default would be refused on layers without spatial dimensions: list those instead.
  if (default_split.spatial_product() > 1) {
    for (std::size_t v = 0; v < graph.layers.size(); ++v)
      layers[graph.layers[v].name] = cands[v][static_cast<std::size_t>(choice[v])];
    default_split = LayerSplit{};
    default_split.sample = ranks;
  }
  return Plan::from_splits(ranks, default_split, std::move(layers),
                           fmt::format("<plan of {} for {} ranks>", graph.model, ranks));
}

}  // namespace

PlanResult plan_search(const PlannerGraph& graph, const Machine& machine, const PlannerOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  if (graph.layers.empty()) fail_input("the model has no layers to plan");
  CostModel model(graph, machine, options);
  const std::size_t L = graph.layers.size();
  std::vector<std::vector<LayerSplit>> cands(L);
  std::vector<std::vector<LayerEstimate>> estimates(L);
  std::vector<std::vector<double>> cost(L), memory(L);
  PlanResult result;
  const double hidden = machine.grad_overlap;
  for (std::size_t v = 0; v < L; ++v) {
    cands[v] = model.candidates(static_cast<int>(v));
    if (cands[v].empty())
      fail_input("no split of layer '{}' (output {}) fits {} ranks under these options", graph.layers[v].name,
                 graph.layers[v].output.to_string(), options.ranks);
    for (const auto& s : cands[v]) {
      const LayerEstimate e = model.layer_cost(static_cast<int>(v), s);
      cost[v].push_back(e.total() + (1.0 - hidden) * e.grad_allreduce + e.optimizer);
      // The price of memory, as CostModel::activation_bytes counts a plan's: the layer's weights,
      // gradients and optimizer state, its output and the output's gradient (a plan's gradients
      // share one arena, which holds less than their sum: per layer, the sum steers), its own
      // buffers (max pooling, dropout); its input copy goes on the edge that makes it (only a copy costs).
      // The bf16 operands' scratch too: a plan's is the largest layer's of each kind, not the sum;
      // counted per layer, the price still steers the search towards smaller rounded operands.
      const std::string& type = graph.layers[v].type;
      // A layer that may run in place has no output or gradient of its own unless it copies its
      // input: those go on the edge too.
      const double own_buffers = type == "maxpool" || type == "dropout" ? e.output_bytes : 0.0;
      const double own_output = model.may_run_in_place(static_cast<int>(v)) ? -e.output_bytes : e.output_bytes;
      memory[v].push_back(e.memory - e.input_bytes + own_output + own_buffers + e.scratch_input +
                          e.scratch_output + e.scratch_weights);
      estimates[v].push_back(e);
    }
    result.candidates += static_cast<std::int64_t>(cands[v].size());
  }
  // A search's choices priced as the plan file they make (the same terms as any plan).
  auto estimate_of = [&](const std::vector<int>& choice) {
    return model.estimate(plan_of(graph, cands, choice, options.ranks));
  };
  // Coordinate descent from `choice`: each layer's other splits, alone and with its producers on
  // the same split where they have it (no copy between them); `accept(trial)` takes a better plan
  // into `choice`. At most `sweeps` sweeps.
  auto descend = [&](std::vector<int>& choice, int sweeps, const auto& accept) {
    for (int sweep = 0, improved = 1; improved && sweep < sweeps; ++sweep) {
      improved = 0;
      for (std::size_t v = 0; v < L; ++v) {
        for (std::size_t k = 0; k < cands[v].size(); ++k) {
          if (static_cast<int>(k) == choice[v]) continue;
          std::vector<int> trial = choice;
          trial[v] = static_cast<int>(k);
          if (accept(trial)) improved = 1;
          bool moved = false;
          for (int u : graph.layers[v].inputs) {
            if (u < 0) continue;
            const auto& pc = cands[static_cast<std::size_t>(u)];
            const auto same = std::find(pc.begin(), pc.end(), cands[v][k]);
            if (same == pc.end()) continue;
            trial[static_cast<std::size_t>(u)] = static_cast<int>(same - pc.begin());
            moved = true;
          }
          if (moved && accept(trial)) improved = 1;
        }
      }
    }
  };
  // On a plan's exact memory, from the layers' cached estimates (no plan files, no exchanges:
  // memory does not depend on them); a plan where no layer gives rank 0 a sample is skipped, as
  // the search skips it. At most 16 sweeps.
  const std::int64_t batch = graph.batch;
  auto descend_memory = [&](std::vector<int>& choice) {
    auto bytes_of = [&](const std::vector<int>& c) {
      PlanEstimate e;
      bool holds = false;
      for (std::size_t v = 0; v < L; ++v) {
        e.layers.push_back(estimates[v][static_cast<std::size_t>(c[v])]);
        holds = holds || cands[v][static_cast<std::size_t>(c[v])].sample <= batch;
      }
      return holds ? model.memory_bytes(e) : std::numeric_limits<double>::infinity();
    };
    double best = bytes_of(choice);
    descend(choice, 16, [&](const std::vector<int>& trial) {
      const double bytes = bytes_of(trial);
      if (bytes >= best) return false;
      best = bytes;
      choice = trial;
      return true;
    });
  };
  // On the step time among plans that fit (full estimates: time depends on the exchanges), at
  // most 4 sweeps.
  auto descend_time = [&](std::vector<int>& choice, PlanEstimate& best) {
    descend(choice, 4, [&](const std::vector<int>& trial) {
      try {
        PlanEstimate e = estimate_of(trial);
        if (!e.fits || e.step_seconds >= best.step_seconds) return false;
        choice = trial;
        best = std::move(e);
        return true;
      } catch (const InputError&) {
        return false;  // not a valid plan
      }
    });
  };
  SearchOutcome outcome = run_dp(model, cands, estimates, cost, memory, 0.0);
  result.states += outcome.states;
  PlanEstimate estimate = estimate_of(outcome.choice);
  if (!estimate.fits) {
    // The least memory any plan needs first (time nearly free): when even that does not fit, no
    // plan does.
    SearchOutcome least_outcome = run_dp(model, cands, estimates, cost, memory, 1e12);
    result.states += least_outcome.states;
    PlanEstimate least = estimate_of(least_outcome.choice);
    // The search prices memory layer by layer; a plan's total counts a tensor its layers share
    // once and the largest transient and scratch rather than their sum, so the least-memory
    // search can miss a plan that needs less. From its plan, change one layer's split at a time
    // (or a layer's and its producers' together, to one split) while the exact total falls (the
    // result is also where the descent on time below starts).
    {
      std::vector<int> choice = least_outcome.choice;
      descend_memory(choice);
      try {
        PlanEstimate descended = estimate_of(choice);
        if (descended.memory_bytes < least.memory_bytes) least_outcome.choice = choice, least = std::move(descended);
      } catch (const InputError&) {
        // Not a valid plan after all: keep the search's.
      }
    }
    if (!least.fits)
      fail_input("no plan of model '{}' at {} ranks fits machine '{}' ({} per rank): the least memory the "
                 "planner found is {} per rank, {} more; use more ranks or a smaller batch",
                 graph.model, options.ranks, machine.name, bytes_text(machine.memory_per_rank),
                 bytes_text(least.memory_bytes), bytes_text(least.memory_bytes - machine.memory_per_rank));
    // Raise the price of memory until the plan fits: from the time per byte of the first plan
    // upwards by factors of 4.
    double penalty = estimate.step_seconds / std::max(1.0, estimate.memory_bytes);
    double below = 0;  // the largest price whose plan did not fit
    bool found = false;
    // A higher price can give a faster plan that fits too (the plans do not trade memory for time
    // monotonically): after the first that fits, four more prices, the fastest kept.
    for (int round = 0, after = 0; round < 24 && after < 5; ++round, penalty *= 4) {
      SearchOutcome o = run_dp(model, cands, estimates, cost, memory, penalty);
      result.states += o.states;
      PlanEstimate e = estimate_of(o.choice);
      if (found) ++after;
      if (!e.fits) {
        if (!found) below = penalty;
        continue;
      }
      if (!found || e.step_seconds < estimate.step_seconds)
        outcome = std::move(o), estimate = std::move(e), result.memory_penalty = penalty;
      if (!found) after = 1;
      found = true;
    }
    if (found && below > 0) {
      // Between the last price that did not fit and the first that did (a factor of 4 apart),
      // the fastest plan that fits: halve the interval (in log scale) six times.
      double low = below, high = 4 * below;
      for (int step = 0; step < 6; ++step) {
        const double middle = std::sqrt(low * high);
        SearchOutcome o = run_dp(model, cands, estimates, cost, memory, middle);
        result.states += o.states;
        PlanEstimate e = estimate_of(o.choice);
        if (!e.fits) {
          low = middle;
          continue;
        }
        high = middle;
        if (e.step_seconds < estimate.step_seconds)
          outcome = std::move(o), estimate = std::move(e), result.memory_penalty = middle;
      }
    }
    // Then faster plans that still fit, one layer's split at a time (or a layer's and its
    // producers' together): the price of memory is one number for every layer, the limit is not.
    // From the priced search's plan and from the least-memory plan (which the descent on memory
    // may have taken where the priced search cannot reach); the faster wins.
    if (found) descend_time(outcome.choice, estimate);
    descend_time(least_outcome.choice, least);
    if (!found || least.step_seconds < estimate.step_seconds) {
      outcome = std::move(least_outcome);
      estimate = std::move(least);
      result.memory_penalty = 1e12;
    }
  }
  result.exact = outcome.exact;
  result.plan = plan_of(graph, cands, outcome.choice, options.ranks);
  result.plan.validate(options.ranks, graph.plan_info());
  result.estimate = std::move(estimate);
  result.search_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

PlanResult choose_plan(const PlannerGraph& graph, const Machine& machine, const PlannerOptions& options,
                       double margin) {
  PlanResult best = plan_search(graph, machine, options);
  if (margin <= 0) return best;
  const auto start = std::chrono::steady_clock::now();
  const CostModel model(graph, machine, options);
  std::string simplest;
  Plan simplest_plan;
  PlanEstimate simplest_estimate;
  // Pure batch first (no exchanges between layers, one gradient allreduce that overlaps
  // backward), else the cheapest of the others within the margin.
  for (auto& [name, plan] : reference_plans(model)) {
    PlanEstimate e = model.estimate(plan);
    if (!e.fits || e.step_seconds > best.estimate.step_seconds * (1.0 + margin)) continue;
    if (simplest.empty() || name == "pure batch" || e.step_seconds < simplest_estimate.step_seconds)
      simplest = name, simplest_plan = std::move(plan), simplest_estimate = std::move(e);
    if (simplest == "pure batch") break;
  }
  best.search_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (simplest.empty()) return best;
  bool same = simplest_estimate.layers.size() == best.estimate.layers.size();
  for (std::size_t i = 0; same && i < best.estimate.layers.size(); ++i)
    same = simplest_estimate.layers[i].split == best.estimate.layers[i].split;
  if (same) return best;
  best.optimum_seconds = best.estimate.step_seconds;
  best.simpler_choice = simplest;
  best.plan = std::move(simplest_plan);
  best.estimate = std::move(simplest_estimate);
  return best;
}

}  // namespace tessera
