#pragma once
// When the executor overlaps a layer's halo exchange with its compute (tessera/train/
// halo_overlap.hpp has the mechanism): the job's choice, which the planner prices too (a layer
// that overlaps keeps copies of its boundary regions).
#include <string>

namespace tessera {

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

}  // namespace tessera
