#pragma once
// The planner as the commands use it (plan_command.cpp): `tessera plan` and `tessera train --plan auto`.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "tessera/parallel/planner.hpp"
#include "tessera/parallel/sync.hpp"
#include "tessera/train/model.hpp"

namespace tessera {

/// How close (a fraction of the step) a pure plan's prediction must come to the search's optimum
/// for the commands to prefer it (choose_plan): the planner's median error on this project's machines.
constexpr double kDefaultPlanMargin = 0.10;

/// Planner options for a job of `ranks` ranks training with `optimizer` (sgd, adam, adamw).
PlannerOptions planner_options(int ranks, const std::string& optimizer);
/// The planner options of a `tessera train` job from its own options (train_option(name): the
/// value given, if any): --optimizer, --bf16-convolutions (exact: Bf16Convolutions::Exact on GPUs,
/// whose scratch is twice Native's), --halo-overlap (overlapping convolutions keep region copies).
PlannerOptions job_planner_options(int ranks, const std::function<std::optional<std::string>(const char*)>& train_option);
/// The planner's plan of `model` for `options.ranks` ranks on the machine of `machine_file`;
/// `report` gets a summary and the plan's YAML. InputError when the machine file is missing or
/// bad or no plan fits.
Plan auto_plan(const Model& model, const std::string& machine_file, const PlannerOptions& options, std::int64_t batch,
               std::string& report);
/// Refuses, with an InputError naming the plan's largest layer and the bytes, a job plan whose
/// estimated peak per rank (weights, gradients, optimizer state, activations: CostModel; plus the
/// synchronizer's buffers under `sync` over `groups` replica groups) exceeds `limit` bytes;
/// `limit_source` says where the limit comes from. Reads only shapes, so it runs before anything
/// is allocated. Returns false where the plan fits only with no output written into a halo window
/// (options.outputs_into_windows: the windows may grow the arena a little): the executor must then
/// run with ExecutorOptions::into_windows off. `gpu`: the job's ranks run on GPUs (the step plan's
/// options there).
bool check_plan_memory(const Model& model, const Plan& job_plan, const PlannerOptions& options, std::int64_t batch,
                       double limit, const std::string& limit_source, const SyncOptions& sync = {}, int groups = 1,
                       bool gpu = false);
/// Bytes of the largest block of parameters (fp32) that a rank of `job_plan` holds.
double parameter_bytes_per_rank(const Model& model, const Plan& job_plan);

}  // namespace tessera
