#pragma once
// Rounding fp32 to bf16 on the bits, one definition for the host loops and the CUDA kernels so
// that both round every value the same way.
#include <cstdint>

#if defined(__CUDACC__)
#define TESSERA_HOST_DEVICE __host__ __device__
#else
#define TESSERA_HOST_DEVICE
#endif

namespace tessera {

/// The fp32 bits of the bf16 value nearest to the fp32 value with bits `bits` (ties to even;
/// beyond bf16's largest finite value: infinity). Infinities stay; NaNs stay NaN (made quiet,
/// so that dropping the low bits cannot turn one into an infinity).
TESSERA_HOST_DEVICE inline std::uint32_t bf16_round_bits(std::uint32_t bits) {
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (bits | 0x00400000u) & 0xffff0000u;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return bits & 0xffff0000u;
}

}  // namespace tessera
