#pragma once
// How replica groups synchronize: the mode and its options, from `--sync` and its options or the
// plan file's `sync:` section (the command line wins, key by key), checked in one place.
#include <optional>
#include <string>
#include <vector>

namespace tessera {

struct SyncOptions {
  std::string mode = "bsp";
  std::optional<int> period;                  ///< steps between syncs (local_sgd, diloco, easgd, gossip)
  std::optional<int> start;                   ///< bsp until this step (local_sgd: post-local SGD)
  std::optional<bool> optimizer_state;        ///< average the optimizer state too (local_sgd)
  std::optional<std::string> outer_optimizer;  ///< sgd or nesterov (diloco)
  std::optional<double> outer_lr, outer_momentum;  ///< (diloco)
  std::optional<double> easgd_alpha;          ///< the elastic pull, in [0, 1] (easgd)
  std::optional<std::string> topology;        ///< ring or exponential (gossip)
  std::optional<int> staleness;               ///< steps a group may run ahead of the slowest (ssp, eager)
  /// The range [low, high] dssp chooses its staleness bound in.
  std::optional<int> staleness_low, staleness_high;
  std::optional<std::string> quorum;          ///< solo or majority: groups a round waits for (eager)
  /// These options with every key this one leaves unset taken from `base`.
  SyncOptions over(const SyncOptions& base) const;
  /// The plan file's form (`{mode: ..., period: ...}`), empty for bsp without options.
  std::string to_yaml() const;
  bool operator==(const SyncOptions&) const = default;
};

/// Whether gradients (and batch-norm statistics and the training loss) are summed within each
/// replica group only, the synchronizer carrying what crosses groups: every mode but bsp.
bool sums_within_groups(const SyncOptions& sync);

/// The modes Tessera knows, in the order the docs list them.
const std::vector<std::string>& sync_modes();

/// "LOW:HIGH" (--staleness-range, the plan file's staleness_range) into `sync`; an InputError otherwise.
void parse_staleness_range(const std::string& text, SyncOptions& sync);

/// Checks `sync` for a job of `groups` replica groups: a known mode, options that this mode takes,
/// in range; an InputError naming the option (its command-line and plan-file names) otherwise.
void check_sync(const SyncOptions& sync, int groups);

/// How many groups an eager round waits for, of `groups`: solo 1, majority more than half.
int eager_quorum(const SyncOptions& sync, int groups);

/// How many steps a group may run ahead of the slowest: ssp's and eager's staleness (defaults 2
/// and 4), dssp's highest bound (8); 0 for the other modes.
int sync_lag(const SyncOptions& sync);

/// How many copies of this rank's parameter blocks the synchronizer holds on the host at its peak
/// under `sync` with `groups` groups (its state and its scratch; 0 for bsp or one group), for the
/// memory check before training.
double sync_buffer_copies(const SyncOptions& sync, int groups);

}  // namespace tessera
