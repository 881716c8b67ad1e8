#pragma once
// Precision::BF16 (tessera/core/precision.hpp) on any backend's kernels: the operands are
// rounded to bf16 into scratch buffers and the wrapped kernels run on them, their results left
// fp32. The wrapped kernels see the BF16 geometry with operands that are already bf16 values; they
// may use any arithmetic that multiplies bf16 values exactly and sums in fp32 (the host's fp32
// kernels; cuDNN and cuBLAS on TF32 tensor cores). Precision::F32 calls pass straight through.
#include <cstdint>
#include <memory>

#include "tessera/core/device.hpp"
#include "tessera/layers/dnn_backend.hpp"

namespace tessera {

/// `kernels` round on `device`, where the scratch buffers live.
std::unique_ptr<ConvolutionKernels> with_bf16_operands(std::unique_ptr<ConvolutionKernels> convolution,
                                                       ElementwiseKernels& kernels, Device device);
std::unique_ptr<LinearKernels> with_bf16_operands(std::unique_ptr<LinearKernels> linear, ElementwiseKernels& kernels,
                                                  Device device);

}  // namespace tessera
