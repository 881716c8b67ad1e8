#pragma once
// Copies, sums and fills over boxes of dense row-major tiles, on the host or on a GPU: the packing
// and unpacking of every halo exchange and redistribution (TileExchange). A tile of box B holds
// the elements of B (global coordinates) in row-major order; `region` lies inside the tiles'
// boxes. On a GPU the pointers are device memory and the work is queued on that GPU's stream.
#include "tessera/core/device.hpp"
#include "tessera/tensor/box.hpp"

namespace tessera {

/// Boxes of at most this many dimensions.
constexpr int kMaxBoxRank = 6;

/// dst[region] = src[region].
void copy_box(const Box& region, const float* src, const Box& src_box, float* dst, const Box& dst_box,
              const Device& device = Device::host());
/// dst[region] += src[region] (element by element: sums over several calls keep the calls' order).
void add_box(const Box& region, const float* src, const Box& src_box, float* dst, const Box& dst_box,
             const Device& device = Device::host());
/// dst[region] = value.
void fill_box(const Box& region, float* dst, const Box& dst_box, float value, const Device& device = Device::host());

}  // namespace tessera
