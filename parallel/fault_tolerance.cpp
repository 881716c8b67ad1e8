// Fault-tolerant replica groups: quorums as files in the store folder, exchanges over Gloo.
#include "tessera/parallel/fault_tolerance.hpp"

#include <fmt/format.h>
#include <gloo/allreduce.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <csignal>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <sstream>
#include <thread>

#include "tessera/core/error.hpp"
#include "tessera/core/log.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/parallel/flat_pack.hpp"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using SteadyClock = std::chrono::steady_clock;

double seconds_from(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

std::chrono::milliseconds milliseconds(double seconds) {
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000));
}

/// The file's text ("" when it does not exist).
std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return {};
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

/// A name for a temporary file beside `path`, unique to this process on this host.
fs::path temporary_beside(const fs::path& path) {
  static int counter = 0;
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return fs::path(fmt::format("{}.tmp.{}.{}.{}", path.string(), host, getpid(), counter++));
}

/// Whether `path` exists; an error reading the folder (a shared file system's hiccup) counts as no.
bool present(const fs::path& path) {
  std::error_code ec;
  return fs::exists(path, ec);
}

void write_whole(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.flush();
  if (!out) fail("cannot write {}: {}", path.string(), std::strerror(errno));
}

/// Writes `text` to `path` whole, unless `path` exists: returns whether this call created it
/// (link() is atomic on every POSIX file system, NFS included).
bool create_once(const fs::path& path, const std::string& text) {
  const fs::path tmp = temporary_beside(path);
  write_whole(tmp, text);
  const int rc = ::link(tmp.c_str(), path.c_str());
  const int error = errno;
  std::error_code ignored;
  fs::remove(tmp, ignored);
  if (rc == 0) return true;
  if (error == EEXIST) return false;
  fail("cannot create {}: {}", path.string(), std::strerror(error));
}

/// Writes `text` to `path` whole, replacing what is there (rename() is atomic).
void replace_whole(const fs::path& path, const std::string& text) {
  const fs::path tmp = temporary_beside(path);
  write_whole(tmp, text);
  fs::rename(tmp, path);
}

std::vector<int> parse_ints(const std::string& text) {
  std::vector<int> out;
  std::istringstream in(text);
  for (int v = 0; in >> v;) out.push_back(v);
  return out;
}

bool contains(const std::vector<int>& set, int value) { return std::find(set.begin(), set.end(), value) != set.end(); }

/// The number in a name made of digits only, else -1.
int number_in(const std::string& name) {
  if (name.empty() || name.size() > 9 || !std::all_of(name.begin(), name.end(), ::isdigit)) return -1;
  return std::stoi(name);
}

/// The TCP device of Gloo's transport: TESSERA_GLOO_IFACE names the interface, else
/// TESSERA_GLOO_HOST the address to listen on, else the host's name.
std::shared_ptr<gloo::transport::Device> make_device() {
  gloo::transport::tcp::attr attr;
  if (const char* iface = std::getenv("TESSERA_GLOO_IFACE"); iface && *iface) attr.iface = iface;
  else if (const char* host = std::getenv("TESSERA_GLOO_HOST"); host && *host) attr.hostname = host;
  else {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    attr.hostname = name;
  }
  try {
    return gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    fail_input("cannot listen for the other replica groups on '{}' ({}): set TESSERA_GLOO_IFACE to a network "
               "interface or TESSERA_GLOO_HOST to an address of this node",
               attr.iface.empty() ? attr.hostname : attr.iface, e.what());
  }
}

}  // namespace

void check_fault_tolerance(const FaultToleranceOptions& o) {
  if (o.store.empty()) fail_input("replica groups that survive failures need a store folder (--replica-store)");
  if (o.groups < 1) fail_input("--replica-groups must be >= 1, got {}", o.groups);
  if (o.group < 0 || o.group >= o.groups)
    fail_input("--replica-group {} is not a group of {} (0..{})", o.group, o.groups, o.groups - 1);
  if (o.min_groups < 1 || o.min_groups > o.groups)
    fail_input("--min-groups {} must be between 1 and the {} groups", o.min_groups, o.groups);
  for (const auto& [value, name] : {std::pair{o.join_window, "--join-window"}, {o.start_window, "--start-window"},
                                    {o.peer_timeout, "--peer-timeout"}, {o.quorum_timeout, "--quorum-timeout"}})
    if (!(value > 0)) fail_input("{} must be > 0 seconds, got {}", name, value);
}

