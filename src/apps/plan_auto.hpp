#pragma once
// The planner as the commands use it (plan_command.cpp): `tessera plan` and `tessera train --plan auto`.
#include <cstdint>
#include <string>

#include "tessera/parallel/planner.hpp"
#include "tessera/train/model.hpp"

namespace tessera {

/// How close (a fraction of the step) a pure plan's prediction must come to the search's optimum
/// for the commands to prefer it (choose_plan): the planner's median error on this project's machines.
constexpr double kDefaultPlanMargin = 0.10;

/// Planner options for a job of `ranks` ranks training with `optimizer` (sgd, adam, adamw).
PlannerOptions planner_options(int ranks, const std::string& optimizer);
/// The planner's plan of `model` for `ranks` ranks on the machine of `machine_file`; `report`
/// gets a summary and the plan's YAML. InputError when the machine file is missing or bad or no
/// plan fits. `exact_bf16_convolutions`: the job runs bf16 convolutions as Bf16Convolutions::Exact
/// on GPUs (`tessera train --bf16-convolutions exact`), whose scratch is twice Native's.
Plan auto_plan(const Model& model, const std::string& machine_file, int ranks, std::int64_t batch,
               const std::string& optimizer, std::string& report, bool exact_bf16_convolutions = false);

}  // namespace tessera
