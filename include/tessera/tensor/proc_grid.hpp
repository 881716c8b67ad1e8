#pragma once
// A Cartesian processor grid over a communicator (row-major: the last axis varies fastest).
// It caches one sub-communicator per set of axes.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/core/communicator.hpp"

namespace tessera {

/// Row-major grid arithmetic (the last axis varies fastest), for grids that need no
/// communicator (plans, the planner): a rank's coordinates and back.
std::vector<int> grid_coords(const std::vector<int>& grid, int rank);
int grid_rank(const std::vector<int>& grid, const std::vector<int>& coords);

class ProcGrid {
 public:
  /// The product of `shape` must equal comm->size().
  ProcGrid(std::shared_ptr<Communicator> comm, std::vector<int> shape);

  const std::vector<int>& shape() const { return shape_; }
  int ndims() const { return static_cast<int>(shape_.size()); }
  int size() const;
  Communicator& comm() const { return *comm_; }
  std::shared_ptr<Communicator> comm_ptr() const { return comm_; }
  int rank() const { return comm_->rank(); }
  const std::vector<int>& coords() const { return coords_; }
  std::vector<int> coords_of(int rank) const { return grid_coords(shape_, rank); }
  int rank_of(const std::vector<int>& coords) const { return grid_rank(shape_, coords); }

  /// The communicator of the ranks that differ from this one only along `axes`
  /// (created on first use, collectively over the whole grid, then cached).
  Communicator& sub_comm(const std::vector<int>& axes);

 private:
  std::shared_ptr<Communicator> comm_;
  std::vector<int> shape_;
  std::vector<int> coords_;
  std::map<std::vector<int>, std::unique_ptr<Communicator>> sub_comms_;
};

}  // namespace tessera
