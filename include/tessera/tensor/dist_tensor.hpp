#pragma once
// A distributed tensor: global shape + distribution + grid + exactly one local tensor
// (the rank's tile, padded for halos).
#include <memory>

#include "tessera/tensor/distribution.hpp"
#include "tessera/tensor/proc_grid.hpp"
#include "tessera/tensor/tensor.hpp"

namespace tessera {

class DistTensor {
 public:
  DistTensor() = default;
  DistTensor(Shape global, Distribution distribution, std::shared_ptr<ProcGrid> grid);

  const Shape& global_shape() const { return global_; }
  const Distribution& distribution() const { return distribution_; }
  ProcGrid& grid() const { return *grid_; }
  std::shared_ptr<ProcGrid> grid_ptr() const { return grid_; }
  /// This rank's tile without halos.
  const Box& local_box() const { return box_; }
  Tensor& local() { return local_; }
  const Tensor& local() const { return local_; }

 private:
  Shape global_;
  Distribution distribution_;
  std::shared_ptr<ProcGrid> grid_;
  Box box_;
  Tensor local_;
};

}  // namespace tessera
