#include "tessera/parallel/calibration.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#include "tessera/core/clock.hpp"
#include "tessera/core/error.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/tensor/box_ops.hpp"

namespace tessera {
namespace {

void require_two_ranks(const Communicator& comm) {
  if (comm.size() < 2)
    fail("calibration: the communication probes need at least 2 ranks, and {} has {}", comm.name(), comm.size());
}

std::vector<std::size_t> message_sizes(std::size_t largest) {
  std::vector<std::size_t> sizes;
  for (std::size_t s = 8; s <= largest; s *= 4) sizes.push_back(s);
  return sizes;
}

std::size_t largest_message(bool quick) { return quick ? (1u << 20) : (16u << 20); }

int iterations_for(std::size_t bytes, bool quick) {
  const double budget = quick ? 2e6 : 2e7;  // bytes moved per size, roughly
  return static_cast<int>(std::clamp(budget / static_cast<double>(bytes), quick ? 3.0 : 10.0, quick ? 200.0 : 2000.0));
}

/// Seconds per call of `op` over all ranks: the slowest rank's mean, the best of 3 rounds.
template <typename Op>
double time_collective(Communicator& comm, int iterations, Op&& op) {
  double best = 1e300;
  for (int rep = 0; rep < 3; ++rep) {
    comm.barrier();
    op();  // warm-up
    comm.barrier();
    const auto start = Clock::now();
    for (int i = 0; i < iterations; ++i) op();
    const double mean = comm.allreduce_value(seconds_since(start) / iterations, ReduceOp::Max);
    best = std::min(best, mean);
  }
  return best;
}

/// Busy arithmetic for `iterations` steps (not optimized away).
double spin(std::int64_t iterations) {
  volatile double x = 1.0;
  for (std::int64_t i = 0; i < iterations; ++i) x = x * 1.0000001 + 1e-9;
  return x;
}

}  // namespace

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// Minimizes sum ((t_i - a - b x_i) / t_i)^2, so that small messages (which set a) count as much
// as large ones (which set b).
std::pair<double, double> fit_line(const std::vector<double>& x, const std::vector<double>& t) {
  if (x.empty() || x.size() != t.size())
    fail("fit_line: needs as many times as sizes and at least one of each, got {} and {}", x.size(), t.size());
  double s00 = 0, s01 = 0, s11 = 0, r0 = 0, r1 = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double w = 1.0 / (t[i] * t[i]);
    s00 += w;
    s01 += w * x[i];
    s11 += w * x[i] * x[i];
    r0 += w * t[i];
    r1 += w * x[i] * t[i];
  }
  const double det = s00 * s11 - s01 * s01;
  double a = (r0 * s11 - r1 * s01) / det;
  double b = (s00 * r1 - s01 * r0) / det;
  if (!(b > 0)) {  // degenerate: a pure latency; keep a tiny positive beta
    b = 1e-15;
    a = r0 / s00;
  }
  if (!(a >= 0)) {  // a line through the origin
    a = 0;
    b = r1 / s11;
  }
  return {a, b};
}

// A point more than 3x off the line (a rank descheduled by another process) is dropped and the
// line refitted, at most twice.
AlphaBeta fit_level(const std::vector<CommPoint>& points, double alpha_factor, double beta_factor) {
  std::vector<double> x, t;
  for (const auto& p : points) {
    x.push_back(p.bytes);
    t.push_back(p.seconds);
  }
  auto [a, b] = fit_line(x, t);
  for (int round = 0; round < 2 && x.size() > 3; ++round) {
    std::size_t worst = 0;
    double worst_ratio = 1;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double model = a + b * x[i];
      const double ratio = std::max(t[i] / model, model / t[i]);
      if (ratio > worst_ratio) worst = i, worst_ratio = ratio;
    }
    if (worst_ratio < 3) break;
    x.erase(x.begin() + static_cast<std::ptrdiff_t>(worst));
    t.erase(t.begin() + static_cast<std::ptrdiff_t>(worst));
    std::tie(a, b) = fit_line(x, t);
  }
  return {a / alpha_factor, b / beta_factor};
}

// A nonblocking allreduce polled with sleeps: a blocking MPI wait spins a core.
void idle_barrier(Communicator& comm) {
  std::int32_t token = 0;
  const auto request = comm.iallreduce(&token, 1, DType::I32, ReduceOp::Sum);
  while (!request->test()) std::this_thread::sleep_for(std::chrono::milliseconds(2));
}

