// make_nccl_communicator in a build without CUDA: a clear error.
#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/parallel/nccl_communicator.hpp"

namespace tessera {
std::unique_ptr<Communicator> make_nccl_communicator(const Communicator&) {
  fail("the NCCL communicator: {}. Rebuild with -DTESSERA_ENABLE_CUDA=ON.", cuda::unavailable_reason());
}
}  // namespace tessera
