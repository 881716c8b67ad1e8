#pragma once
// Halo overlap: a layer on a spatial tile computes while its halos travel. Before the halos
// arrive, its window holds the rank's own block (and, at the global boundary, the padding); the
// outputs whose inputs lie there (the interior) can be computed. The executor runs the layer on
// the whole window then (the interior comes out right, the rest not yet), waits for the halos,
// and recomputes the outputs that read them (the boundary) region by region. The boundary is
// computed twice, so the executor overlaps only where it is a small share of the tile.
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/parallel/halo_overlap_mode.hpp"

namespace tessera {

class Layer;

/// A box of a tile's outputs over its spatial dimensions, in local coordinates.
struct OutputRegion {
  std::vector<std::int64_t> begin, extent;
};

struct HaloSplit {
  /// Some output reads only positions that are ready (there is something to overlap).
  bool interior = false;
  /// Disjoint boxes that together hold exactly the outputs that read a position not ready.
  std::vector<OutputRegion> boundary;
  /// The boundary's outputs over the tile's.
  double boundary_share = 0;
};

/// Splits the tile's outputs [output_begin, output_begin + output_extent) (global positions, one
/// entry per spatial dimension) by what they read through `layer.input_range`: the interior reads
/// only global input positions in [ready_begin, ready_end) per dimension, the boundary the rest.
/// The boundary boxes: per dimension d in order, the outputs below and above the interior along d
/// that lie within the interior along the dimensions before d (any position along those after).
HaloSplit split_at_halos(const Layer& layer, const std::vector<std::int64_t>& ready_begin,
                         const std::vector<std::int64_t>& ready_end, const std::vector<std::int64_t>& output_begin,
                         const std::vector<std::int64_t>& output_extent);

}  // namespace tessera