void on_rank0_alone(Communicator& comm, const std::function<void()>& work) {
  std::exception_ptr error;
  if (comm.rank() == 0) {
    try {
      work();
    } catch (...) {
      error = std::current_exception();
    }
  }
  idle_barrier(comm);
  collectively(comm, [&] {
    if (error) std::rethrow_exception(error);
  });
}

std::vector<CommPoint> ping_pong(Communicator& comm, bool quick) {
  require_two_ranks(comm);
  const int rank = comm.rank();
  std::vector<CommPoint> points;
  const std::size_t largest = largest_message(quick);
  std::vector<std::uint8_t> buffer(largest, 1);
  for (std::size_t bytes : message_sizes(largest)) {
    const int iterations = iterations_for(bytes, quick);
    std::vector<double> one_way;
    for (int rep = 0; rep < 3 && rank <= 1; ++rep) {
      const int peer = 1 - rank;
      // Warm-up exchange, then the timed ones.
      Clock::time_point start;
      for (int i = -1; i < iterations; ++i) {
        if (i == 0) start = Clock::now();
        if (rank == 0) {
          comm.send(buffer.data(), bytes, DType::U8, peer, 9);
          comm.recv(buffer.data(), bytes, DType::U8, peer, 9);
        } else {
          comm.recv(buffer.data(), bytes, DType::U8, peer, 9);
          comm.send(buffer.data(), bytes, DType::U8, peer, 9);
        }
      }
      one_way.push_back(seconds_since(start) / (2.0 * iterations));
    }
    if (rank == 0) points.push_back({static_cast<double>(bytes), *std::min_element(one_way.begin(), one_way.end())});
  }
  idle_barrier(comm);
  return points;
}

std::vector<CommPoint> allreduce_points(Communicator& comm, bool quick) {
  require_two_ranks(comm);
  std::vector<CommPoint> points;
  const std::size_t largest = largest_message(quick);
  std::vector<float> data(largest / sizeof(float), 1.0f);
  for (std::size_t bytes : message_sizes(largest)) {
    const std::size_t count = bytes / sizeof(float);
    if (count < 1) continue;
    const double seconds = time_collective(comm, iterations_for(bytes, quick),
                                           [&] { comm.allreduce(data.data(), count, DType::F32, ReduceOp::Sum); });
    points.push_back({static_cast<double>(count * sizeof(float)), seconds});
  }
  return points;
}

// n = bytes each rank sends in all, spread evenly over the other ranks.
std::vector<CommPoint> alltoall_points(Communicator& comm, bool quick) {
  require_two_ranks(comm);
  const int size = comm.size(), rank = comm.rank();
  std::vector<CommPoint> points;
  const std::size_t largest = largest_message(quick);
  std::vector<std::uint8_t> send(largest), recv(largest);
  std::vector<std::int64_t> counts(static_cast<std::size_t>(size)), displs(static_cast<std::size_t>(size));
  for (std::size_t bytes : message_sizes(largest)) {
    const std::size_t per_peer = std::max<std::size_t>(1, bytes / static_cast<std::size_t>(size - 1));
    std::int64_t offset = 0;
    for (int r = 0; r < size; ++r) {
      counts[static_cast<std::size_t>(r)] = r == rank ? 0 : static_cast<std::int64_t>(per_peer);
      displs[static_cast<std::size_t>(r)] = offset;
      offset += counts[static_cast<std::size_t>(r)];
    }
    const double seconds = time_collective(comm, iterations_for(bytes, quick), [&] {
      comm.alltoallv(send.data(), counts, displs, recv.data(), counts, displs, DType::U8);
    });
    points.push_back({static_cast<double>(per_peer * static_cast<std::size_t>(size - 1)), seconds});
  }
  return points;
}

namespace {

// Each rank alternates `work` seconds of work with an allreduce of every rank (as a step's
// gradient allreduce, or its chain of halo exchanges, ties every rank together).
class WaitProbe {
 public:
  WaitProbe(Communicator& comm, const Machine& machine, double work) : comm_(comm) {
    double solo = 0;  // the work's seconds on rank 0 alone
    on_rank0_alone(comm, [&] {
      const auto start = Clock::now();
      spin(iterations_);
      const double t = seconds_since(start);
      iterations_ = std::max<std::int64_t>(
          1000, static_cast<std::int64_t>(static_cast<double>(iterations_) * work / std::max(t, 1e-6)));
      const auto again = Clock::now();
      spin(iterations_);
      solo = seconds_since(again);
    });
    comm.broadcast(&iterations_, 1, DType::I64, 0);
    comm.broadcast(&solo, 1, DType::F64, 0);
    rounds_ = std::max(20, static_cast<int>(0.2 / std::max(solo, 1e-5)));  // about 0.2 s of work
    work_ = solo * machine.oversubscription(comm.size());
    expected_ = work_ + machine.intra.allreduce.alpha + sizeof(double) * machine.intra.allreduce.beta;
  }

