#include "tessera/core/rng.hpp"

#include <cmath>

#include "tessera/core/philox.hpp"

namespace tessera {
namespace {
inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

std::uint64_t rng_substream(RngStream base, std::uint64_t a, std::uint64_t b) {
  return splitmix64(splitmix64(static_cast<std::uint64_t>(base) * 0x100000001B3ull ^ a) ^ (b + 0x632BE59BD9B4E019ull));
}

std::array<std::uint32_t, 4> philox4x32(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  const philox::Words words = philox::philox4x32_10(seed, stream, index);
  return {words.w[0], words.w[1], words.w[2], words.w[3]};
}

float random_uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  return philox::unit_float(philox::philox4x32_10(seed, stream, index).w[0]);
}

float random_normal(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  const auto w = philox4x32(seed, stream, index);
  const double u1 = (static_cast<double>(w[0]) + 1.0) / 4294967297.0;  // (0, 1]
  const double u2 = static_cast<double>(w[1]) / 4294967296.0;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
}

std::uint64_t random_u64(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  const auto w = philox4x32(seed, stream, index);
  return (static_cast<std::uint64_t>(w[0]) << 32) | w[1];
}

}  // namespace tessera
