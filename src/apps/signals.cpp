// Stop requests by signal (see signals.hpp).
#include "signals.hpp"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "tessera/core/error.hpp"
#include "tessera/core/signal_mask.hpp"

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
// The thread that takes the signals: the only one that does not block them (see signal_mask.hpp),
// so that no signal interrupts the training thread in the middle of a library call.
std::thread g_receiver;
std::atomic<bool> g_quit{false};

extern "C" void on_stop_signal(int signal_number) {
  g_signal.store(signal_number, std::memory_order_relaxed);
  g_stop.store(true, std::memory_order_release);
}

/// Ends the receiver at exit when nobody restored the handlers (a joinable thread must not be
/// destroyed).
struct ReceiverGuard {
  ~ReceiverGuard() { restore_stop_signal_handlers(); }
} g_receiver_guard;

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
  // The calling thread (and every thread it creates from now on) blocks the signals; the receiver
  // unblocks them in itself and sleeps until one arrives (the handler runs there).
  block_stop_signals();
  g_quit.store(false);
  g_receiver = std::thread([] {
    unblock_stop_signals();
    while (!g_quit.load()) pause();
  });
}

const std::atomic<bool>* stop_requested_flag() {
  return &g_stop;
}

int stop_signal() {
  return g_signal.load(std::memory_order_relaxed);
}

void restore_stop_signal_handlers() {
  if (!g_installed) return;
  // Wake the receiver (its handler sets the flag, cleared below) and let it end.
  g_quit.store(true);
  pthread_kill(g_receiver.native_handle(), SIGUSR1);
  g_receiver.join();
  for (std::size_t i = 0; i < std::size(kSignals); ++i) ::sigaction(kSignals[i], &g_previous[i], nullptr);
  g_installed = false;
  g_stop.store(false);
  g_signal.store(0);
}

}  // namespace tessera
