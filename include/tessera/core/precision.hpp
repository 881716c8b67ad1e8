#pragma once
// The arithmetic precision of the layers that compute (convolution, linear): what the model
// file's `precision` selects, the backends compute and the planner prices.
#include <string>
#include <string_view>

namespace tessera {

/// The arithmetic of a convolution or linear kernel (a model option, `precision: bf16`).
///   F32:  fp32 operands, fp32 products and sums.
///   BF16: bf16 operands with fp32 sums: the operands (input, weights, output gradient) are
///         rounded to bf16 (to nearest, ties to even), each product of two bf16 values is exact,
///         the products are summed in fp32, and the results (outputs, input and weight gradients)
///         are fp32, not rounded. A bias is added in fp32; its gradient is the fp32 sum of the
///         rounded output gradient. So the operands carry bf16's 8-bit precision, as in PyTorch's
///         autocast, but no partial result is rounded to bf16: a plan that sums partial results
///         on several ranks (spatial tiles' weight gradients, channel-split outputs, sample-split
///         gradient reductions) sums the same fp32 values as one rank, and every plan agrees with
///         the 1-rank run as closely as in fp32 apart from the rare operand whose fp32 value lands
///         on the other side of a bf16 rounding boundary. Tensors, master weights, optimizer state
///         and reductions stay fp32; the rounded operands take scratch buffers the size of the
///         largest input, output and weights of a layer. The host computes it with its fp32
///         kernels on rounded operands; CUDA on tensor cores: cuBLAS converts the (exact bf16)
///         operands to bf16, cuDNN runs its GEMM-type algorithms in TF32 (every bf16 value is a
///         TF32 value, so the products stay exact; Winograd and FFT, which transform the operands
///         first, are not used for bf16).
enum class Precision { F32, BF16 };

std::string_view precision_name(Precision precision);
/// "fp32" or "bf16"; anything else is an InputError that names `context`.
Precision parse_precision(std::string_view text, const std::string& context);

}  // namespace tessera
