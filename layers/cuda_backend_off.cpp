// make_cuda_backend and cuda_elementwise in a build without CUDA: a clear error.
#include "layers/cuda_elementwise.hpp"
#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/layers/dnn_backend.hpp"

namespace tessera {
std::unique_ptr<DnnBackend> make_cuda_backend(const CudaBackendOptions&) {
  fail("the CUDA backend: {}. Rebuild with -DTESSERA_ENABLE_CUDA=ON.", cuda::unavailable_reason());
}
ElementwiseKernels& cuda_elementwise(int device) {
  fail("CUDA kernels for GPU {}: {}. Rebuild with -DTESSERA_ENABLE_CUDA=ON.", device, cuda::unavailable_reason());
}
}  // namespace tessera
