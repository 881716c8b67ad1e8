#include "tessera/tensor/dist_tensor.hpp"

#include "tessera/core/error.hpp"

namespace tessera {

DistTensor::DistTensor(Shape global, Distribution distribution, std::shared_ptr<ProcGrid> grid)
    : global_(std::move(global)), distribution_(std::move(distribution)), grid_(std::move(grid)) {
  TESSERA_CHECK(grid_ != nullptr, "DistTensor: no processor grid");
  TESSERA_CHECK(distribution_.grid_shape() == grid_->shape(), "DistTensor: distribution {} on a different grid",
                distribution_.to_string());
  distribution_.validate(global_);
  box_ = distribution_.local_box(global_, grid_->coords());
  local_ = Tensor(distribution_.local_shape_with_halo(global_, grid_->coords()));
}

}  // namespace tessera
