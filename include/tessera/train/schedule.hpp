#pragma once
// Learning-rate schedules: a peak learning rate (base_lr, optionally scaled by the linear
// scaling rule), a linear warm-up, and a decay (constant, step, cosine).
//
// Steps count optimizer steps from 0. lr(s) is the rate used by step s:
//   peak    = base_lr * global_batch / reference_batch   (reference_batch > 0), else base_lr
//   decayed = peak                                              constant
//           = peak * gamma^floor(s / step_size)                 step (counted from step 0)
//           = min_lr + (peak - min_lr) * (1 + cos(pi * t)) / 2  cosine,
//             t = clamp((s - warmup_steps) / (total_steps - warmup_steps), 0, 1)
//   lr(s)   = decayed * (s + 1) / warmup_steps   for s < warmup_steps  (from ~0 up to the peak)
//           = decayed                            otherwise
// min_lr is absolute (not scaled by the linear scaling rule).
#include <cstdint>
#include <string>
#include <vector>

namespace tessera {

struct ScheduleConfig {
  /// "constant", "step" or "cosine".
  std::string type = "constant";
  double base_lr = 0.01;
  /// Linear warm-up length (every type); 0: none.
  std::int64_t warmup_steps = 0;
  /// step: multiply by gamma every step_size steps.
  std::int64_t step_size = 0;
  double gamma = 0.1;
  /// cosine: the rate reached at total_steps (and kept after it).
  double min_lr = 0;
  /// cosine: length of the run, warm-up included (must exceed warmup_steps).
  std::int64_t total_steps = 0;
  /// 0: no scaling; else the peak rate is base_lr * global_batch / reference_batch.
  std::int64_t reference_batch = 0;
};

class LrSchedule {
 public:
  /// Validates the configuration (InputError with the field at fault) for a run whose
  /// global batch (samples per step over all ranks) is `global_batch`.
  LrSchedule(ScheduleConfig config, std::int64_t global_batch);

  /// Learning rate of optimizer step `step` (>= 0).
  double lr(std::int64_t step) const;
  /// The rate after warm-up, before any decay (base_lr after linear scaling).
  double peak_lr() const { return peak_lr_; }
  const ScheduleConfig& config() const { return config_; }

 private:
  ScheduleConfig config_;
  double peak_lr_ = 0;
};

/// The schedule type names LrSchedule accepts.
std::vector<std::string> schedule_types();

}  // namespace tessera