struct ReplicaSet::Impl {
  FaultToleranceOptions o;
  Communicator& group;
  bool voice;  ///< rank 0 of the group: it alone reads and writes the store's quorum files
  fs::path root;
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::rendezvous::Context> context;
  int quorum = -1;           ///< the current quorum's number (-1: none yet)
  std::vector<int> members;  ///< its groups, in order (empty: none yet)
  int index = 0;             ///< this group's place among them
  bool after_failure = false;
  /// Where this rank's state comes from: the quorum that committed its last step (-1: the seeded
  /// initial state, the same in every group; below: a checkpoint of this group's).
  std::int64_t lineage = -1;
  ReplicaStats stats;
  std::vector<float> buffer;

  Impl(FaultToleranceOptions options, Communicator& g)
      : o(std::move(options)), group(g), voice(g.rank() == 0), root(o.store) {}

  fs::path folder(int q) const { return root / fmt::format("q{}", q); }

  /// Whether every rank of the group says ok (collective).
  bool agree(bool ok) { return group.allreduce_value(ok ? 0 : 1, ReduceOp::Max) == 0; }

  /// The newest quorum that has been decided (-1: none).
  int newest_decided() const {
    int newest = -1;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(root, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.size() < 2 || name[0] != 'q') continue;
      const int q = number_in(name.substr(1));
      if (q > newest && fs::exists(entry.path() / "decided")) newest = q;
    }
    return newest;
  }

  /// Voice only: joins quorums from `target` on until one includes this group; returns its
  /// number followed by its groups, or {-1} when training has finished.
  std::vector<int> form(int target, const TrainingPosition& position) {
    const auto begin = SteadyClock::now();
    const bool fresh = members.empty();
    for (;; ++target) {
      // Never a quorum older than the newest decided one (a stale folder listing, or one removed).
      target = std::max(target, newest_decided() + 1);
      const fs::path q = folder(target);
      fs::create_directories(q / "joins");
      fs::create_directories(q / "gloo");
      replace_whole(q / "joins" / std::to_string(o.group), fmt::format("{}\n", position.step));
      const auto joined_at = SteadyClock::now();
      auto checked_newer = joined_at;
      for (;;) {
        if (present(root / "done")) return {-1};
        if (o.stop_request != nullptr && o.stop_request->load()) return {-3};
        const std::string decided = read_text(q / "decided");
        if (!decided.empty()) {
          std::vector<int> chosen = parse_ints(decided);
          if (!contains(chosen, o.group)) break;  // formed without this group: the next one
          chosen.insert(chosen.begin(), target);
          return chosen;
        }
        std::vector<int> joined;
        std::error_code ec;
        for (const auto& entry : fs::directory_iterator(q / "joins", ec)) {
          const int g = number_in(entry.path().filename().string());
          if (g >= 0 && g < o.groups) joined.push_back(g);
        }
        std::sort(joined.begin(), joined.end());
        const bool everyone = static_cast<int>(joined.size()) == o.groups;
        // A regroup after a commit is for a group that waits to join, and nobody failed: every
        // member of the last quorum comes, and the newcomer is there already.
        const bool all_members = !fresh && !after_failure && joined.size() > members.size() &&
                                 std::all_of(members.begin(), members.end(), [&](int g) { return contains(joined, g); });
        const bool waited = seconds_from(joined_at) >= (fresh ? o.start_window : o.join_window);
        if (static_cast<int>(joined.size()) >= o.min_groups && (everyone || all_members || waited)) {
          create_once(q / "decided", fmt::format("{}\n", fmt::join(joined, " ")));
          continue;  // read whichever decision was made first
        }
        if (seconds_from(checked_newer) > 0.5) {
          checked_newer = SteadyClock::now();
          if (newest_decided() > target) break;  // the others are past this one: join the newest
        }
        if (seconds_from(begin) > o.quorum_timeout)
          fail("group {}: no quorum of at least {} groups (--min-groups) formed within {:.0f} s (--quorum-timeout); "
               "the groups seen last: [{}]",
               o.group, o.min_groups, o.quorum_timeout, fmt::join(joined, ", "));
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  }

  /// Connects rank q of every member (collective over the group): whether every rank did.
  bool connect() {
    context.reset();
    bool ok = true;
    if (members.size() > 1) {
      try {
        gloo::rendezvous::FileStore files((folder(quorum) / "gloo").string());
        gloo::rendezvous::PrefixStore store(fmt::format("r{}", group.rank()), files);
        auto made = std::make_shared<gloo::rendezvous::Context>(index, static_cast<int>(members.size()));
        made->setTimeout(milliseconds(o.peer_timeout));
        made->connectFullMesh(store, device);
        context = std::move(made);
      } catch (const std::exception& e) {
        log_warn("group {}: connecting quorum {} failed: {}", o.group, quorum, e.what());
        ok = false;
      }
    }
    return agree(ok);
  }

  /// Brings every member to the state of the member furthest ahead (collective over the group;
  /// Gloo across groups): whether every rank of the group took part without an error. Members
  /// at the same step whose last commits came from the same quorum hold the same state; any
  /// other member receives the source's.
  bool heal(TrainingPosition& position, const std::vector<Tensor*>& state) {
    const std::size_t n = members.size();
    if (n == 1) return true;
    constexpr std::size_t kFields = 3;  // step, optimizer steps, lineage
    std::vector<std::int64_t> positions(kFields * n, 0);
    positions[kFields * index] = position.step;
    positions[kFields * index + 1] = position.optimizer_steps;
    positions[kFields * index + 2] = lineage;
    std::size_t source = 0;
    bool receive = false, anyone = false, ok = true;
    std::vector<float> received;
    const auto begin = SteadyClock::now();
    const auto differs = [&](std::size_t i) {
      return positions[kFields * i] != positions[kFields * source] ||
             positions[kFields * i + 2] != positions[kFields * source + 2];
    };
    try {
      gloo::AllreduceOptions sum(context);
      sum.setOutput(positions.data(), positions.size());
      sum.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<std::int64_t>));
      gloo::allreduce(sum);
      for (std::size_t i = 1; i < n; ++i)
        if (positions[kFields * i] > positions[kFields * source]) source = i;
      for (std::size_t i = 0; i < n; ++i) anyone = anyone || differs(i);
      receive = differs(static_cast<std::size_t>(index));
      if (anyone) {
        received.resize(static_cast<std::size_t>(total_elements(state)));
        if (static_cast<std::size_t>(index) == source) pack_flat_into(state, received.data());
        gloo::BroadcastOptions copy(context);
        copy.setRoot(static_cast<int>(source));
        copy.setOutput(received.data(), received.size());
        gloo::broadcast(copy);
      }
    } catch (const std::exception& e) {
      log_warn("group {}: healing in quorum {} failed: {}", o.group, quorum, e.what());
      ok = false;
    }
    if (!agree(ok)) return false;
    const double bytes = static_cast<double>(received.size() * sizeof(float));
    if (receive) {
      unpack_flat(received.data(), state);
      const std::int64_t from = position.step;
      position.step = positions[kFields * source];
      position.optimizer_steps = positions[kFields * source + 1];
      lineage = positions[kFields * source + 2];
      ++stats.heals;
      stats.heal_bytes += bytes;
      stats.heal_seconds += seconds_from(begin);
      log_info("group {}: healed from group {}: step {} -> {}, {:.1f} MB in {:.3f} s", o.group, members[source], from,
               position.step, bytes * group.size() / 1e6, seconds_from(begin));
    } else if (anyone && static_cast<std::size_t>(index) == source) {
      stats.served_bytes += bytes;
    }
    return true;
  }
};

