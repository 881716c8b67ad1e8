#pragma once
// Tessera's own CUDA kernels (layers/cuda_kernels.cu), declared without CUDA types so that
// host-compiled code can call them. Every launch goes to cuda::stream() of the current device;
// pointers are device memory. Built only with TESSERA_ENABLE_CUDA=ON.
#include <cstdint>

#include "layers/pool_box.hpp"
#include "tessera/layers/dropout_mask.hpp"
#include "tessera/layers/update_steps.hpp"

namespace tessera::cuda_kernels {

using tessera::AdamStep;
using tessera::DropoutMask;
using tessera::PoolBox;
using tessera::SgdStep;

/// Max pooling; `argmax` gets each maximum's position within its input plane.
void max_pool_forward(const PoolBox& box, const float* input, float* output, std::int32_t* argmax);
/// Overwrites grad_input.
void max_pool_backward(const PoolBox& box, const float* grad_output, const std::int32_t* argmax, float* grad_input);
/// max_pool_backward times the leaky ReLU's factor at each maximum (1 where its `output` > 0, else
/// `slope`): windows that do not overlap (PoolingKernels::max_backward_through_leaky_relu).
void max_pool_backward_leaky_relu(const PoolBox& box, const float* grad_output, const std::int32_t* argmax,
                                  const float* output, float slope, float* grad_input);
/// Average pooling over the part of each window inside the global input.
void average_pool_forward(const PoolBox& box, const float* input, float* output);
void average_pool_backward(const PoolBox& box, const float* grad_output, float* grad_input);

/// values (rows x features) += bias (features) on every row.
void add_row_bias(float* values, const float* bias, std::int64_t rows, std::int64_t features);
/// bias_grad (features) = the sum over rows of grad (rows x features).
void row_bias_gradient(const float* grad, float* bias_grad, std::int64_t rows, std::int64_t features);

/// y = max(x, 0) + slope * min(x, 0); dx = dy * (x > 0 ? 1 : slope).
void leaky_relu_forward(const float* x, float* y, std::int64_t count, float slope);
void leaky_relu_backward(const float* x, const float* dy, float* dx, std::int64_t count, float slope);

/// Writes the sum over i of weight * (prediction_i - target_i)^2 to *loss (one device double;
/// one block, so the order of the sum is fixed) and, when `grad` is not null,
/// grad_i = 2 * weight * scale * (prediction_i - target_i).
void squared_error(const float* prediction, const float* target, std::int64_t count, double weight, double scale,
                   double* loss, float* grad);

/// Softmax cross-entropy, one thread per row: row_loss[n] = log-sum-exp(row) - row[label] (in
/// double) and, when `grad` is not null, grad = (softmax(row) - one_hot(label)) * scale.
void softmax_cross_entropy(const float* scores, const float* labels, std::int64_t rows, std::int64_t classes,
                           double scale, double* row_loss, float* grad);
/// row_correct[n] = 1 when row n's largest score (the first of equal ones) is at its label, else 0.
void count_correct(const float* scores, const float* labels, std::int64_t rows, std::int64_t classes,
                   double* row_correct);

/// y = x rounded to bf16 (bf16_round_bits: the host's rounding, bit for bit), as fp32; y may be x.
void round_to_bf16(const float* x, float* y, std::int64_t count);
/// y = x rounded to bf16 as round_to_bf16 does, stored as bf16 (the upper 16 bits of its fp32
/// value): cuDNN's CUDNN_DATA_BFLOAT16.
void to_bf16(const float* x, std::uint16_t* y, std::int64_t count);
/// y = the fp32 value of bf16 x (exact).
void from_bf16(const std::uint16_t* x, float* y, std::int64_t count);
/// y = the fp32 value of bf16 x plus the bias of its channel (x, y: batch x channels x inner;
/// bias null: none), then, when `leaky`, the leaky ReLU of that slope (as leaky_relu_forward), in
/// one pass: a convolution's output widened with its bias and fused activation.
void from_bf16_finish(const std::uint16_t* x, const float* bias, float* y, std::int64_t batch, std::int64_t channels,
                      std::int64_t inner, bool leaky, float slope);
/// y (fp32, batch x channels x inner) += the bias of its channel (null: none), then, when
/// `leaky`, the leaky ReLU of that slope, in place in one pass (a convolution's fused activation).
void finish_output(float* y, const float* bias, std::int64_t batch, std::int64_t channels, std::int64_t inner,
                   bool leaky, float slope);
/// sums[c] = the sum over batch and inner of bf16 `values` (batch x channels x inner), summed in
/// double and rounded to fp32 once: a convolution's bias gradient from its rounded output gradient.
void bf16_channel_sums(const std::uint16_t* values, std::int64_t batch, std::int64_t channels, std::int64_t inner,
                       float* sums);

/// scales[i] = dropout_scale(mask, i) (tessera/layers/dropout_mask.hpp: the host's draws).
void dropout_scales(const DropoutMask& mask, float* scales, std::int64_t count);

/// y += x.
void accumulate(const float* x, float* y, std::int64_t count);
/// y = a * b (y may be a or b).
void multiply(const float* a, const float* b, float* y, std::int64_t count);

/// The optimizers' updates (ElementwiseKernels::sgd_update, adam_update): the same fp32
/// operations in the same order as the host's, each rounded on its own (no fused multiply-add),
/// so the results equal the host's bit for bit.
void sgd_update(float* p, const float* g, float* momentum_buffer, std::int64_t count, const SgdStep& step);
void adam_update(float* p, const float* g, float* m, float* v, std::int64_t count, const AdamStep& step);

/// Batch norm (x: batch x channels x inner; every pointer device memory). Per channel c, in
/// double: with `dy` null sums[c] = the sum of x, sums[channels + c] = the sum of x^2; else the
/// sums of dy and of dy * (x - mean[c]) * inverse_std[c]. Chunks of each (sample, channel) plane
/// summed across the GPU, then each channel's chunk sums: an order fixed by the shape.
void channel_sums(const float* x, const float* dy, const double* mean, const double* inverse_std, std::int64_t batch,
                  std::int64_t channels, std::int64_t inner, double* sums);
/// y = scale[c] * x + shift[c] over `count` = batch x channels x inner elements.
void batch_norm_normalize(const float* x, float* y, std::int64_t count, std::int64_t channels, std::int64_t inner,
                          const float* scale, const float* shift);
/// dx = scale[c] * (dy - mean_dy[c] - xhat * mean_dy_xhat[c]), or scale[c] * dy with mean_dy null.
void batch_norm_backward(const float* x, const float* dy, float* dx, std::int64_t count, std::int64_t channels,
                         std::int64_t inner, const double* scale, const double* mean, const double* inverse_std,
                         const double* mean_dy, const double* mean_dy_xhat);

}  // namespace tessera::cuda_kernels
