// The planner as `tessera train --plan auto` and `tessera job --plan auto` use it.
#include "plan_auto.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "tessera/core/error.hpp"

namespace tessera {

PlannerOptions planner_options(int ranks, const std::string& optimizer) {
  PlannerOptions options;
  options.ranks = ranks;
  if (optimizer == "sgd") options.optimizer_state = 1;
  else if (optimizer == "adam" || optimizer == "adamw") options.optimizer_state = 2;
  else fail_input("unknown optimizer '{}' (known: sgd, adam, adamw)", optimizer);
  return options;
}

PlannerOptions job_planner_options(int ranks,
                                   const std::function<std::optional<std::string>(const char*)>& train_option) {
  PlannerOptions options = planner_options(ranks, train_option("--optimizer").value_or("sgd"));
  options.exact_bf16_convolutions = train_option("--bf16-convolutions") == std::optional<std::string>("exact");
  if (const auto overlap = train_option("--halo-overlap")) options.halo_overlap = parse_halo_overlap(*overlap);
  return options;
}

Plan auto_plan(const Model& model, const std::string& machine_file, const PlannerOptions& options, std::int64_t batch,
               std::string& report) {
  if (machine_file.empty())
    fail_input("--plan auto needs --machine FILE: a machine file written by 'tessera calibrate', or one of machines/");
  const Machine machine = Machine::load(machine_file);
  const PlannerGraph graph = model.planner_graph(batch);
  const int ranks = options.ranks;
  const PlanResult result = choose_plan(graph, machine, options, kDefaultPlanMargin);
  report = fmt::format("planned for {} ranks on '{}' in {:.3f} s: predicted step {:.3f} ms, {:.1f} MiB per rank{}\n",
                       ranks, machine.name, result.search_seconds, 1e3 * result.estimate.step_seconds,
                       result.estimate.memory_bytes / (1 << 20),
                       result.simpler_choice.empty()
                           ? std::string()
                           : fmt::format(" ({}: within {:.0f} % of the optimum's {:.3f} ms)", result.simpler_choice,
                                         100 * kDefaultPlanMargin, 1e3 * result.optimum_seconds)) +
           result.plan.to_yaml();
  return result.plan;
}

double parameter_bytes_per_rank(const Model& model, const Plan& job_plan) {
  double elements = 0;
  for (const auto& node : model.nodes()) {
    const LayerSplit& split = job_plan.split_for(node.layer->name());
    for (const Parameter* p : const_cast<Layer&>(*node.layer).parameters()) {
      const auto shape = p->whole_shape();
      double n = 1;
      for (auto d : shape) n *= static_cast<double>(d);
      // Weights split by filter and channel, biases and per-channel parameters by filter (the
      // largest block: blocks round up).
      const double parts = split.filter * (shape.size() >= 2 ? split.channel : 1);
      elements += std::ceil(n / parts);
    }
  }
  return 4 * elements;
}

bool check_plan_memory(const Model& model, const Plan& job_plan, const PlannerOptions& options, std::int64_t batch,
                       double limit, const std::string& limit_source, const SyncOptions& sync, int groups,
                       bool gpu) {
  const double copies = sync_buffer_copies(sync, groups);
  const double buffers = copies * parameter_bytes_per_rank(model, job_plan);
  Machine machine;  // memory needs no rates, only room for the job's ranks
  machine.device = gpu ? "gpu" : "cpu";
  machine.nodes = 1;
  machine.ranks_per_node = options.ranks;
  machine.memory_per_rank = limit - buffers;
  const PlannerGraph graph = model.planner_graph(batch);
  const CostModel cost(graph, machine, options);
  const PlanEstimate e = cost.estimate(job_plan);
  if (e.fits) return e.outputs_into_windows;
  // The layer holding the most of its own: weights, their gradients and optimizer state, and its
  // output (a layer running in place has none: it is its input's; nor has a convolution that
  // makes its pooling's output, StepPlan::pooled_by).
  const StepPlan step = cost.step_plan(e);
  const auto own = [&](std::size_t i) {
    const LayerEstimate& l = e.layers[i];
    const bool none = cost.may_run_in_place(static_cast<int>(i)) || step.arena.output[i] == TransientArena::kNone;
    return l.memory - l.input_bytes - (none ? l.output_bytes : 0.0);
  };
  std::size_t most = 0;
  for (std::size_t i = 1; i < e.layers.size(); ++i)
    if (own(i) > own(most)) most = i;
  const LayerEstimate* largest = &e.layers[most];
  constexpr double kMiB = 1 << 20;
  const std::string synchronizer =
      buffers > 0 ? fmt::format(", and {:.1f} MiB of --sync {}'s buffers ({:g} copies of the rank's parameters)",
                                buffers / kMiB, sync.mode, copies)
                  : std::string();
  fail_input("this plan needs about {:.1f} MiB per rank (weights, gradients, optimizer state and activations, as "
             "the planner estimates them{}), more than the {:.1f} MiB a rank has ({}); its largest layer, '{}' ({}), "
             "holds {:.1f} MiB of it on a rank: split it by filter or channel over more ranks, or let --plan auto "
             "--machine FILE choose",
             (e.memory_bytes + buffers) / kMiB, synchronizer, limit / kMiB, limit_source, largest->name,
             largest->split.to_string(), own(most) / kMiB);
}

}  // namespace tessera
