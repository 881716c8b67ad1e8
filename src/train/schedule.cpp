#include "tessera/train/schedule.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "tessera/core/error.hpp"

namespace tessera {

std::vector<std::string> schedule_types() { return {"constant", "step", "cosine"}; }

LrSchedule::LrSchedule(ScheduleConfig config, std::int64_t global_batch) : config_(std::move(config)) {
  const ScheduleConfig& c = config_;
  const bool step = c.type == "step";
  const bool cosine = c.type == "cosine";
  if (!step && !cosine && c.type != "constant") {
    fail_input("lr schedule: unknown type '{}' (known: constant, step, cosine)", c.type);
  }
  if (!std::isfinite(c.base_lr) || c.base_lr < 0) {
    fail_input("lr schedule: base_lr must be finite and >= 0, got {}", c.base_lr);
  }
  if (c.warmup_steps < 0) fail_input("lr schedule: warmup_steps must be >= 0, got {}", c.warmup_steps);
  if (c.reference_batch < 0) {
    fail_input("lr schedule: reference_batch must be >= 0 (0: no linear scaling), got {}", c.reference_batch);
  }
  if (c.reference_batch > 0 && global_batch <= 0) {
    fail_input("lr schedule: linear scaling (reference_batch {}) needs the global batch size, got {}",
               c.reference_batch, global_batch);
  }
  peak_lr_ = c.reference_batch > 0
                 ? c.base_lr * static_cast<double>(global_batch) / static_cast<double>(c.reference_batch)
                 : c.base_lr;

  if (step) {
    if (c.step_size <= 0) fail_input("lr schedule 'step': step_size must be > 0, got {}", c.step_size);
    if (!std::isfinite(c.gamma) || c.gamma <= 0) {
      fail_input("lr schedule 'step': gamma must be finite and > 0, got {}", c.gamma);
    }
  } else if (c.step_size != 0) {
    fail_input("lr schedule '{}': step_size applies to type 'step' only", c.type);
  }
  if (cosine) {
    if (c.total_steps <= 0) {
      fail_input("lr schedule 'cosine': total_steps (the run's length, warm-up included) must be > 0");
    }
    if (c.total_steps <= c.warmup_steps) {
      fail_input("lr schedule 'cosine': total_steps ({}) must exceed warmup_steps ({})", c.total_steps,
                 c.warmup_steps);
    }
    if (!std::isfinite(c.min_lr) || c.min_lr < 0 || c.min_lr > peak_lr_) {
      fail_input("lr schedule 'cosine': min_lr must be in [0, peak lr {}], got {}", peak_lr_, c.min_lr);
    }
  } else if (c.min_lr != 0) {
    fail_input("lr schedule '{}': min_lr applies to type 'cosine' only", c.type);
  }
}

double LrSchedule::lr(std::int64_t step) const {
  if (step < 0) fail_input("lr schedule: step must be >= 0, got {}", step);
  const ScheduleConfig& c = config_;
  double rate = peak_lr_;
  if (c.type == "step") {
    rate = peak_lr_ * std::pow(c.gamma, static_cast<double>(step / c.step_size));
  } else if (c.type == "cosine") {
    const double span = static_cast<double>(c.total_steps - c.warmup_steps);
    const double t = std::clamp(static_cast<double>(step - c.warmup_steps) / span, 0.0, 1.0);
    rate = c.min_lr + (peak_lr_ - c.min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * t));
  }
  if (step < c.warmup_steps) {
    rate *= static_cast<double>(step + 1) / static_cast<double>(c.warmup_steps);
  }
  return rate;
}

}  // namespace tessera
