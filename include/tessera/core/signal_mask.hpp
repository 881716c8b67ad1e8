#pragma once
// Tessera's stop signals (SIGUSR1 and SIGTERM: checkpoint and stop at the next step) are taken by
// one thread that does nothing else (`tessera train`, src/apps/signals.hpp). A process-directed
// signal goes to any thread that does not block it; every other thread blocks them (the MPI
// library's, which inherit the mask `tessera` sets before MPI_Init; the training thread once the
// handlers are installed, and the threads it creates; the prefetcher's and the watchdog's
// explicitly), so a signal never interrupts a system call or library code in any of them.
namespace tessera {

/// Blocks SIGUSR1 and SIGTERM in the calling thread (and the threads it creates from now on).
void block_stop_signals();
/// Unblocks them in the calling thread.
void unblock_stop_signals();

}  // namespace tessera
