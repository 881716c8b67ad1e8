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

namespace tessera {

class Layer;

enum class HaloOverlap {
  /// Where a halo comes from another node and the boundary is at most kMaxRecomputedShare of the
  /// tile's outputs. Between ranks of one node a halo is a memory copy: there is little to hide,
  /// and on the 2-core development VM overlapping measured no gain (README, "Spatial parallelism").
  /// That is each rank's choice in forward; in backward (the reverse exchange while the weight
  /// gradients are computed) every rank overlaps a layer's exchange where any rank would, so
  /// that every rank queues its operations in the same order (NCCL runs them so).
  Automatic,
  Always,  ///< wherever the layer can (any boundary share below 1; any node)
  Never,   ///< every halo exchange completes before its layer runs
};

/// The largest share of a tile's outputs that Automatic recomputes to overlap a halo exchange.
inline constexpr double kMaxRecomputedShare = 0.125;

/// "auto", "always" or "never"; an InputError naming the choices otherwise.
HaloOverlap parse_halo_overlap(const std::string& text);
const char* to_string(HaloOverlap overlap);

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
