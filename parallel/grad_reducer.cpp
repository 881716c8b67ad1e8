#include "tessera/parallel/grad_reducer.hpp"

#include "tessera/core/error.hpp"
#include "tessera/parallel/watchdog.hpp"

namespace tessera {

GradReducer::GradReducer(GradReducerOptions options) : options_(options) {}

void GradReducer::add(Tensor& grad, Communicator& replica_group) {
  TESSERA_CHECK(!built_, "GradReducer::add after build()");
  TESSERA_CHECK(!replica_group.moves_gpu_memory() || !grad.device().is_host(),
                "GradReducer: a gradient on the host cannot be reduced over {}, which moves GPU memory",
                replica_group.name());
  entries_.push_back({&grad, &replica_group});
}

void GradReducer::build() {
  TESSERA_CHECK(!built_, "GradReducer::build twice");
  built_ = true;
  // Consecutive gradients of the same group share a bucket until it holds bucket_bytes.
  std::vector<std::vector<std::size_t>> members;
  std::size_t bytes = 0;
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    auto& e = entries_[i];
    const bool new_bucket = buckets_.empty() || buckets_.back().group != e.group || bytes >= options_.bucket_bytes ||
                            entries_[i - 1].grad->device() != e.grad->device();
    if (new_bucket) {
      buckets_.emplace_back();
      buckets_.back().group = e.group;
      members.emplace_back();
      bytes = 0;
    }
    e.bucket = buckets_.size() - 1;
    members.back().push_back(i);
    bytes += static_cast<std::size_t>(e.grad->numel()) * sizeof(float);
  }
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    auto& bucket = buckets_[b];
    std::int64_t total = 0;
    for (auto i : members[b]) total += entries_[i].grad->numel();
    bucket.flat = Tensor(Shape({total}), entries_[members[b].front()].grad->device());
    std::int64_t offset = 0;
    for (auto i : members[b]) {
      Tensor& g = *entries_[i].grad;
      const std::int64_t n = g.numel();
      Tensor view = bucket.flat.slice(offset, offset + n).reshape(g.shape());
      view.copy_from(g);
      g = view;
      bucket.grads.push_back(&g);
      offset += n;
    }
    bucket.pending = bucket.grads.size();
  }
  for (std::size_t b = 0; b < buckets_.size(); ++b)
    labels_.push_back("gradient allreduce (bucket " + std::to_string(b + 1) + " of " +
                      std::to_string(buckets_.size()) + ")");
}

void GradReducer::ready(const Tensor& grad) {
  TESSERA_CHECK(built_, "GradReducer::ready before build()");
  Entry* entry = nullptr;
  for (auto& e : entries_) {
    if (e.grad == &grad || (e.grad->data() == grad.data() && e.grad->numel() == grad.numel())) {
      entry = &e;
      break;
    }
  }
  TESSERA_CHECK(entry != nullptr, "GradReducer::ready: a gradient of shape {} that was never registered",
                grad.shape().to_string());
  // Checked per gradient, not per bucket: a second mark must not start a bucket whose other
  // gradients are not final yet.
  TESSERA_CHECK(!entry->marked, "GradReducer: a gradient was marked ready twice in one step");
  entry->marked = true;
  Bucket& bucket = buckets_[entry->bucket];
  if (--bucket.pending == 0) start(bucket);
  // Give in-flight reductions a chance to progress (MPI progresses nonblocking collectives inside MPI calls).
  for (auto& b : buckets_)
    if (b.request) b.request->test();
}

bool GradReducer::through_host(const Bucket& bucket) {
  return !bucket.flat.device().is_host() && !bucket.group->moves_gpu_memory();
}

void GradReducer::start(Bucket& bucket) {
  if (bucket.group->size() == 1) return;  // one replica: its gradient is the sum
  Tensor* reduced = &bucket.flat;
  if (through_host(bucket)) {
    // Gradients on a GPU with a communicator of host memory (MPI): reduced through a host copy.
    // With one of GPU memory (NCCL) the bucket is reduced where it is, on the communication
    // stream, while backward goes on.
    bucket.staged.resize(bucket.flat.shape(), Device::host());
    bucket.staged.copy_from(bucket.flat);
    reduced = &bucket.staged;
  }
  bucket.request = bucket.group->iallreduce(reduced->data(), static_cast<std::size_t>(reduced->numel()), DType::F32,
                                            ReduceOp::Sum);
}

void GradReducer::finish() {
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    TESSERA_CHECK(bucket.pending == 0, "GradReducer::finish: {} gradients of a bucket were never marked ready",
                  bucket.pending);
    if (bucket.request) {
      const WatchdogScope scope(watchdog_, labels_[b].c_str());
      bucket.request->wait();
      bucket.request.reset();
      if (through_host(bucket)) bucket.flat.copy_from(bucket.staged);
    }
    bucket.pending = bucket.grads.size();
  }
  for (auto& e : entries_) e.marked = false;
}

std::size_t GradReducer::bytes_per_step() const {
  std::size_t bytes = 0;
  for (const auto& b : buckets_)
    if (b.group->size() > 1) bytes += static_cast<std::size_t>(b.flat.numel()) * sizeof(float);
  return bytes;
}

}  // namespace tessera
