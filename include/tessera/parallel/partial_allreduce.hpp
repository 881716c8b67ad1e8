#pragma once
// eager's partial collective: a sum over replica groups, one round per step, that fires once a
// quorum of groups (solo: one; majority: more than half) handed their gradient of that step, within
// a staleness bound. A group that misses a round hands its gradient to a later one, so every
// gradient is summed exactly once and at most `staleness` rounds late, and every group receives the
// same sum for every round. An agent thread per rank carries the rounds, so a busy or sleeping
// group still takes part in the rounds it misses. Rules and sources: docs/sync.md.
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "tessera/core/communicator.hpp"

namespace tessera {

/// One round's outcome, the same in every group.
struct PartialRound {
  std::vector<float> sum;     ///< the sum of every contribution of the round
  int contributors = 0;       ///< groups that put a gradient into it
  std::int64_t staleness = 0; ///< the oldest contribution's age, in rounds (0: all of this step)
  double wait_seconds = 0;    ///< how long result() waited for the round
};

/// A gradient handed to the rounds and not summed yet.
struct PartialItem {
  std::int64_t step = 0;
  std::vector<float> values;
};

class PartialAllreduce {
 public:
  /// `across`: rank q of every group (its rank is the group); `group`: this group's ranks (rank 0
  /// decides when this group's ranks contribute). Rounds begin at `first`; `pending` holds gradients
  /// handed before it and not summed yet (from a checkpoint). Starts the agent thread.
  PartialAllreduce(Communicator& across, Communicator& group, int quorum, int staleness, std::size_t count,
                   std::int64_t first, std::vector<PartialItem> pending = {});
  /// Ends the rounds; every rank must have taken the result of the same last round (a rank that
  /// fails alone ends the job instead: Trainer::run aborts).
  ~PartialAllreduce();
  PartialAllreduce(const PartialAllreduce&) = delete;
  PartialAllreduce& operator=(const PartialAllreduce&) = delete;

  /// Hands this group's gradient of `step` (steps in order, one each).
  void contribute(std::int64_t step, const float* values);
  /// Waits for round `step` and returns it (once per step, in order).
  PartialRound result(std::int64_t step);
  /// The gradients handed and not summed yet (between steps: nothing is in flight then).
  std::vector<PartialItem> pending() const;

 private:
  void run();
  void lead();
  void follow();
  /// Sums this rank's items of steps up to `upto` into round `round` across groups and publishes it.
  void fire(std::int64_t round, std::int64_t upto);

  Communicator& across_;
  Communicator& group_;
  const int quorum_, staleness_;
  const std::size_t count_;
  std::int64_t next_round_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<PartialItem> items_;
  std::int64_t handed_;  ///< the newest step handed (first − 1 before any)
  std::map<std::int64_t, PartialRound> results_;
  bool stop_ = false;
  bool failed_ = false;
  std::thread agent_;
};

}  // namespace tessera
