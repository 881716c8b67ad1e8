#pragma once
// A testing aid for straggler experiments on one machine (--inject-straggler): which replica
// groups sleep after a step's compute, and for how long, as a pure function of (seed, step, group),
// so that every rank and every run draws the same schedule without communicating.
#include <cstdint>
#include <string>
#include <vector>

namespace tessera {

struct StragglerSpec {
  enum class Kind { None, Slow, Random, Tail };
  Kind kind = Kind::None;
  /// Slow: the groups that are slow, by `factor` (their steps take factor times their compute).
  std::vector<int> groups;
  double factor = 1;
  /// Random: how many groups each step delays, by `seconds`, or with `relative` by `factor` times
  /// the step's compute.
  int count = 0;
  bool relative = false;
  /// Random: the delay; tail: the mean of the exponential delay every group draws every step.
  double seconds = 0;
  bool any() const { return kind != Kind::None; }
};

/// "slow:GROUPS:FACTORx" (GROUPS: comma-separated group indices, e.g. slow:1:2x), "random:K:DELAY"
/// (DELAY in ms or s, or a multiple of the step's compute such as 2x), "tail:MEAN" (e.g. tail:10ms),
/// "" or "none"; an InputError naming --inject-straggler otherwise.
StragglerSpec parse_straggler(const std::string& text);

/// Checks `spec` against a job of `groups` replica groups (groups that do not exist, more random
/// groups than there are): an InputError naming them.
void check_straggler(const StragglerSpec& spec, int groups);

/// Seconds that group `group` of `groups` sleeps after step `step`, whose compute took
/// `compute_seconds` (the same on every rank and every run for a seed).
double straggler_delay(const StragglerSpec& spec, std::uint64_t seed, std::int64_t step, int group, int groups,
                       double compute_seconds);

/// The groups straggler_delay delays at `step` under a Random spec (sorted).
std::vector<int> delayed_groups(const StragglerSpec& spec, std::uint64_t seed, std::int64_t step, int groups);

}  // namespace tessera
