#include "tessera/parallel/sync.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "tessera/core/error.hpp"

namespace tessera {

SyncOptions SyncOptions::over(const SyncOptions& base) const {
  SyncOptions s = *this;
  if (!period) s.period = base.period;
  if (!start) s.start = base.start;
  if (!optimizer_state) s.optimizer_state = base.optimizer_state;
  if (!outer_optimizer) s.outer_optimizer = base.outer_optimizer;
  if (!outer_lr) s.outer_lr = base.outer_lr;
  if (!outer_momentum) s.outer_momentum = base.outer_momentum;
  if (!easgd_alpha) s.easgd_alpha = base.easgd_alpha;
  if (!topology) s.topology = base.topology;
  if (!staleness) s.staleness = base.staleness;
  if (!quorum) s.quorum = base.quorum;
  if (!staleness_low) {
    s.staleness_low = base.staleness_low;
    s.staleness_high = base.staleness_high;
  }
  return s;
}

std::string SyncOptions::to_yaml() const {
  std::string s;
  const auto add = [&](const char* key, const std::string& value) { s += fmt::format(", {}: {}", key, value); };
  if (period) add("period", std::to_string(*period));
  if (start) add("start", std::to_string(*start));
  if (optimizer_state) add("optimizer_state", *optimizer_state ? "true" : "false");
  if (outer_optimizer) add("outer_optimizer", *outer_optimizer);
  if (outer_lr) add("outer_lr", fmt::format("{}", *outer_lr));
  if (outer_momentum) add("outer_momentum", fmt::format("{}", *outer_momentum));
  if (easgd_alpha) add("easgd_alpha", fmt::format("{}", *easgd_alpha));
  if (topology) add("topology", *topology);
  if (staleness) add("staleness", std::to_string(*staleness));
  if (staleness_low) add("staleness_range", fmt::format("\"{}:{}\"", *staleness_low, staleness_high.value_or(*staleness_low)));
  if (quorum) add("quorum", *quorum);
  if (mode == "bsp" && s.empty()) return "";
  return fmt::format("sync: {{mode: {}{}}}\n", mode, s);
}

void parse_staleness_range(const std::string& text, SyncOptions& sync) {
  const auto colon = text.find(':');
  try {
    std::size_t a = 0, b = 0;
    if (colon == std::string::npos) throw std::invalid_argument(text);
    const std::string low = text.substr(0, colon), high = text.substr(colon + 1);
    sync.staleness_low = std::stoi(low, &a);
    sync.staleness_high = std::stoi(high, &b);
    if (a != low.size() || b != high.size()) throw std::invalid_argument(text);
  } catch (const std::exception&) {
    fail_input("staleness range (--staleness-range) must be LOW:HIGH, such as 1:8, got '{}'", text);
  }
}

bool sums_within_groups(const SyncOptions& sync) { return sync.mode != "bsp"; }

const std::vector<std::string>& sync_modes() {
  static const std::vector<std::string> modes{"bsp", "local_sgd", "diloco", "easgd", "gossip", "adascale", "ssp", "dssp", "eager"};
  return modes;
}

namespace {

/// An option set for a mode that does not take it.
void refuse_unless(bool set, const char* key, const char* flag, const std::vector<std::string>& modes,
                   const std::string& mode) {
  if (!set || std::find(modes.begin(), modes.end(), mode) != modes.end()) return;
  fail_input("sync option '{}' ({}) is for --sync {}, not {}", key, flag, fmt::join(modes, " or "), mode);
}

}  // namespace

void check_sync(const SyncOptions& s, int groups) {
  const auto& modes = sync_modes();
  if (std::find(modes.begin(), modes.end(), s.mode) == modes.end())
    fail_input("synchronization mode '{}' is unknown (known: {})", s.mode, fmt::join(modes, ", "));
  refuse_unless(s.period.has_value(), "period", "--sync-period", {"local_sgd", "diloco", "easgd", "gossip"}, s.mode);
  refuse_unless(s.start.has_value(), "start", "--sync-start", {"local_sgd"}, s.mode);
  refuse_unless(s.optimizer_state.has_value(), "optimizer_state", "--sync-optimizer-state", {"local_sgd"}, s.mode);
  refuse_unless(s.outer_optimizer.has_value(), "outer_optimizer", "--outer-optimizer", {"diloco"}, s.mode);
  refuse_unless(s.outer_lr.has_value(), "outer_lr", "--outer-lr", {"diloco"}, s.mode);
  refuse_unless(s.outer_momentum.has_value(), "outer_momentum", "--outer-momentum", {"diloco"}, s.mode);
  refuse_unless(s.easgd_alpha.has_value(), "easgd_alpha", "--easgd-alpha", {"easgd"}, s.mode);
  refuse_unless(s.topology.has_value(), "topology", "--gossip-topology", {"gossip"}, s.mode);
  refuse_unless(s.staleness.has_value(), "staleness", "--staleness", {"ssp", "eager"}, s.mode);
  refuse_unless(s.quorum.has_value(), "quorum", "--quorum", {"eager"}, s.mode);
  if (s.quorum && *s.quorum != "solo" && *s.quorum != "majority")
    fail_input("quorum (--quorum) '{}': choose solo or majority", *s.quorum);
  if (s.staleness && *s.staleness < 0) fail_input("staleness (--staleness) must be 0 or more, got {}", *s.staleness);
  refuse_unless(s.staleness_low.has_value(), "staleness_range", "--staleness-range", {"dssp"}, s.mode);
  if (s.staleness_low && (*s.staleness_low < 0 || s.staleness_high.value_or(-1) < *s.staleness_low))
    fail_input("staleness range (--staleness-range) must be LOW:HIGH with 0 <= LOW <= HIGH, got {}:{}",
               *s.staleness_low, s.staleness_high.value_or(-1));
  if (s.period && *s.period < 1) fail_input("sync period (--sync-period) must be at least 1, got {}", *s.period);
  if (s.start && *s.start < 0) fail_input("sync start (--sync-start) must be 0 or more, got {}", *s.start);
  if (s.outer_optimizer && *s.outer_optimizer != "sgd" && *s.outer_optimizer != "nesterov")
    fail_input("outer optimizer (--outer-optimizer) '{}': choose sgd or nesterov", *s.outer_optimizer);
  if (s.outer_lr && !(*s.outer_lr > 0)) fail_input("outer learning rate (--outer-lr) must be above 0, got {}", *s.outer_lr);
  if (s.outer_momentum && !(*s.outer_momentum >= 0 && *s.outer_momentum < 1))
    fail_input("outer momentum (--outer-momentum) must be in [0, 1), got {}", *s.outer_momentum);
  if (s.easgd_alpha && !(*s.easgd_alpha >= 0 && *s.easgd_alpha <= 1))
    fail_input("elastic pull (--easgd-alpha) must be in [0, 1], got {}", *s.easgd_alpha);
  if (s.topology && *s.topology != "ring" && *s.topology != "exponential")
    fail_input("gossip topology (--gossip-topology) '{}': choose ring or exponential", *s.topology);
  if (s.mode == "adascale" && groups < 2)
    fail_input("--sync adascale needs two replica groups or more (a job of a multiple of the plan's ranks); this "
               "job has {}", groups);
}

int sync_lag(const SyncOptions& sync) {
  if (sync.mode == "ssp") return sync.staleness.value_or(2);
  if (sync.mode == "dssp") return sync.staleness_high.value_or(8);
  if (sync.mode == "eager") return sync.staleness.value_or(4);
  return 0;
}

double sync_buffer_copies(const SyncOptions& sync, int groups) {
  if (groups <= 1 || sync.mode == "bsp") return 0;
  const double lag = sync_lag(sync);
  // Each mode's buffers as synchronizer.cpp makes them (packed, this rank's blocks).
  if (sync.mode == "ssp" || sync.mode == "dssp") return 2 * lag + 2;  // sums in flight, own, share, used
  if (sync.mode == "eager") return 2 * lag + 5;  // held slots, items, share, payload, round, unpacked
  if (sync.mode == "diloco" || sync.mode == "easgd") return 5;  // anchor or center (+ momentum), scratch
  if (sync.mode == "gossip") return sync.topology.value_or("exponential") == "ring" ? 4 : 3;
  if (sync.mode == "local_sgd") return sync.optimizer_state.value_or(false) ? 4 : 2;
  return 1;  // adascale: the packed sum
}

int eager_quorum(const SyncOptions& sync, int groups) {
  return sync.quorum.value_or("majority") == "solo" ? 1 : groups / 2 + 1;
}

}  // namespace tessera
