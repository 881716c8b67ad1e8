// A build without CUDA: box operations on a GPU are refused with the reason.
#include "tessera/core/error.hpp"
#include "box_walk.hpp"

namespace tessera::detail {

void cuda_box_op(BoxOp, const BoxWalk&, const float*, float*, float, int device) {
  fail("box operation on GPU {}: this Tessera was built without CUDA (configure with -DTESSERA_ENABLE_CUDA=ON)",
       device);
}

}  // namespace tessera::detail
