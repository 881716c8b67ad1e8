#include "tessera/io/sampler.hpp"

#include <numeric>
#include <utility>

#include "tessera/core/error.hpp"
#include "tessera/core/rng.hpp"

namespace tessera {

EpochSampler::EpochSampler(const SamplerOptions& options) : options_(options) {
  if (options_.dataset_size < 0) fail_input("sampler: dataset size {} is negative", options_.dataset_size);
  if (options_.global_batch < 1) fail_input("sampler: global batch {} must be at least 1", options_.global_batch);
  if (options_.drop_last && options_.global_batch > options_.dataset_size) {
    fail_input("sampler: global batch {} is larger than the dataset ({} samples) and the partial batch is dropped: "
               "an epoch would have no batch",
               options_.global_batch, options_.dataset_size);
  }
}

EpochSampler::EpochSampler(const EpochSampler& other) : options_(other.options_) {}

EpochSampler& EpochSampler::operator=(const EpochSampler& other) {
  if (this != &other) {
    std::scoped_lock lock(mutex_, other.mutex_);
    options_ = other.options_;
    cached_epoch_ = -1;
    cached_order_.clear();
  }
  return *this;
}

std::int64_t EpochSampler::batches_per_epoch() const {
  const auto full = options_.dataset_size / options_.global_batch;
  const bool partial = options_.dataset_size % options_.global_batch != 0;
  return full + (partial && !options_.drop_last ? 1 : 0);
}

const std::vector<std::int64_t>& EpochSampler::cached(std::int64_t epoch) const {
  TESSERA_CHECK(epoch >= 0, "sampler: negative epoch {}", epoch);
  if (epoch == cached_epoch_) return cached_order_;
  const auto n = options_.dataset_size;
  cached_order_.resize(static_cast<std::size_t>(n));
  std::iota(cached_order_.begin(), cached_order_.end(), std::int64_t{0});
  if (options_.shuffle) {
    // Fisher-Yates where the draw for position i is the counter RNG at (seed, epoch stream, i):
    // O(n), and the same permutation on every rank for any rank count. The modulo bias is at
    // most n / 2^64.
    const std::uint64_t stream = rng_substream(RngStream::Shuffle, static_cast<std::uint64_t>(epoch));
    for (std::int64_t i = n - 1; i > 0; --i) {
      const std::uint64_t draw = random_u64(options_.seed, stream, static_cast<std::uint64_t>(i));
      const auto j = draw % static_cast<std::uint64_t>(i + 1);
      std::swap(cached_order_[static_cast<std::size_t>(i)], cached_order_[static_cast<std::size_t>(j)]);
    }
  }
  cached_epoch_ = epoch;
  return cached_order_;
}

std::vector<std::int64_t> EpochSampler::permutation(std::int64_t epoch) const {
  std::lock_guard lock(mutex_);
  return cached(epoch);
}

std::vector<std::int64_t> EpochSampler::batch(std::int64_t epoch, std::int64_t index) const {
  TESSERA_CHECK(index >= 0 && index < batches_per_epoch(), "sampler: batch {} outside the {} batches of an epoch",
                index, batches_per_epoch());
  std::lock_guard lock(mutex_);
  const auto& order = cached(epoch);
  const auto begin = index * options_.global_batch;
  const auto end = std::min(begin + options_.global_batch, options_.dataset_size);
  return {order.begin() + begin, order.begin() + end};
}

}  // namespace tessera