ReplicaSet::ReplicaSet(FaultToleranceOptions options, Communicator& group)
    : impl_(std::make_unique<Impl>(std::move(options), group)) {
  Impl& s = *impl_;
  collectively(group, [&] {
    check_fault_tolerance(s.o);
    if (!s.voice) return;
    std::error_code ec;
    fs::create_directories(s.root, ec);
    if (ec || !fs::is_directory(s.root))
      fail_input("the replica store folder '{}' cannot be used: {}", s.o.store,
                 ec ? ec.message() : std::string("not a folder"));
    std::string text;
    for (const auto& [what, value] : s.o.identity) text += fmt::format("{}: {}\n", what, value);
    try {
      if (create_once(s.root / "identity", text)) return;
    } catch (const Error& e) {
      fail_input("the replica store folder '{}' cannot be used: {}", s.o.store, e.message());
    }
    std::istringstream theirs(read_text(s.root / "identity"));
    std::vector<std::string> lines;
    for (std::string line; std::getline(theirs, line);) lines.push_back(line);
    for (const auto& [what, value] : s.o.identity) {
      const std::string prefix = what + ": ";
      const auto found = std::find_if(lines.begin(), lines.end(), [&](const std::string& l) { return l.rfind(prefix, 0) == 0; });
      const std::string other = found == lines.end() ? std::string("(none)") : found->substr(prefix.size());
      if (other != value)
        fail_input("group {} was started with a different {} from the groups already in '{}': {} here, {} there",
                   s.o.group, what, s.o.store, value, other);
    }
  });
  // A write to a peer that died must fail with EPIPE (an exception in the exchange), not end this
  // process with SIGPIPE.
  std::signal(SIGPIPE, SIG_IGN);
  s.device = make_device();
}

ReplicaSet::~ReplicaSet() = default;

