#pragma once
// The CUDA element-wise kernels as an ElementwiseKernels (what elementwise_kernels() returns for
// a GPU): layers/cuda_backend.cpp; a build without CUDA throws an Error that says so.
#include "tessera/layers/dnn_backend.hpp"

namespace tessera {

/// The CUDA element-wise kernels on GPU `device` (made current; its stream).
ElementwiseKernels& cuda_elementwise(int device);

}  // namespace tessera
