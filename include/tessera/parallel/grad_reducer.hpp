#pragma once
// Sums gradients over each weight's replica group. Gradients are registered in the order backward
// produces them and packed into buckets; each gradient tensor becomes a view into its bucket's
// flat buffer, so a bucket is reduced in place without copies. A bucket's nonblocking allreduce
// starts as soon as its last gradient is ready, overlapping the rest of backward. On GPUs with a
// communicator of GPU memory (NCCL) the buckets are reduced in place on the communication stream;
// with one of host memory (MPI), through a host copy.
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "tessera/core/communicator.hpp"
#include "tessera/tensor/tensor.hpp"

namespace tessera {

class Watchdog;

struct GradReducerOptions {
  /// A bucket closes once it holds at least this many bytes.
  std::size_t bucket_bytes = 1 << 20;
};

class GradReducer {
 public:
  explicit GradReducer(GradReducerOptions options = {});

  /// Registers a gradient and the group of ranks that hold replicas of its weight. Call in the
  /// order backward produces gradients, then `build()`. The tensor is re-pointed into a bucket.
  void add(Tensor& grad, Communicator& replica_group);
  void build();

  /// Gradient `grad` (registered earlier) is final for this step. Every rank must mark gradients
  /// in the same order: nonblocking collectives on one communicator must start in the same order.
  void ready(const Tensor& grad);
  /// Waits for every reduction of this step. Every registered gradient must have been marked ready.
  void finish();

  std::size_t bucket_count() const { return buckets_.size(); }
  /// While `finish()` waits for bucket k, the watchdog (may be null) reads
  /// "gradient allreduce (bucket k of n)".
  void set_watchdog(Watchdog* watchdog) { watchdog_ = watchdog; }
  /// Bytes this rank sends into allreduces per step.
  std::size_t bytes_per_step() const;

 private:
  struct Bucket {
    Communicator* group = nullptr;
    Tensor flat;
    /// Gradients on a GPU reduced over host memory (MPI): the host copy the allreduce works on
    /// (copied back in finish); unused otherwise.
    Tensor staged;
    std::vector<Tensor*> grads;
    std::size_t pending = 0;
    std::unique_ptr<CommRequest> request;
  };
  struct Entry {
    Tensor* grad;
    Communicator* group;
    std::size_t bucket = 0;
    bool marked = false;  ///< marked ready in this step
  };
  void start(Bucket& bucket);
  /// A bucket on a GPU reduced over host memory (MPI): through `staged`.
  static bool through_host(const Bucket& bucket);

  GradReducerOptions options_;
  std::vector<Entry> entries_;
  std::vector<Bucket> buckets_;
  bool built_ = false;
  Watchdog* watchdog_ = nullptr;
  /// One watchdog label per bucket, built once.
  std::vector<std::string> labels_;
};

}  // namespace tessera
