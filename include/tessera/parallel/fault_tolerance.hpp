#pragma once
// Replica groups that outlive each other: each group is its own MPI job (fail-fast inside), and
// rank q of every group talks to rank q of the others over Gloo's TCP transport, meeting through
// a store folder that every group reaches (a shared file system). A quorum of live groups commits
// each step; a group that fails is dropped; a restarted one joins the next quorum and is healed
// from a live peer. The protocol, its timeouts and what it guarantees: docs/fault_tolerance.md.
#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/communicator.hpp"
#include "tessera/tensor/tensor.hpp"

namespace tessera {

struct FaultToleranceOptions {
  /// The folder every group reaches (empty: fault tolerance off).
  std::string store;
  /// This group's index and how many groups the job has.
  int group = 0;
  int groups = 1;
  /// No step is committed by fewer live groups than this.
  int min_groups = 1;
  /// Seconds a quorum forming after a failure waits for the groups of the last quorum.
  double join_window = 1;
  /// Seconds the first quorum (and one formed by restarted groups only) waits for every group.
  double start_window = 60;
  /// Seconds an exchange across groups waits for a silent peer before counting it as failed.
  double peer_timeout = 30;
  /// Seconds a group waits for a quorum of min_groups before it gives up (an error).
  double quorum_timeout = 600;
  /// What every group must agree on, as (what, value): the model, the plan, the seed, the batch.
  std::vector<std::pair<std::string, std::string>> identity;
  /// Set (by a signal handler) to stop waiting for a quorum (may be null).
  const std::atomic<bool>* stop_request = nullptr;
};

/// Refuses bad options (InputError): groups < 1, min_groups outside [1, groups], a group index
/// out of range, timeouts <= 0, an empty store.
void check_fault_tolerance(const FaultToleranceOptions& options);

/// What this group saw of failures, quorums and heals (in the summary; logged as they happen).
struct ReplicaStats {
  std::int64_t failures = 0;     ///< exchanges that failed because a peer group was gone
  std::int64_t quorums = 0;      ///< quorums this group was a member of
  std::int64_t heals = 0;        ///< times this group received the state from a peer
  double heal_seconds = 0;       ///< spent receiving it
  double heal_bytes = 0;         ///< bytes received (this rank)
  double served_bytes = 0;       ///< bytes this rank sent to heal others
  double quorum_seconds = 0;     ///< spent forming quorums, healing included
};

/// Where training stands: what travels with the state when a group is healed.
struct TrainingPosition {
  std::int64_t step = 0;             ///< the next step to run
  std::int64_t optimizer_steps = 0;  ///< the optimizer's step count
};

class ReplicaSet {
 public:
  /// Collective over `group` (this group's ranks). Records the identity in the store, or checks it
  /// against the one there (InputError naming what differs, on every rank of the group).
  ReplicaSet(FaultToleranceOptions options, Communicator& group);
  ~ReplicaSet();
  ReplicaSet(const ReplicaSet&) = delete;
  ReplicaSet& operator=(const ReplicaSet&) = delete;

  /// Forms a quorum that includes this group (collective over the group) and brings every member
  /// to the state of the member furthest ahead: where a member's differs (a restarted group, one
  /// that missed a commit, or one that committed in another quorum), `state` (this rank's tensors;
  /// rank q of every group holds the same list) and `position` become that member's. Returns
  /// Finished, changing nothing, when training has finished already (finish()), and Stopped when
  /// a stop was requested (FaultToleranceOptions::stop_request) while waiting for the quorum.
  enum class Joined { Member, Finished, Stopped };
  Joined join(TrainingPosition& position, const std::vector<Tensor*>& state);

  struct Outcome {
    /// Every rank of this group averaged with every member: the mean is in the tensors. Else a
    /// peer failed: the tensors hold garbage and join() must come next.
    bool committed = false;
    /// A group waits to join: call join() after this step's update.
    bool regroup = false;
  };
  /// Replaces `tensors` by their mean over the quorum's groups (collective over the group).
  Outcome average(const std::vector<Tensor*>& tensors);

  /// The state was restored from this group's own checkpoint: the next join() takes it as
  /// different from every other group's, unless it is the one furthest ahead.
  void restored_from_checkpoint();
  /// Sums `values` over the quorum's groups in place (collective over the group): whether every
  /// rank of the group did; on false the values are void, and the next average() fails too.
  bool sum(std::span<double> values);

  /// Groups in the current quorum, and this group's place among them.
  int members() const;
  int place() const;
  /// After the last step: groups that join later learn that training has finished.
  void finish(std::int64_t step);
  const ReplicaStats& stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera
