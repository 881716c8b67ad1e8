#pragma once
// Which dataset rows make up each global batch. The per-epoch order comes from the counter-based
// RNG keyed by (seed, epoch), so it is the same on every rank and for every rank count: a
// distributed run sees the same batches as the 1-rank run.
#include <cstdint>
#include <mutex>
#include <vector>

namespace tessera {

struct SamplerOptions {
  std::int64_t dataset_size = 0;
  std::int64_t global_batch = 1;
  std::uint64_t seed = 0;
  bool shuffle = true;
  /// Drop the last, partial batch of an epoch (otherwise it is kept, smaller).
  bool drop_last = false;
};

class EpochSampler {
 public:
  explicit EpochSampler(const SamplerOptions& options);
  EpochSampler(const EpochSampler& other);
  EpochSampler& operator=(const EpochSampler& other);

  const SamplerOptions& options() const { return options_; }
  std::int64_t batches_per_epoch() const;
  /// Dataset indices of global batch `index` of `epoch` (in batch order).
  std::vector<std::int64_t> batch(std::int64_t epoch, std::int64_t index) const;
  /// The order of the dataset rows in `epoch` (the identity without shuffle).
  std::vector<std::int64_t> permutation(std::int64_t epoch) const;

 private:
  /// The cached permutation of `epoch` (computed on first use); the caller holds mutex_.
  const std::vector<std::int64_t>& cached(std::int64_t epoch) const;

  SamplerOptions options_;
  mutable std::mutex mutex_;
  mutable std::int64_t cached_epoch_ = -1;
  mutable std::vector<std::int64_t> cached_order_;
};

}  // namespace tessera
