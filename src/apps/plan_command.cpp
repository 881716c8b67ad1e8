// `tessera plan`: the planner's command. Writes the cheapest plan of a model at a rank count on a
// machine (a machine file: measured here by `tessera calibrate`, or one of a published system in
// machines/), with its predicted per-layer costs (a pure plan within --margin of the optimum is
// preferred: see choose_plan); --explain compares it with the pure batch,
// spatial and model plans; --evaluate prices a given plan file instead of searching.
#include <fmt/format.h>

#include <algorithm>
#include <fstream>

#include "commands.hpp"
#include "plan_auto.hpp"
#include "tessera/core/error.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/parallel/planner.hpp"
#include "tessera/train/model.hpp"

namespace tessera {
namespace {

struct PlanArgs {
  std::string model, machine, output, evaluate, references, optimizer = "sgd";
  int ranks = 1;
  std::int64_t batch = 64;
  bool explain = false;
  bool no_spatial = false, no_model = false;
  std::string bf16_convolutions = "native";
  std::string halo_overlap = "auto";
  std::int64_t max_states = 200000;
  double margin = kDefaultPlanMargin;
};

/// Where the machine file gives ranges: the plan's step at their slow and fast ends.
std::string step_range(const PlannerGraph& graph, const Machine& machine, const PlannerOptions& options,
                       const Plan& plan) {
  if (!machine.has_ranges()) return {};
  const Machine slow = machine.at(Bound::Slow), fast = machine.at(Bound::Fast);
  const double slow_step = CostModel(graph, slow, options).estimate(plan).step_seconds;
  const double fast_step = CostModel(graph, fast, options).estimate(plan).step_seconds;
  return fmt::format("predicted step range {:.6f} to {:.6f} s (the machine file's high and low efficiencies "
                     "and step overheads)\n",
                     fast_step, slow_step);
}

void run_plan(Communicator& world, const PlanArgs& args) {
  std::string text;
  collectively(world, [&] {
    ModelOptions shapes_only;  // the planner reads shapes: nothing of the weights is allocated here
    shapes_only.allocate_parameters = false;
    const Model model = Model::load(args.model, shapes_only);
    const Machine machine = Machine::load(args.machine);
    const PlannerGraph graph = model.planner_graph(args.batch);
    PlannerOptions options = planner_options(args.ranks, args.optimizer);
    options.allow_spatial = !args.no_spatial;
    options.allow_model = !args.no_model;
    options.max_states = args.max_states;
    options.exact_bf16_convolutions = args.bf16_convolutions == "exact";
    options.halo_overlap = parse_halo_overlap(args.halo_overlap);
    const CostModel cost(graph, machine, options);
    const std::string header = fmt::format("model {} ({}), batch {}, {} ranks on machine '{}' ({})\n", model.name(),
                                           args.model, args.batch, args.ranks, machine.name, args.machine);
    if (!args.evaluate.empty()) {
      const Plan plan = Plan::load(args.evaluate);
      const PlanEstimate e = cost.estimate(plan);
      text = header + fmt::format("predicted cost of plan {}:\n", args.evaluate) + format_estimate(e);
      text += fmt::format("predicted step {:.6f} s\n", e.step_seconds) + step_range(graph, machine, options, plan);
      return;
    }
    const PlanResult result = choose_plan(graph, machine, options, args.margin);
    text = header + format_estimate(result.estimate);
    if (!result.simpler_choice.empty())
      text += fmt::format("chosen: the {} plan, predicted within {:.0f} % of the search's optimum ({:.3f} ms; "
                          "--margin 0 takes the optimum)\n",
                          result.simpler_choice, 100 * args.margin, 1e3 * result.optimum_seconds);
    text += fmt::format("search: {} candidate splits over {} layers, {} states, {:.3f} s{}{}\n", result.candidates,
                        graph.layers.size(), result.states, result.search_seconds,
                        result.exact ? " (exact)" : " (states were capped: not provably optimal)",
                        result.memory_penalty > 0 ? fmt::format("; memory penalty {:.3g} s/byte", result.memory_penalty)
                                                  : std::string());
    text += fmt::format("predicted step {:.6f} s\n", result.estimate.step_seconds);
    text += step_range(graph, machine, options, result.plan);
    if (args.explain) {
      text += "\ncompared with:\n";
      text += fmt::format("  {:<14} {:>12} {:>12} {:>14}\n", "plan", "step ms", "vs chosen", "memory MiB");
      text += fmt::format("  {:<14} {:>12.3f} {:>12} {:>14.1f}\n", "chosen", 1e3 * result.estimate.step_seconds,
                          "1.00x", result.estimate.memory_bytes / (1 << 20));
      for (const auto& [name, plan] : reference_plans(cost)) {
        const PlanEstimate e = cost.estimate(plan);
        if (!args.references.empty() && world.rank() == 0) {
          std::string file = name;
          std::replace(file.begin(), file.end(), ' ', '_');
          file = args.references + "/" + file + ".yaml";
          std::ofstream out(file);
          out << fmt::format("# The {} plan of model {} at {} ranks (tessera plan --explain).\n", name, model.name(),
                             args.ranks)
              << plan.to_yaml();
          if (!out) fail_input("cannot write '{}'", file);
        }
        text += fmt::format("  {:<14} {:>12.3f} {:>11.2f}x {:>14.1f}{}\n", name, 1e3 * e.step_seconds,
                            e.step_seconds / result.estimate.step_seconds, e.memory_bytes / (1 << 20),
                            e.fits ? "" : "  does not fit");
      }
    }
    const std::string yaml = fmt::format("# Written by tessera plan for model {} ({}), batch {}, machine '{}'.\n"
                                         "# Predicted step {:.3f} ms, memory per rank {:.1f} MiB.\n",
                                         model.name(), args.model, args.batch, machine.name,
                                         1e3 * result.estimate.step_seconds,
                                         result.estimate.memory_bytes / (1 << 20)) +
                             result.plan.to_yaml();
    if (!args.output.empty() && world.rank() == 0) {
      std::ofstream out(args.output);
      if (!out) fail_input("cannot write the plan to '{}'", args.output);
      out << yaml;
      if (!out) fail_input("cannot write the plan to '{}'", args.output);
      text += fmt::format("plan written to {}\n", args.output);
    } else if (args.output.empty()) {
      text += "\n" + yaml;
    }
  });
  if (world.rank() == 0) {
    fmt::print("{}", text);
    std::fflush(stdout);
  }
}

}  // namespace

std::function<void(Communicator&)> add_plan_command(CLI::App& app) {
  auto args = std::make_shared<PlanArgs>();
  auto* cmd = app.add_subcommand("plan", "Write the planner's plan for a model, rank count and machine");
  cmd->add_option("--model", args->model, "Model file (YAML)")->required()->check(CLI::ExistingFile);
  cmd->add_option("--ranks", args->ranks, "Ranks of the job to plan for")->required()->check(CLI::PositiveNumber);
  cmd->add_option("--machine", args->machine,
                  "Machine file: written by 'tessera calibrate', or a published system's in machines/")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--batch", args->batch, "Global batch size")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--optimizer", args->optimizer, "sgd, adam or adamw (optimizer state in the memory estimate)")
      ->capture_default_str();
  cmd->add_option("-o,--output", args->output, "Write the plan file here (default: print it)");
  cmd->add_flag("--explain", args->explain, "Compare the plan with the pure batch, spatial and model plans");
  cmd->add_option("--evaluate", args->evaluate, "Print the predicted costs of this plan file instead of searching")
      ->check(CLI::ExistingFile);
  cmd->add_option("--references-dir", args->references,
                  "With --explain: also write the compared plans there (pure_batch.yaml, pure_spatial.yaml, pure_model.yaml)")
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--margin", args->margin,
                  "Prefer a pure batch, spatial or model plan predicted within this fraction of the optimum "
                  "(fewer exchanges, less exposed to what the cost model does not see; 0: the optimum)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--bf16-convolutions", args->bf16_convolutions,
                  "On GPU machines, how the job runs bf16 convolutions (tessera train --bf16-convolutions): native "
                  "(bf16 buffers, bf16 tensor cores) or exact (fp32 copies, TF32 tensor cores)")
      ->capture_default_str()
      ->check(CLI::IsMember({"native", "exact"}));
  cmd->add_option("--halo-overlap", args->halo_overlap,
                  "How the job overlaps halo exchanges (tessera train --halo-overlap: auto, always, never): an "
                  "overlapping convolution keeps copies of its boundary regions")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "always", "never"}));
  cmd->add_flag("--no-spatial", args->no_spatial, "Do not split layers spatially");
  cmd->add_flag("--no-model", args->no_model, "Do not split layers by filter or channel");
  cmd->add_option("--max-states", args->max_states, "Bound of the search's states on DAGs (chains never reach it)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  return [args, cmd](Communicator& world) {
    if (!cmd->parsed()) return;
    run_plan(world, *args);
  };
}

}  // namespace tessera
