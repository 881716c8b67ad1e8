#pragma once
// Reads the next batch while this one trains. A Prefetcher owns one background thread that
// performs every read of its dataset, in submission order: HDF5 is not thread-safe, and a
// collective read must be issued in the same order on every rank. The dataset's own duplicated
// communicator keeps these collectives apart from training's (MPI must provide
// MPI_THREAD_MULTIPLE).
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "tessera/io/dataset.hpp"

namespace tessera {

struct ReadRequest {
  std::vector<std::int64_t> indices;
  /// Over the per-sample dimensions; empty: whole samples.
  Box box;
};

struct Batch {
  Tensor inputs;
  Tensor targets;
  std::vector<std::int64_t> indices;
};

class Prefetcher {
 public:
  /// From now on, use `dataset` only through this prefetcher.
  explicit Prefetcher(std::shared_ptr<Dataset> dataset);
  /// Finishes every submitted read (they are collective: each rank must complete the same ones),
  /// then joins the thread. Results not taken are dropped.
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  /// Queues a read; the thread starts it as soon as the earlier ones are done. Submit batch k+1
  /// before taking batch k to overlap its read with batch k's compute.
  void submit(ReadRequest request);
  /// The oldest submitted request's batch, waiting for it if needed. Rethrows the exception its
  /// read raised. Fails if nothing was submitted.
  Batch take();
  /// Submitted requests not yet taken.
  std::size_t pending() const;

 private:
  struct Slot {
    ReadRequest request;
    Batch batch;
    std::exception_ptr error;
    /// Its place in the process-wide order of collective reads (drawn at submit).
    std::uint64_t ticket = 0;
    bool done = false;
  };
  void run();

  std::shared_ptr<Dataset> dataset_;
  mutable std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable batch_ready_;
  /// Submitted, not yet taken, oldest first; the thread works on the first slot not done.
  std::deque<std::shared_ptr<Slot>> slots_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace tessera
