#pragma once
// What crosses replica groups, and when: the one place where a synchronization mode (sync.hpp)
// is carried out. The trainer calls it at step boundaries; the executor only needs to know whether
// gradients are summed over all groups (bsp) or within each group (every other mode: the
// synchronizer does the rest). Rank q of every group holds the same shard, so everything that
// crosses groups runs on one communicator: rank q of every group. The update rules and their
// sources: docs/sync.md.
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/communicator.hpp"
#include "tessera/parallel/delayed_communicator.hpp"
#include "tessera/parallel/partial_allreduce.hpp"
#include "tessera/parallel/sync.hpp"
#include "tessera/tensor/tensor.hpp"

namespace tessera {

/// This rank's block of one parameter, as the synchronizer keeps it across groups.
struct SyncTensor {
  std::string name;
  Tensor* value = nullptr;
  /// Its gradient, summed within the group (every mode but bsp) or over all groups (bsp).
  Tensor* grad = nullptr;
  /// 1 / the ranks of the group that hold this same block, so that norms summed over all ranks
  /// count each block once per group.
  double norm_weight = 1;
  /// The optimizer's state tensors of this parameter (averaged with the parameter by local_sgd
  /// with `optimizer_state`; kept per group otherwise).
  std::vector<Tensor*> optimizer_state;
};

/// What the synchronizer did so far (in checkpoints; each metrics row carries it).
struct SyncStats {
  std::int64_t syncs = 0;            ///< exchanges across groups (bsp and adascale: every step)
  double bytes = 0;                  ///< bytes this rank put into the training's exchanges across groups
  double gain = 1;                   ///< AdaScale's gain r_t of the last step (1 otherwise)
  double scaled_time = 0;            ///< AdaScale's schedule position: the sum of the gains
  std::optional<double> consensus;   ///< ‖x_g − mean‖ / ‖mean‖ over groups at the last measure
  double gain_variance = 0, gain_square = 0;  ///< AdaScale's moving averages (not debiased)
  std::int64_t gain_updates = 0;     ///< how many steps fed them
  /// ssp, eager: how old (in steps) the oldest gradient in the last update was (ssp: the other
  /// groups' folded in; 0: none yet), and the seconds spent waiting for the other groups.
  std::int64_t staleness = 0;
  double wait_seconds = 0;
  /// ssp, dssp: the staleness bound of the last step (dssp chooses it in its range).
  int bound = 0;
  /// eager: the groups whose gradients are in the last update (every mode that sums over all
  /// groups: all of them).
  int contributors = 0;
};

/// One tensor of the mode's state for checkpoints: shaped as its parameter's block, equal in
/// every group unless `per_group`.
struct SyncState {
  std::string name;
  Tensor* tensor = nullptr;
  bool per_group = false;
};

class Synchronizer {
 public:
  /// `sync` checked (check_sync) for `groups` replica groups of world.size() / groups ranks each
  /// (group g holds ranks [g P, (g + 1) P)). Splits the cross-group communicator (collective over
  /// `world`), its operations delayed by `delay` (a testing aid).
  Synchronizer(const SyncOptions& sync, int groups, Communicator& world, CommDelay delay = {});
  ~Synchronizer();

  const SyncOptions& options() const { return sync_; }
  int groups() const { return groups_; }
  /// This rank's group.
  int group() const { return group_; }
  /// Whether the executor sums gradients within each group only (every mode but bsp).
  bool within_groups() const;
  /// Whether groups' parameters may differ between syncs (local_sgd, diloco, easgd, gossip; ssp
  /// by each group's last s gradients).
  bool groups_differ() const;
  /// The step period between syncs, with each mode's default.
  int period() const;

  /// The tensors to keep (after the optimizer's state exists: Optimizer::prepare). Makes the
  /// mode's own state (easgd's center, diloco's parameters at the last sync and outer momentum)
  /// from the current values.
  void attach(std::vector<SyncTensor> tensors);
  /// Makes the mode's own state again from the current values (after restoring parameters from
  /// a checkpoint that did not hold it).
  void reset_state();

  /// After backward of step `step`: makes the gradients the ones this group's update uses (summed
  /// across groups where the mode synchronizes gradients, else scaled to this group's batch) and
  /// returns the learning rate: `schedule` at the step (AdaScale: gain times the schedule at
  /// its scaled time).
  double before_update(std::int64_t step, const std::function<double(std::int64_t)>& schedule);
  /// After the optimizer's update of step `step`: averages, elastic pulls, outer steps, mixing
  /// where the schedule names this step.
  void after_update(std::int64_t step);
  /// Whether after_update(step) exchanges parameters across groups.
  bool syncs_after(std::int64_t step) const;
  /// How many steps a group may run ahead of the slowest (ssp's and eager's staleness, dssp's highest bound; 0 otherwise).
  int lag() const;
  /// Agrees on a flag (a stop request) across every rank after step `step` (collective): whether
  /// any rank raised it. With lag() 0 at once; else each rank posts its flag now and reads the
  /// result posted lag() steps earlier, so that every rank answers the same after the same step
  /// without fast groups waiting for the slowest each step (the wait counts in stats()).
  bool agree(std::int64_t step, bool flag);

