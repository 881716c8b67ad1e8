#pragma once
// How a global tensor is cut into tiles over a processor grid: a pure value type, no MPI.
// Each tensor dimension is either whole on every rank or block-split over one grid axis.
// Blocks may be uneven: part i of n elements over p parts is [i*n/p, (i+1)*n/p).
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/tensor/shape.hpp"

namespace tessera {

struct DimSplit {
  int grid_axis = -1;  ///< -1: the dimension is not split.
  int halo = 0;        ///< Halo width on each side (spatial dimensions).
  bool operator==(const DimSplit&) const = default;
};

/// First global index of block `part` of `extent` elements cut into `parts`.
std::int64_t block_begin(std::int64_t extent, int parts, int part);
std::int64_t block_extent(std::int64_t extent, int parts, int part);

/// A box of a global tensor: begin and extent per dimension.
struct Box {
  std::vector<std::int64_t> begin;
  std::vector<std::int64_t> extent;
  std::int64_t numel() const;
  bool operator==(const Box&) const = default;
};

class Distribution {
 public:
  Distribution() = default;
  /// `grid_shape`: extents of the processor grid axes; `splits`: one per tensor dimension.
  Distribution(std::vector<int> grid_shape, std::vector<DimSplit> splits);
  /// Every dimension whole on every rank of the grid.
  static Distribution replicated(std::vector<int> grid_shape, int tensor_rank);
  /// Dimension 0 (samples) split over grid axis `axis`, everything else whole.
  static Distribution sample_split(std::vector<int> grid_shape, int tensor_rank, int axis = 0);

  const std::vector<int>& grid_shape() const { return grid_shape_; }
  const std::vector<DimSplit>& splits() const { return splits_; }
  int tensor_rank() const { return static_cast<int>(splits_.size()); }
  /// Number of parts dimension `dim` is cut into.
  int parts(int dim) const;
  int grid_size() const;

  /// The tile owned by the rank at `coords` (without halos).
  Box local_box(const Shape& global, const std::vector<int>& coords) const;
  /// The local shape including halos on both sides of split dimensions.
  Shape local_shape_with_halo(const Shape& global, const std::vector<int>& coords) const;
  /// Grid axes over which the tensor is replicated (not used by any split): ranks along them hold the same tile.
  std::vector<int> replicated_axes() const;
  /// Checks the distribution fits the shape (no empty blocks, halos narrower than blocks).
  void validate(const Shape& global) const;

  bool operator==(const Distribution&) const = default;
  std::string to_string() const;

 private:
  std::vector<int> grid_shape_;
  std::vector<DimSplit> splits_;
};

}  // namespace tessera
