#pragma once
// Counter-based random numbers (Philox-4x32-10). A value depends only on (seed, stream, index),
// never on which rank draws it or in which order, so every tiling of a tensor draws the same values.
#include <array>
#include <cstdint>

namespace tessera {

/// Named streams keep independent uses of one seed apart.
enum class RngStream : std::uint64_t {
  WeightInit = 1,
  Dropout = 2,
  Shuffle = 3,
  Data = 4,
  Straggler = 5,
};

/// Combine a base stream with a sub-key (layer id, step, epoch...) into one 64-bit stream id.
std::uint64_t rng_substream(RngStream base, std::uint64_t a, std::uint64_t b = 0);

/// Four independent 32-bit words for (seed, stream, index).
std::array<std::uint32_t, 4> philox4x32(std::uint64_t seed, std::uint64_t stream, std::uint64_t index);

/// Uniform in [0, 1).
float random_uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t index);
/// Standard normal (Box-Muller on two words of the same counter).
float random_normal(std::uint64_t seed, std::uint64_t stream, std::uint64_t index);
/// Uniform 64-bit integer.
std::uint64_t random_u64(std::uint64_t seed, std::uint64_t stream, std::uint64_t index);

}  // namespace tessera
