#include "tessera/core/rng.hpp"

#include <cmath>

namespace tessera {
namespace {
constexpr std::uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;

inline void mulhilo(std::uint32_t a, std::uint32_t b, std::uint32_t& hi, std::uint32_t& lo) {
  const std::uint64_t p = static_cast<std::uint64_t>(a) * b;
  hi = static_cast<std::uint32_t>(p >> 32);
  lo = static_cast<std::uint32_t>(p);
}

inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline float to_unit(std::uint32_t x) {  // [0, 1) with 24 random bits
  return static_cast<float>(x >> 8) * (1.0f / 16777216.0f);
}
}  // namespace

std::uint64_t rng_substream(RngStream base, std::uint64_t a, std::uint64_t b) {
  return splitmix64(splitmix64(static_cast<std::uint64_t>(base) * 0x100000001B3ull ^ a) ^ (b + 0x632BE59BD9B4E019ull));
}

std::array<std::uint32_t, 4> philox4x32(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  std::uint32_t c0 = static_cast<std::uint32_t>(index), c1 = static_cast<std::uint32_t>(index >> 32);
  std::uint32_t c2 = static_cast<std::uint32_t>(stream), c3 = static_cast<std::uint32_t>(stream >> 32);
  std::uint32_t k0 = static_cast<std::uint32_t>(seed), k1 = static_cast<std::uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    std::uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kMul0, c0, hi0, lo0);
    mulhilo(kMul1, c2, hi1, lo1);
    const std::uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {c0, c1, c2, c3};
}

float random_uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  return to_unit(philox4x32(seed, stream, index)[0]);
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
