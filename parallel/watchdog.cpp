#include "tessera/parallel/watchdog.hpp"

#include <algorithm>
#include <cstdio>

#include <fmt/format.h>

#include "tessera/core/communicator.hpp"
#include "tessera/core/signal_mask.hpp"

namespace tessera {

Watchdog::Watchdog(double timeout_seconds, int rank, OnHang on_hang)
    : timeout_seconds_(timeout_seconds), rank_(rank), on_hang_(std::move(on_hang)) {
  if (enabled())
    thread_ = std::thread([this] {
      block_stop_signals();  // the main thread takes them
      watch();
    });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Watchdog::watch() {
  using Clock = std::chrono::steady_clock;
  // Checks a few times per timeout, at least once a second: fires within about 1.1 x timeout.
  const auto poll = std::chrono::duration<double>(std::clamp(timeout_seconds_ / 10, 0.005, 1.0));
  std::uint64_t seen = beats_.load(std::memory_order_relaxed);
  auto last_progress = Clock::now();
  std::unique_lock<std::mutex> lock(mutex_);
  while (!wake_.wait_for(lock, poll, [this] { return stopping_; })) {
    const std::uint64_t beats = beats_.load(std::memory_order_relaxed);
    const auto now = Clock::now();
    if (beats != seen) {
      seen = beats;
      last_progress = now;
      continue;
    }
    const double idle = std::chrono::duration<double>(now - last_progress).count();
    if (idle < timeout_seconds_) continue;
    const char* label = operation();
    const std::string message = fmt::format("tessera: error: [rank {}] no training step for {:.0f} s; this rank is "
                                            "stuck in: {}",
                                            rank_, idle, label ? label : kNoOperation);
    fired_.store(true);
    lock.unlock();
    if (on_hang_) on_hang_(message);
    return;
  }
}

Watchdog::OnHang Watchdog::print_and_abort(Communicator& world, double grace_seconds) {
  return [&world, grace_seconds](const std::string& message) {
    std::fprintf(stderr, "%s\n", message.c_str());
    std::fflush(stderr);
    std::this_thread::sleep_for(std::chrono::duration<double>(grace_seconds));
    world.abort(kHungExitCode);
  };
}

}  // namespace tessera
