// Stop requests by signal (see signals.hpp).
#include "signals.hpp"

#include <signal.h>

#include <cerrno>
#include <cstring>

#include "tessera/core/error.hpp"

namespace tessera {
namespace {

// A signal handler may touch only lock-free atomics (or volatile sig_atomic_t).
std::atomic<bool> g_stop{false};
std::atomic<int> g_signal{0};
static_assert(std::atomic<bool>::is_always_lock_free, "the stop flag must be lock-free to be set in a signal handler");
static_assert(std::atomic<int>::is_always_lock_free, "the signal number must be lock-free to be set in a handler");

constexpr int kSignals[] = {SIGUSR1, SIGTERM};
struct sigaction g_previous[sizeof kSignals / sizeof kSignals[0]];
bool g_installed = false;

extern "C" void on_stop_signal(int signal_number) {
  g_signal.store(signal_number, std::memory_order_relaxed);
  g_stop.store(true, std::memory_order_release);
}

}  // namespace

void install_stop_signal_handlers() {
  if (g_installed) return;
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  action.sa_flags = SA_RESTART;  // interrupted reads and writes carry on
  sigemptyset(&action.sa_mask);
  for (const int s : kSignals) sigaddset(&action.sa_mask, s);
  for (std::size_t i = 0; i < std::size(kSignals); ++i) {
    if (::sigaction(kSignals[i], &action, &g_previous[i]) != 0) {
      const int error = errno;
      for (std::size_t j = 0; j < i; ++j) ::sigaction(kSignals[j], &g_previous[j], nullptr);
      fail("cannot install the handler for signal {}: {}", kSignals[i], std::strerror(error));
    }
  }
  g_installed = true;
}

const std::atomic<bool>* stop_requested_flag() {
  return &g_stop;
}

int stop_signal() {
  return g_signal.load(std::memory_order_relaxed);
}

void restore_stop_signal_handlers() {
  if (!g_installed) return;
  for (std::size_t i = 0; i < std::size(kSignals); ++i) ::sigaction(kSignals[i], &g_previous[i], nullptr);
  g_installed = false;
  g_stop.store(false);
  g_signal.store(0);
}

}  // namespace tessera
