#pragma once
// Inverted dropout's per-element scales (0, or 1 / (1 - rate) for kept elements), drawn where
// the tensor lives: ElementwiseKernels::dropout_scales on the host or the GPU, one formula for
// both (bit for bit the same draws). Each element's draw is keyed by its global index in the
// batch's N x C x D x H x W tensor, so any split of the batch, the channels or the volume draws
// what one rank would. Free of C++20 so that nvcc compiles it.
#include <cstdint>

#include "tessera/core/philox.hpp"

namespace tessera {

/// The local tensor (samples x channels x local[0..2], 2-D volumes with depth 1, features with
/// 1 x 1 x 1) and where it lies in the global one.
struct DropoutMask {
  std::uint64_t seed = 0, stream = 0;
  float rate = 0, keep_scale = 1;
  std::int64_t channels = 1;                    ///< local channels (features)
  std::int64_t sample_offset = 0;               ///< global position of local sample 0
  std::int64_t global_channels = 1, channel_offset = 0;
  std::int64_t local[3] = {1, 1, 1}, global[3] = {1, 1, 1}, origin[3] = {0, 0, 0};
  /// Whole samples with all their channels: the global index is first + i (no divisions).
  bool whole = false;
  std::int64_t first = 0;
};

/// The global index of local element `i` (row-major over samples x channels x local).
TESSERA_RNG_HOST_DEVICE inline std::int64_t dropout_global_index(const DropoutMask& m, std::int64_t i) {
  const std::int64_t w = i % m.local[2];
  i /= m.local[2];
  const std::int64_t h = i % m.local[1];
  i /= m.local[1];
  const std::int64_t d = i % m.local[0];
  i /= m.local[0];
  const std::int64_t c = i % m.channels, n = i / m.channels;
  const std::int64_t plane = (m.sample_offset + n) * m.global_channels + m.channel_offset + c;
  const std::int64_t g =
      ((plane * m.global[0] + m.origin[0] + d) * m.global[1] + m.origin[1] + h) * m.global[2] + m.origin[2] + w;
  return g;
}

/// The scale of local element `i` (row-major over samples x channels x local).
TESSERA_RNG_HOST_DEVICE inline float dropout_scale(const DropoutMask& m, std::int64_t i) {
  const std::int64_t g = m.whole ? m.first + i : dropout_global_index(m, i);
  const float draw = philox::unit_float(philox::philox4x32_10(m.seed, m.stream, static_cast<std::uint64_t>(g)).w[0]);
  return draw >= m.rate ? m.keep_scale : 0.0f;
}

}  // namespace tessera
