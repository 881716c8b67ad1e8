#pragma once
// A per-rank hang detector. A background thread watches for progress: the trainer calls
// `heartbeat()` after every step (one relaxed atomic add). Around each point where a rank can
// block on the others (gradient reduction, the loss allreduce, the data read, validation,
// checkpoints) a `WatchdogScope` names the operation: one relaxed pointer swap, no allocation;
// labels are string literals or strings built once that outlive the scope. When no heartbeat
// arrives for `timeout_seconds`, the watchdog hands one line to its `on_hang` callback:
//   tessera: error: [rank r] no training step for N s; this rank is stuck in: <operation>
// In `tessera train` that callback prints the line and ends the job with exit code 4 (hung).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace tessera {

class Communicator;

/// The exit code of a job that a watchdog ended (2: bad input, 3: diverged, 1: anything else).
inline constexpr int kHungExitCode = 4;

class Watchdog {
 public:
  /// Gets the message line, on the watchdog's thread, once. It is expected to end the process;
  /// if it returns (tests), the watchdog stops watching.
  using OnHang = std::function<void(const std::string& message)>;

  /// `timeout_seconds` <= 0: off (no thread). `rank` goes into the message.
  Watchdog(double timeout_seconds, int rank, OnHang on_hang);
  /// Stops and joins the thread.
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  /// What `tessera train` does on a hang: print the line to stderr, give the other ranks' watchdogs
  /// `grace_seconds` to print theirs (they usually fire together), then `world.abort(4)`.
  static OnHang print_and_abort(Communicator& world, double grace_seconds = 2.0);

  /// Progress was made (a step finished). Cheap: call it every step.
  void heartbeat() noexcept { beats_.fetch_add(1, std::memory_order_relaxed); }
  /// Sets the current operation's label (nullptr: none); returns the previous one. The pointer
  /// must stay valid while it is set. Prefer WatchdogScope.
  const char* set_operation(const char* label) noexcept {
    return operation_.exchange(label, std::memory_order_relaxed);
  }
  const char* operation() const noexcept { return operation_.load(std::memory_order_relaxed); }

  bool enabled() const { return timeout_seconds_ > 0; }
  double timeout_seconds() const { return timeout_seconds_; }
  /// Whether it fired (for tests whose callback returns).
  bool fired() const { return fired_.load(); }

  /// The label used while no WatchdogScope is active.
  static constexpr const char* kNoOperation = "computation (no collective operation)";

 private:
  void watch();

  double timeout_seconds_;
  int rank_;
  OnHang on_hang_;
  std::atomic<std::uint64_t> beats_{0};
  std::atomic<const char*> operation_{nullptr};
  std::atomic<bool> fired_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;
};

/// Names the operation a rank may block in for the duration of a scope; restores the previous
/// label on exit (scopes nest). A null watchdog makes it a no-op.
class WatchdogScope {
 public:
  WatchdogScope(Watchdog* watchdog, const char* label) noexcept
      : watchdog_(watchdog), previous_(watchdog ? watchdog->set_operation(label) : nullptr) {}
  ~WatchdogScope() {
    if (watchdog_) watchdog_->set_operation(previous_);
  }
  WatchdogScope(const WatchdogScope&) = delete;
  WatchdogScope& operator=(const WatchdogScope&) = delete;

 private:
  Watchdog* watchdog_;
  const char* previous_;
};

}  // namespace tessera
