#pragma once
// Stop requests by signal: SIGUSR1 and SIGTERM ask a training run to stop at the next step
// boundary, write a checkpoint and exit with kExitStopped (below), so that it can be
// resumed (by hand, or by the batch script of `tessera job`, which requeues the job).
//
// Who sends them: Slurm (`#SBATCH --signal=B:USR1@N` before the time limit, forwarded to the
// ranks by the batch script via srun; SIGTERM at the time limit or on preemption), `scancel
// --signal=USR1`, or a user through Open MPI's mpirun, which forwards SIGUSR1/SIGUSR2 to the ranks.
#include <atomic>

namespace tessera {

/// Exit code of a training run that stopped on a signal (SIGUSR1 or SIGTERM) after writing a
/// checkpoint: EX_TEMPFAIL of <sysexits.h>, "try again later". Every rank exits with it; the batch
/// script of `tessera job` requeues the job on it, and `--resume auto` then continues from the
/// checkpoint. Distinct from 1 (failure), 2 (bad input), 3 (diverged), 4 (watchdog). The one
/// definition: the command (tessera.cpp) and the batch script writer (job_script.cpp) use it.
inline constexpr int kExitStopped = 75;

/// Installs the handlers for SIGUSR1 and SIGTERM (sigaction, SA_RESTART; other signals blocked
/// while one runs). Each handler only stores `true` into the flag and records the signal number:
/// async-signal-safe, lock-free. The calling thread then blocks both signals, and a thread of
/// their own takes them (the handler runs there): a signal never interrupts the training thread
/// (a SIGUSR1 arriving while the training thread ran a oneDNN primitive crashed it in free(), a few
/// times in a hundred runs, not understood). Idempotent. Throws Error if sigaction fails.
void install_stop_signal_handlers();

/// The flag the handlers set (false until a signal arrives); give it to TrainerOptions::stop_request.
const std::atomic<bool>* stop_requested_flag();

/// The number of the last signal that set the flag (0 if none).
int stop_signal();

/// Puts back the handlers that were there before install_stop_signal_handlers() and clears the flag.
void restore_stop_signal_handlers();

}  // namespace tessera
