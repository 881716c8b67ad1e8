#include "tessera/core/signal_mask.hpp"

#include <pthread.h>
#include <signal.h>

namespace tessera {
namespace {

void change_stop_signals(int how) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGUSR1);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(how, &set, nullptr);
}

}  // namespace

void block_stop_signals() { change_stop_signals(SIG_BLOCK); }
void unblock_stop_signals() { change_stop_signals(SIG_UNBLOCK); }

}  // namespace tessera