  /// A round's time beyond the work (stretched by the node's oversubscription) and one small
  /// allreduce: the wait, the same on every rank.
  double wait() {
    comm_.barrier();
    const auto start = Clock::now();
    for (int round = 0; round < rounds_; ++round) {
      spin(iterations_);
      (void)comm_.allreduce_value(1.0, ReduceOp::Sum);
    }
    return comm_.allreduce_value(seconds_since(start) / rounds_, ReduceOp::Max) - expected_;
  }

  /// A rank's work as it takes on the shared node (as calibrate times the kernels, all ranks at once).
  double work() const { return work_; }

 private:
  Communicator& comm_;
  std::int64_t iterations_ = 1 << 20;
  double work_ = 0, expected_ = 0;
  int rounds_ = 0;
};

}  // namespace

SyncWait measure_sync_wait(Communicator& comm, const Machine& machine, int repeats) {
  require_two_ranks(comm);
  // Two amounts of work, as short as a layer's kernel and as long as a small model's step: the
  // wait's fixed part and the part that grows with the work (a descheduled peer is late by a share
  // of its work, the work as the node's sharing stretches it, as the cost model's kernel timings
  // are). They lie far apart, so that the share is not the difference of two noises; they
  // alternate, so that a slow minute of the machine slows both; the share is the median of the
  // pairs' (at least 9: how the scheduler places the ranks changes from turn to turn). The fixed
  // part is measured in the same turns with a third, tiny amount of work (as little as a small
  // layer's kernel), so that it is not the share's error extrapolated over the short work.
  WaitProbe tiny_work(comm, machine, 0.1e-3), short_work(comm, machine, 1e-3), long_work(comm, machine, 16e-3);
  const double apart = std::max(long_work.work() - short_work.work(), 1e-6);
  std::vector<double> shares, tiny_waits;
  for (int turn = 0; turn < std::max(9, repeats); ++turn) {
    const double tiny_wait = tiny_work.wait();
    const double short_wait = short_work.wait();
    const double long_wait = long_work.wait();
    tiny_waits.push_back(tiny_wait);
    shares.push_back((long_wait - short_wait) / apart);
  }
  SyncWait w;
  w.share = std::max(0.0, median(shares));  // the same on every rank (from allreduced values)
  w.seconds = std::max(0.0, median(tiny_waits) - w.share * tiny_work.work());
  return w;
}

BoxCopyRate measure_box_copies(Communicator& comm, int repeats, std::size_t sweep_bytes) {
  std::vector<float> sweep(std::max<std::size_t>(sweep_bytes / sizeof(float), 16), 1.0f);
  constexpr std::int64_t kFloats = 1 << 20;
  double seconds[2] = {0, 0}, runs[2] = {0, 0}, bytes[2] = {0, 0};
  const std::int64_t rows_of[2] = {7, 1024};
  for (int k = 0; k < 2; ++k) {
    const std::int64_t row = rows_of[k], n = kFloats / row;
    const Box tile{{0, 0}, {n, row}}, window{{0, -2}, {n, row + 4}};
    std::vector<float> from(static_cast<std::size_t>(tile.numel()), 1.0f), to(static_cast<std::size_t>(window.numel()));
    std::vector<double> times;
    for (int call = -1; call < std::max(3, repeats); ++call) {  // one untimed call first
      for (std::size_t i = 0; i < sweep.size(); i += 16) sweep[i] += 1.0f;  // a line each: the caches cold
      comm.barrier();
      const auto start = Clock::now();
      copy_box(tile, from.data(), tile, to.data(), window);
      const double t = comm.allreduce_value(seconds_since(start), ReduceOp::Max);
      if (call >= 0) times.push_back(t);
    }
    seconds[k] = median(times);
    runs[k] = static_cast<double>(n);
    bytes[k] = static_cast<double>(tile.numel()) * sizeof(float);
  }
  // seconds = runs x run_seconds + bytes / bandwidth, solved for the two copies.
  BoxCopyRate rate;
  const double det = runs[0] * bytes[1] - runs[1] * bytes[0];
  rate.run_seconds = std::max(0.0, (seconds[0] * bytes[1] - seconds[1] * bytes[0]) / det);
  const double per_byte = std::max(1e-15, (seconds[1] - runs[1] * rate.run_seconds) / bytes[1]);
  rate.bandwidth = 1.0 / per_byte;
  return rate;
}

}  // namespace tessera