  /// The consensus model (collective): per tensor, the mean over groups (easgd: the center).
  /// With `record`, measures the consensus distance on the way (stats().consensus; checkpoints
  /// leave it alone, so that a resumed run reports what the uninterrupted one does).
  std::vector<Tensor> consensus(bool record);
  /// The mode's state tensors, named "<kind>/<parameter>" (kind: center, anchor, outer_momentum;
  /// ssp, eager: pending/<slot>, each group's own). Waits for every exchange in flight first, so that the
  /// tensors hold everything a resumed run needs.
  std::vector<SyncState> state();
  /// After restoring state() from a checkpoint written before step `next`: the pending slots hold
  /// the corrections of the steps before it.
  void restored(std::int64_t next);
  const SyncStats& stats() const { return stats_; }
  void set_stats(const SyncStats& stats) { stats_ = stats; }

  /// Mixes every tensor with its neighbours once (gossip's step, exposed for tests), round `round`.
  void gossip(std::int64_t round);

 private:
  /// Sums every gradient across groups (in place).
  void sum_gradients();
  /// Multiplies every gradient by `factor`.
  void scale_gradients(float factor);
  /// Averages the values (and with `optimizer_state`, their optimizer state) across groups.
  void average(bool optimizer_state);
  void diloco_step();
  /// ssp's gradient at `step`: this group's own, plus the correction of step − s (the sum over
  /// groups minus this group's own, once it arrived); starts the sum of this step's.
  void ssp_step(std::int64_t step);
  /// Waits for pending slot `slot`'s sum and turns it into its correction (in pending_sums_).
  void settle(std::size_t slot);
  /// ssp or dssp.
  bool stale() const;
  /// ssp: its staleness; dssp: the low end of its range.
  int lowest_bound() const;
  /// The staleness bound of this step (dssp: from the groups' step intervals).
  int choose_bound();
  /// A pending slot: the packed gradients and, after them, one step interval per group.
  std::int64_t slot_size() const { return offsets_.back() + groups_; }
  void easgd_step();
  /// eager's gradient at `step`: the sum of the round the quorum fired for it.
  void eager_step(std::int64_t step);
  /// Sums the gradients across groups and returns AdaScale's gain from the groups' gradients.
  double adascale_step();
  /// Σ over groups of ‖values‖² (or of the gradients), each block counted once per group.
  double squared_norm(bool gradients);
  /// Sets stats_.consensus from this rank's values and their mean over groups, both packed (a
  /// weighted sum over the world).
  void measure_consensus(const Tensor& own, const Tensor& mean);
  /// The values or gradients of every tensor, in order.
  std::vector<Tensor*> values() const;
  std::vector<Tensor*> gradients() const;
  /// The mean over groups of a packed buffer (one allreduce; its bytes counted in stats() with `count`).
  Tensor mean_across(const Tensor& flat, bool count = true);
  /// Sum over all ranks of the norm-weighted value of `term` per tensor.
  double weighted_sum(const std::function<double(std::size_t)>& term);
  /// Sums a packed buffer over groups in place (its bytes counted in stats() with `count`).
  void allreduce_across(Tensor& flat, bool count = true);

  SyncOptions sync_;
  int groups_ = 1, group_ = 0;
  /// Rank q of every group (delayed like every exchange across groups).
  std::unique_ptr<Communicator> across_;
  /// Every rank, for norms summed over all groups (delayed too).
  std::unique_ptr<Communicator> all_;
  /// Every rank, not delayed, for agree() (a control message, not an exchange of the mode).
  std::unique_ptr<Communicator> control_;
  /// Flags posted by agree() and not read yet.
  struct Posted {
    std::int64_t step = 0;
    int flag = 0;
    std::unique_ptr<CommRequest> request;
  };
  std::deque<std::unique_ptr<Posted>> posted_;
  std::vector<SyncTensor> tensors_;
  /// Where each tensor starts in a packed buffer (and the total at the end).
  std::vector<std::int64_t> offsets_;
  /// easgd: the center; diloco: the parameters at the last sync (the anchor); packed.
  Tensor center_;
  /// diloco: the outer optimizer's momentum, packed.
  Tensor outer_momentum_;
  /// Per-parameter views of center_, outer_momentum_ and pending_sums_, named as state() names them.
  std::vector<std::pair<std::string, Tensor>> state_views_;
  /// ssp: per slot (step mod s), the packed sum over groups of that step's gradients, in flight,
  /// then (settled) that sum minus this group's own gradient: the correction folded in s steps later.
  Tensor pending_sums_;
  struct Pending {
    std::int64_t step = -1;  ///< the step whose sum the slot holds (-1: none)
    Tensor own;              ///< this group's own (scaled) gradient of that step (the buffer is reused)
    std::unique_ptr<CommRequest> request;
    bool settled = false;
    bool folded = false;  ///< its correction is in an update already
  };
  std::vector<Pending> pending_;
  /// ssp, dssp, eager: this step's packed share of the sum; ssp, dssp: the gradient its update
  /// uses (both reused from step to step).
  Tensor summand_, use_;
  /// eager: rank q of every group and this group's ranks (for the rounds' agent thread alone), the
  /// rounds (from the first step on), and for checkpoints the gradients handed and not summed yet,
  /// packed per slot (step mod staleness).
  std::unique_ptr<Communicator> rounds_, within_;
  std::unique_ptr<PartialAllreduce> partial_;
  Tensor held_;
  std::vector<PartialItem> restored_items_;
  std::int64_t newest_folded_ = -1;
  /// This group's step interval without its waits for the others (a moving average) and every
  /// group's, as the newest settled sum carried them (dssp's controller).
  double interval_ = 0;
  std::optional<std::chrono::steady_clock::time_point> last_step_time_;
  double wait_at_last_step_ = 0;
  std::vector<float> intervals_;
  std::int64_t intervals_step_ = -1;
  SyncStats stats_;
};

}  // namespace tessera