ReplicaSet::Joined ReplicaSet::join(TrainingPosition& position, const std::vector<Tensor*>& state) {
  Impl& s = *impl_;
  const auto begin = SteadyClock::now();
  for (;;) {
    std::vector<int> chosen(static_cast<std::size_t>(s.o.groups) + 1, -2);
    collectively(s.group, [&] {
      if (!s.voice) return;
      const int target = s.quorum >= 0 ? s.quorum + 1 : s.newest_decided() + 1;
      const std::vector<int> formed = s.form(target, position);
      std::copy(formed.begin(), formed.end(), chosen.begin());
    });
    s.group.broadcast(std::span<int>(chosen), 0);
    if (chosen[0] == -1) return Joined::Finished;
    if (chosen[0] == -3) return Joined::Stopped;
    s.quorum = chosen[0];
    s.members.clear();
    for (std::size_t i = 1; i < chosen.size() && chosen[i] >= 0; ++i) s.members.push_back(chosen[i]);
    s.index = static_cast<int>(std::find(s.members.begin(), s.members.end(), s.o.group) - s.members.begin());
    if (!s.connect() || !s.heal(position, state)) {
      s.after_failure = true;
      ++s.stats.failures;
      continue;
    }
    s.after_failure = false;
    ++s.stats.quorums;
    const double took = seconds_from(begin);
    s.stats.quorum_seconds += took;
    log_info("group {}: quorum {} of groups [{}] at step {} ({:.3f} s)", s.o.group, s.quorum,
             fmt::join(s.members, ", "), position.step, took);
    if (s.voice && s.index == 0) {
      // Every member of this quorum has left the older ones: their files go (the last two stay for
      // groups that read the folder a little late).
      std::error_code ec;
      for (int q = s.quorum - 3; q >= 0 && fs::exists(s.folder(q), ec); --q) fs::remove_all(s.folder(q), ec);
    }
    return Joined::Member;
  }
}

ReplicaSet::Outcome ReplicaSet::average(const std::vector<Tensor*>& tensors) {
  Impl& s = *impl_;
  const std::size_t total = static_cast<std::size_t>(total_elements(tensors));
  s.buffer.resize(total + 1);
  pack_flat_into(tensors, s.buffer.data());
  // The last element counts the groups' voices that see a group waiting to join.
  s.buffer[total] = s.voice && present(s.folder(s.quorum + 1)) ? 1.0F : 0.0F;
  bool ok = true;
  if (s.members.size() > 1) {
    try {
      gloo::AllreduceOptions sum(s.context);
      sum.setOutput(s.buffer.data(), s.buffer.size());
      sum.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      gloo::allreduce(sum);
    } catch (const std::exception& e) {
      log_warn("group {}: a peer group failed during the exchange of quorum {}: {}", s.o.group, s.quorum, e.what());
      ok = false;
    }
  }
  std::array<int, 2> flags{ok ? 0 : 1, s.buffer[total] > 0 ? 1 : 0};
  s.group.allreduce(std::span<int>(flags), ReduceOp::Max);
  Outcome outcome{flags[0] == 0, flags[1] == 1};
  if (!outcome.committed) {
    s.after_failure = true;
    ++s.stats.failures;
    s.context.reset();
    return outcome;
  }
  s.lineage = s.quorum;
  const float n = static_cast<float>(s.members.size());
  for (std::size_t i = 0; i < total; ++i) s.buffer[i] /= n;
  unpack_flat(s.buffer.data(), tensors);
  return outcome;
}

bool ReplicaSet::sum(std::span<double> values) {
  Impl& s = *impl_;
  bool ok = true;
  if (s.members.size() > 1) {
    try {
      gloo::AllreduceOptions sum(s.context);
      sum.setOutput(values.data(), values.size());
      sum.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<double>));
      gloo::allreduce(sum);
    } catch (const std::exception& e) {
      log_warn("group {}: a peer group failed during a sum of quorum {}: {}", s.o.group, s.quorum, e.what());
      ok = false;
    }
  }
  return s.agree(ok);
}

int ReplicaSet::members() const { return static_cast<int>(impl_->members.size()); }

int ReplicaSet::place() const { return impl_->index; }

void ReplicaSet::restored_from_checkpoint() { impl_->lineage = -2 - impl_->o.group; }

void ReplicaSet::finish(std::int64_t step) {
  if (!impl_->voice) return;
  try {
    create_once(impl_->root / "done", fmt::format("{}\n", step));
  } catch (const std::exception& e) {
    log_warn("group {}: cannot mark training as finished in the store: {}", impl_->o.group, e.what());
  }
}

const ReplicaStats& ReplicaSet::stats() const { return impl_->stats; }

}  // namespace tessera
