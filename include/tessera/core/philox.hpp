#pragma once
// Philox-4x32-10, the counter-based generator behind tessera/core/rng.hpp, as inline functions
// that host code and CUDA kernels share: a value depends only on (seed, stream, index), so a GPU
// draws bit for bit what the host draws. Free of C++20 so that nvcc compiles it.
#include <cstdint>

#if defined(__CUDACC__)
#define TESSERA_RNG_HOST_DEVICE __host__ __device__
#else
#define TESSERA_RNG_HOST_DEVICE
#endif

namespace tessera::philox {

struct Words {
  std::uint32_t w[4];
};

TESSERA_RNG_HOST_DEVICE inline Words philox4x32_10(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  constexpr std::uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  std::uint32_t c0 = static_cast<std::uint32_t>(index), c1 = static_cast<std::uint32_t>(index >> 32);
  std::uint32_t c2 = static_cast<std::uint32_t>(stream), c3 = static_cast<std::uint32_t>(stream >> 32);
  std::uint32_t k0 = static_cast<std::uint32_t>(seed), k1 = static_cast<std::uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = static_cast<std::uint64_t>(kMul0) * c0;
    const std::uint64_t p1 = static_cast<std::uint64_t>(kMul1) * c2;
    const std::uint32_t hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
    const std::uint32_t hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
    const std::uint32_t n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return Words{{c0, c1, c2, c3}};
}

/// [0, 1) with 24 random bits.
TESSERA_RNG_HOST_DEVICE inline float unit_float(std::uint32_t x) {
  return static_cast<float>(x >> 8) * (1.0f / 16777216.0f);
}

}  // namespace tessera::philox
