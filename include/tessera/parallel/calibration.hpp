#pragma once
// What `tessera calibrate` measures between ranks, and the fits that turn it into a machine
// file's alpha-beta lines: ping-pong, allreduce and alltoallv times over message sizes, the wait
// at synchronisation points, and a barrier that leaves the cores to rank 0 while it times kernels.
// Every probe runs through a Communicator; every rank of it takes part.
#include <functional>
#include <utility>
#include <vector>

#include "tessera/core/communicator.hpp"
#include "tessera/parallel/machine.hpp"

namespace tessera {

/// One measured message size: bytes moved and seconds taken.
struct CommPoint {
  double bytes = 0;
  double seconds = 0;
};

/// The middle value (the mean of the two middle ones for an even count).
double median(std::vector<double> values);

/// The line t = a + b x that minimizes the relative errors, with a, b >= 0 (b > 0).
std::pair<double, double> fit_line(const std::vector<double>& x, const std::vector<double>& t);

/// Alpha and beta of t = alpha_factor alpha + beta_factor beta n, fitted without outliers.
AlphaBeta fit_level(const std::vector<CommPoint>& points, double alpha_factor, double beta_factor);

/// Waits for every rank without spinning, so that waiting ranks leave their cores free.
void idle_barrier(Communicator& comm);

/// Runs `work` on rank 0 while the other ranks wait in idle_barrier; an error fails every rank.
void on_rank0_alone(Communicator& comm, const std::function<void()>& work);

/// One-way seconds of a ping-pong between ranks 0 and 1 per message size (the points on rank 0).
std::vector<CommPoint> ping_pong(Communicator& comm, bool quick);

/// Seconds of an allreduce over every rank per message size.
std::vector<CommPoint> allreduce_points(Communicator& comm, bool quick);

/// Seconds of an alltoallv over every rank per total bytes each rank sends.
std::vector<CommPoint> alltoall_points(Communicator& comm, bool quick);

/// What a blocking neighbour exchange waits beyond its alpha-beta cost with this job's ranks:
/// `seconds` + `share` x the work before it (the share over 1 and 16 ms of work on a rank alone,
/// the fixed part over 0.1 ms; each stretched by `machine`'s oversubscription at this job's ranks).
struct SyncWait {
  double seconds = 0;
  double share = 0;
};
SyncWait measure_sync_wait(Communicator& comm, const Machine& machine, int repeats);

/// Box copies as the exchanges make them, every rank copying at once with its caches cold (a
/// sweep over `sweep_bytes` first): the bytes/s one rank copies and the seconds each contiguous
/// run adds, from two copies of 4 MiB (rows of 7 floats into rows of 11, as a halo's window of a
/// narrow tile; rows of 1024 into rows of 1028); the median of `repeats` calls each (at least 3;
/// the slowest rank's).
struct BoxCopyRate {
  double bandwidth = 0;
  double run_seconds = 0;
};
BoxCopyRate measure_box_copies(Communicator& comm, int repeats, std::size_t sweep_bytes);

}  // namespace tessera
