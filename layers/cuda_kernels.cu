// Tessera's CUDA kernels: pooling (the host kernels' exact semantics, tiles included), bias of
// linear layers, and the element-wise work of the layers, losses and optimizer.
#include <cuda_runtime.h>

#include <math_constants.h>

#include "layers/bf16_bits.hpp"
#include "layers/cuda_kernels.hpp"
#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"

namespace tessera::cuda_kernels {
namespace {

cudaStream_t current_stream() { return static_cast<cudaStream_t>(cuda::stream()); }

/// Launch errors become Tessera errors (with the rank).
void check_launch(const char* kernel) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) fail("CUDA: launch of {} failed: {}", kernel, cudaGetErrorString(status));
}

constexpr int kThreads = 256;
/// Elements of one (sample, channel) plane a block of the per-plane kernels takes: 16 per thread.
constexpr std::int64_t kPlaneChunk = kThreads * 16;

/// Blocks of the per-plane kernels: one per chunk of each of `planes` planes of `inner` elements
/// (at least one per plane); `chunks` is set to the chunks per plane.
unsigned plane_blocks(std::int64_t planes, std::int64_t inner, std::int64_t& chunks) {
  chunks = inner > 0 ? (inner + kPlaneChunk - 1) / kPlaneChunk : 1;
  const std::int64_t blocks = planes * chunks;
  if (blocks > 0x7fffffff) fail("CUDA: {} planes of {} elements need more blocks than one launch has", planes, inner);
  return static_cast<unsigned>(blocks);
}

unsigned blocks_for(std::int64_t count) {
  const std::int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 * 16 ? (blocks > 0 ? blocks : 1) : 65535 * 16);
}

#define TESSERA_GRID_LOOP(i, count)                                                                     \
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < (count); \
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)

struct Span {
  std::int64_t begin, end;
};

/// The local input range of output `index` in dimension `dim` (as the host kernels compute it).
__device__ inline Span window(const PoolBox& b, int dim, std::int64_t index) {
  const std::int64_t start = (b.out_origin[dim] + index) * b.stride[dim] - b.padding[dim];
  const std::int64_t begin = start > 0 ? start : 0;
  const std::int64_t end = start + b.kernel[dim] < b.limit[dim] ? start + b.kernel[dim] : b.limit[dim];
  return {begin - b.in_origin[dim], end - b.in_origin[dim]};
}

struct Window {
  std::int64_t plane, o;
  Span d, h, w;
};

__device__ inline Window window_of(const PoolBox& b, std::int64_t i) {
  const std::int64_t out_plane = b.out[0] * b.out[1] * b.out[2];
  const std::int64_t plane = i / out_plane, o = i % out_plane;
  const std::int64_t ow = o % b.out[2], oh = o / b.out[2] % b.out[1], od = o / (b.out[1] * b.out[2]);
  return {plane, o, window(b, 0, od), window(b, 1, oh), window(b, 2, ow)};
}

__global__ void max_pool_forward_kernel(PoolBox b, const float* input, float* output, std::int32_t* argmax) {
  const std::int64_t total = b.planes * b.out[0] * b.out[1] * b.out[2];
  const std::int64_t rows = b.in[1] * b.in[2], row = b.in[2], in_plane = b.in[0] * rows;
  TESSERA_GRID_LOOP(i, total) {
    const Window win = window_of(b, i);
    const float* x = input + win.plane * in_plane;
    float best = -CUDART_INF_F;  // as the host kernels start
    std::int64_t best_at = win.d.begin * rows + win.h.begin * row + win.w.begin;
    for (std::int64_t d = win.d.begin; d < win.d.end; ++d)
      for (std::int64_t h = win.h.begin; h < win.h.end; ++h)
        for (std::int64_t w = win.w.begin; w < win.w.end; ++w) {
          const std::int64_t at = d * rows + h * row + w;
          if (x[at] > best) {
            best = x[at];
            best_at = at;
          }
        }
    output[i] = best;
    argmax[i] = static_cast<std::int32_t>(best_at);
  }
}

__global__ void max_pool_backward_kernel(PoolBox b, const float* grad_output, const std::int32_t* argmax,
                                         float* grad_input) {
  const std::int64_t out_plane = b.out[0] * b.out[1] * b.out[2];
  const std::int64_t in_plane = b.in[0] * b.in[1] * b.in[2];
  TESSERA_GRID_LOOP(i, b.planes * out_plane) {
    atomicAdd(grad_input + (i / out_plane) * in_plane + argmax[i], grad_output[i]);
  }
}

/// As above, each gradient times the leaky ReLU's factor at its maximum, the output (1 where > 0,
/// else slope).
__global__ void max_pool_backward_leaky_kernel(PoolBox b, const float* grad_output, const std::int32_t* argmax,
                                               const float* output, float slope, float* grad_input) {
  const std::int64_t out_plane = b.out[0] * b.out[1] * b.out[2];
  const std::int64_t in_plane = b.in[0] * b.in[1] * b.in[2];
  TESSERA_GRID_LOOP(i, b.planes * out_plane) {
    const std::int64_t at = (i / out_plane) * in_plane + argmax[i];
    atomicAdd(grad_input + at, grad_output[i] * (output[i] > 0.0f ? 1.0f : slope));
  }
}

__global__ void average_pool_forward_kernel(PoolBox b, const float* input, float* output) {
  const std::int64_t total = b.planes * b.out[0] * b.out[1] * b.out[2];
  const std::int64_t rows = b.in[1] * b.in[2], row = b.in[2], in_plane = b.in[0] * rows;
  TESSERA_GRID_LOOP(i, total) {
    const Window win = window_of(b, i);
    const float* x = input + win.plane * in_plane;
    float sum = 0.0f;
    for (std::int64_t d = win.d.begin; d < win.d.end; ++d)
      for (std::int64_t h = win.h.begin; h < win.h.end; ++h)
        for (std::int64_t w = win.w.begin; w < win.w.end; ++w) sum += x[d * rows + h * row + w];
    output[i] = sum / static_cast<float>((win.d.end - win.d.begin) * (win.h.end - win.h.begin) *
                                         (win.w.end - win.w.begin));
  }
}

__global__ void average_pool_backward_kernel(PoolBox b, const float* grad_output, float* grad_input) {
  const std::int64_t total = b.planes * b.out[0] * b.out[1] * b.out[2];
  const std::int64_t rows = b.in[1] * b.in[2], row = b.in[2], in_plane = b.in[0] * rows;
  TESSERA_GRID_LOOP(i, total) {
    const Window win = window_of(b, i);
    float* dx = grad_input + win.plane * in_plane;
    const float share = grad_output[i] / static_cast<float>((win.d.end - win.d.begin) * (win.h.end - win.h.begin) *
                                                            (win.w.end - win.w.begin));
    for (std::int64_t d = win.d.begin; d < win.d.end; ++d)
      for (std::int64_t h = win.h.begin; h < win.h.end; ++h)
        for (std::int64_t w = win.w.begin; w < win.w.end; ++w) atomicAdd(dx + d * rows + h * row + w, share);
  }
}

__global__ void add_row_bias_kernel(float* values, const float* bias, std::int64_t rows, std::int64_t features) {
  TESSERA_GRID_LOOP(i, rows * features) { values[i] += bias[i % features]; }
}

/// One thread per feature, summing its column in row order (deterministic).
__global__ void row_bias_gradient_kernel(const float* grad, float* bias_grad, std::int64_t rows,
                                         std::int64_t features) {
  TESSERA_GRID_LOOP(f, features) {
    float sum = 0.0f;
    for (std::int64_t r = 0; r < rows; ++r) sum += grad[r * features + f];
    bias_grad[f] = sum;
  }
}

/// The leaky ReLU of one value: the host's value, NaNs kept (fmaxf/fminf would drop them); only a
/// zero's sign may differ (-0 for a negative input and slope 0; backward reads only x > 0).
__device__ float leaky_relu(float v, float slope) { return v > 0.0f ? v : slope * v; }

__global__ void leaky_relu_forward_kernel(const float* x, float* y, std::int64_t count, float slope) {
  TESSERA_GRID_LOOP(i, count) { y[i] = leaky_relu(x[i], slope); }
}

__global__ void leaky_relu_backward_kernel(const float* x, const float* dy, float* dx, std::int64_t count,
                                           float slope) {
  TESSERA_GRID_LOOP(i, count) { dx[i] = dy[i] * (x[i] > 0.0f ? 1.0f : slope); }
}

/// One block: the gradient element-wise, the loss as a block reduction in double (losses are small).
__global__ void squared_error_kernel(const float* prediction, const float* target, std::int64_t count, double weight,
                                     double scale, double* loss, float* grad) {
  __shared__ double partial[kThreads];
  double sum = 0.0;
  for (std::int64_t i = threadIdx.x; i < count; i += blockDim.x) {
    const double difference = static_cast<double>(prediction[i]) - target[i];
    sum += difference * difference * weight;
    if (grad) grad[i] = static_cast<float>(2.0 * difference * weight * scale);
  }
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (static_cast<int>(threadIdx.x) < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) *loss = partial[0];
}

__global__ void softmax_cross_entropy_kernel(const float* scores, const float* labels, std::int64_t rows,
                                             std::int64_t classes, double scale, double* row_loss, float* grad) {
  TESSERA_GRID_LOOP(n, rows) {
    const float* row = scores + n * classes;
    double largest = row[0];
    for (std::int64_t k = 1; k < classes; ++k) largest = fmax(largest, static_cast<double>(row[k]));
    double total = 0.0;
    for (std::int64_t k = 0; k < classes; ++k) total += exp(row[k] - largest);
    const auto label = static_cast<std::int64_t>(labels[n]);
    if (grad)
      for (std::int64_t k = 0; k < classes; ++k)
        grad[n * classes + k] = static_cast<float>((exp(row[k] - largest) / total - (k == label ? 1.0 : 0.0)) * scale);
    row_loss[n] = log(total) + largest - row[label];
  }
}

__global__ void count_correct_kernel(const float* scores, const float* labels, std::int64_t rows,
                                     std::int64_t classes, double* row_correct) {
  TESSERA_GRID_LOOP(n, rows) {
    const float* row = scores + n * classes;
    std::int64_t best = 0;
    for (std::int64_t k = 1; k < classes; ++k)
      if (row[k] > row[best]) best = k;
    row_correct[n] = best == static_cast<std::int64_t>(labels[n]) ? 1.0 : 0.0;
  }
}

__global__ void accumulate_kernel(const float* x, float* y, std::int64_t count) {
  TESSERA_GRID_LOOP(i, count) { y[i] += x[i]; }
}

__global__ void round_to_bf16_kernel(const float* x, float* y, std::int64_t count) {
  TESSERA_GRID_LOOP(i, count) { y[i] = __uint_as_float(bf16_round_bits(__float_as_uint(x[i]))); }
}

__global__ void to_bf16_kernel(const float* x, std::uint16_t* y, std::int64_t count) {
  TESSERA_GRID_LOOP(i, count) { y[i] = static_cast<std::uint16_t>(bf16_round_bits(__float_as_uint(x[i])) >> 16); }
}

__global__ void from_bf16_kernel(const std::uint16_t* x, float* y, std::int64_t count) {
  TESSERA_GRID_LOOP(i, count) { y[i] = __uint_as_float(static_cast<std::uint32_t>(x[i]) << 16); }
}

__global__ void dropout_scales_kernel(DropoutMask mask, float* scales, std::int64_t count) {
  TESSERA_GRID_LOOP(i, count) { scales[i] = dropout_scale(mask, i); }
}

__global__ void multiply_kernel(const float* a, const float* b, float* y, std::int64_t count) {
  TESSERA_GRID_LOOP(i, count) { y[i] = a[i] * b[i]; }
}

// The optimizer updates, operation by operation as the host's loops (layers/host_elementwise.cpp)
// with explicitly rounded fp32 intrinsics: nvcc would otherwise contract a * b + c into one fused
// multiply-add, which rounds once where the host rounds twice.
__global__ void sgd_update_kernel(float* p, const float* g, float* buf, std::int64_t count, SgdStep s) {
  TESSERA_GRID_LOOP(i, count) {
    const float d = __fadd_rn(g[i], __fmul_rn(s.weight_decay, p[i]));
    if (buf == nullptr) {
      // The host skips the decay term when it is 0; g + 0 * p is g for every finite p.
      p[i] = __fsub_rn(p[i], __fmul_rn(s.lr, s.weight_decay != 0.0f ? d : g[i]));
      continue;
    }
    const float b = __fadd_rn(__fmul_rn(s.momentum, buf[i]), d);
    buf[i] = b;
    p[i] = __fsub_rn(p[i], __fmul_rn(s.lr, s.nesterov ? __fadd_rn(d, __fmul_rn(s.momentum, b)) : b));
  }
}

__global__ void adam_update_kernel(float* p, const float* g, float* m, float* v, std::int64_t count, AdamStep s) {
  TESSERA_GRID_LOOP(i, count) {
    const float pi = __fmul_rn(p[i], s.decoupled_scale);
    const float gi = __fadd_rn(g[i], __fmul_rn(s.l2_decay, pi));
    const float mi = __fadd_rn(__fmul_rn(s.beta1, m[i]), __fmul_rn(s.one_minus_beta1, gi));
    const float vi = __fadd_rn(__fmul_rn(s.beta2, v[i]), __fmul_rn(__fmul_rn(s.one_minus_beta2, gi), gi));
    m[i] = mi;
    v[i] = vi;
    const float denominator = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), s.bias_correction2_sqrt), s.epsilon);
    p[i] = __fsub_rn(pi, __fmul_rn(s.step_size, __fdiv_rn(mi, denominator)));
  }
}

__device__ inline float widen_bf16(std::uint16_t bits) { return __uint_as_float(static_cast<std::uint32_t>(bits) << 16); }

/// The sum of `value` over the block's kThreads threads, in a fixed tree (every thread gets it).
/// Every thread of the block must call it; it may be called again (it waits for the readers of
/// the previous sum before writing).
__device__ double block_sum(double value) {
  static_assert((kThreads & (kThreads - 1)) == 0, "the tree below halves a power of two");
  __shared__ double partial[kThreads];
  __syncthreads();
  partial[threadIdx.x] = value;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  return partial[0];
}

/// A convolution's output value finished: plus the bias of its channel (when there is one), then
/// the fused leaky ReLU (when `leaky`), as leaky_relu_forward_kernel computes it.
__device__ float finish_output(float v, const float* bias, float b, bool leaky, float slope) {
  if (bias) v = __fadd_rn(v, b);
  return leaky ? leaky_relu(v, slope) : v;
}

/// A stored value as fp32: itself, or a bf16 value widened (exact).
__device__ float stored_value(float v) { return v; }
__device__ float stored_value(std::uint16_t v) { return widen_bf16(v); }

/// y = x (fp32, or bf16 widened; x may be y) finished (finish_output). One block per chunk of one
/// (sample, channel) plane: contiguous loads, the bias read once, no index division per element.
template <typename Stored>
__global__ void finish_kernel(const Stored* x, const float* bias, float* y, std::int64_t channels, std::int64_t inner,
                              std::int64_t chunks, bool leaky, float slope) {
  const std::int64_t plane = blockIdx.x / chunks;
  const std::int64_t begin = (blockIdx.x % chunks) * kPlaneChunk;
  const std::int64_t end = begin + kPlaneChunk < inner ? begin + kPlaneChunk : inner;
  const float b = bias ? bias[plane % channels] : 0.0f;
  const Stored* in = x + plane * inner;
  float* out = y + plane * inner;
  for (std::int64_t j = begin + threadIdx.x; j < end; j += blockDim.x)
    out[j] = finish_output(stored_value(in[j]), bias, b, leaky, slope);
}

/// First pass of the channel sums: block k of channel c (k = sample * chunks + chunk) sums one
/// chunk of the plane (sample, c) in double into partial[c * blocks per channel + k].
__global__ void bf16_chunk_sums_kernel(const std::uint16_t* values, std::int64_t channels, std::int64_t inner,
                                       std::int64_t chunks, std::int64_t per_channel, double* partial) {
  const std::int64_t c = blockIdx.x / per_channel, k = blockIdx.x % per_channel;
  const std::int64_t n = k / chunks;
  const std::int64_t begin = (k % chunks) * kPlaneChunk;
  const std::int64_t end = begin + kPlaneChunk < inner ? begin + kPlaneChunk : inner;
  const std::uint16_t* plane = values + (n * channels + c) * inner;
  double total = 0.0;
  for (std::int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) total += widen_bf16(plane[j]);
  total = block_sum(total);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

/// Second pass: row r of `partial` (count values) summed in a fixed order into sums[r].
template <typename Out>
__global__ void row_sums_kernel(const double* partial, std::int64_t count, Out* sums) {
  const double* row = partial + static_cast<std::int64_t>(blockIdx.x) * count;
  double total = 0.0;
  for (std::int64_t k = threadIdx.x; k < count; k += blockDim.x) total += row[k];
  total = block_sum(total);
  if (threadIdx.x == 0) sums[blockIdx.x] = static_cast<Out>(total);
}

/// Batch norm's sums, first pass (as bf16_chunk_sums_kernel): block k of channel c sums one chunk
/// of the plane (sample, c): x and x^2, or (dy given) dy and dy * (x - mean[c]) * inverse_std[c],
/// in double, into partial[blockIdx.x] and partial[gridDim.x + blockIdx.x].
__global__ void channel_chunk_sums_kernel(const float* x, const float* dy, const double* mean, const double* inverse_std,
                                          std::int64_t channels, std::int64_t inner, std::int64_t chunks,
                                          std::int64_t per_channel, double* partial) {
  const std::int64_t c = blockIdx.x / per_channel, k = blockIdx.x % per_channel;
  const std::int64_t n = k / chunks;
  const std::int64_t begin = (k % chunks) * kPlaneChunk;
  const std::int64_t end = begin + kPlaneChunk < inner ? begin + kPlaneChunk : inner;
  const std::int64_t base = (n * channels + c) * inner;
  const float* xs = x + base;
  double first = 0.0, second = 0.0;
  if (dy == nullptr) {
    for (std::int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
      const double v = xs[j];
      first += v;
      second += v * v;
    }
  } else {
    const float* gs = dy + base;
    const double m = mean[c], s = inverse_std[c];
    for (std::int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
      const double g = gs[j];
      first += g;
      second += g * ((xs[j] - m) * s);
    }
  }
  first = block_sum(first);
  second = block_sum(second);
  if (threadIdx.x == 0) {
    partial[blockIdx.x] = first;
    partial[gridDim.x + blockIdx.x] = second;
  }
}

/// y = scale[c] * x + shift[c], rounded as the host's float multiply and add (no fused multiply-add).
__global__ void batch_norm_normalize_kernel(const float* x, float* y, std::int64_t count, std::int64_t channels,
                                            std::int64_t inner, const float* scale, const float* shift) {
  TESSERA_GRID_LOOP(k, count) {
    const std::int64_t c = (k / inner) % channels;
    y[k] = __fadd_rn(__fmul_rn(scale[c], x[k]), shift[c]);
  }
}

__global__ void batch_norm_backward_kernel(const float* x, const float* dy, float* dx, std::int64_t count,
                                           std::int64_t channels, std::int64_t inner, const double* scale,
                                           const double* mean, const double* inverse_std, const double* mean_dy,
                                           const double* mean_dy_xhat) {
  TESSERA_GRID_LOOP(k, count) {
    const std::int64_t c = (k / inner) % channels;
    if (mean_dy == nullptr) {
      dx[k] = static_cast<float>(scale[c] * dy[k]);
      continue;
    }
    const double xhat = (x[k] - mean[c]) * inverse_std[c];
    dx[k] = static_cast<float>(scale[c] * (dy[k] - mean_dy[c] - xhat * mean_dy_xhat[c]));
  }
}

std::int64_t outputs(const PoolBox& b) { return b.planes * b.out[0] * b.out[1] * b.out[2]; }
std::int64_t inputs(const PoolBox& b) { return b.planes * b.in[0] * b.in[1] * b.in[2]; }


}  // namespace

void max_pool_forward(const PoolBox& box, const float* input, float* output, std::int32_t* argmax) {
  max_pool_forward_kernel<<<blocks_for(outputs(box)), kThreads, 0, current_stream()>>>(box, input, output, argmax);
  check_launch("max pool forward");
}

void max_pool_backward(const PoolBox& box, const float* grad_output, const std::int32_t* argmax, float* grad_input) {
  cuda::fill(grad_input, inputs(box), 0.0f);
  max_pool_backward_kernel<<<blocks_for(outputs(box)), kThreads, 0, current_stream()>>>(box, grad_output, argmax,
                                                                                       grad_input);
  check_launch("max pool backward");
}

void max_pool_backward_leaky_relu(const PoolBox& box, const float* grad_output, const std::int32_t* argmax,
                                  const float* output, float slope, float* grad_input) {
  cuda::fill(grad_input, inputs(box), 0.0f);
  max_pool_backward_leaky_kernel<<<blocks_for(outputs(box)), kThreads, 0, current_stream()>>>(
      box, grad_output, argmax, output, slope, grad_input);
  check_launch("max pool backward through leaky relu");
}

void average_pool_forward(const PoolBox& box, const float* input, float* output) {
  average_pool_forward_kernel<<<blocks_for(outputs(box)), kThreads, 0, current_stream()>>>(box, input, output);
  check_launch("average pool forward");
}

void average_pool_backward(const PoolBox& box, const float* grad_output, float* grad_input) {
  cuda::fill(grad_input, inputs(box), 0.0f);
  average_pool_backward_kernel<<<blocks_for(outputs(box)), kThreads, 0, current_stream()>>>(box, grad_output,
                                                                                           grad_input);
  check_launch("average pool backward");
}

void add_row_bias(float* values, const float* bias, std::int64_t rows, std::int64_t features) {
  add_row_bias_kernel<<<blocks_for(rows * features), kThreads, 0, current_stream()>>>(values, bias, rows, features);
  check_launch("bias");
}

void row_bias_gradient(const float* grad, float* bias_grad, std::int64_t rows, std::int64_t features) {
  row_bias_gradient_kernel<<<blocks_for(features), kThreads, 0, current_stream()>>>(grad, bias_grad, rows, features);
  check_launch("bias gradient");
}

void leaky_relu_forward(const float* x, float* y, std::int64_t count, float slope) {
  leaky_relu_forward_kernel<<<blocks_for(count), kThreads, 0, current_stream()>>>(x, y, count, slope);
  check_launch("leaky_relu forward");
}

void leaky_relu_backward(const float* x, const float* dy, float* dx, std::int64_t count, float slope) {
  leaky_relu_backward_kernel<<<blocks_for(count), kThreads, 0, current_stream()>>>(x, dy, dx, count, slope);
  check_launch("leaky_relu backward");
}

void squared_error(const float* prediction, const float* target, std::int64_t count, double weight, double scale,
                   double* loss, float* grad) {
  squared_error_kernel<<<1, kThreads, 0, current_stream()>>>(prediction, target, count, weight, scale, loss, grad);
  check_launch("squared error");
}

void softmax_cross_entropy(const float* scores, const float* labels, std::int64_t rows, std::int64_t classes,
                           double scale, double* row_loss, float* grad) {
  softmax_cross_entropy_kernel<<<blocks_for(rows), kThreads, 0, current_stream()>>>(scores, labels, rows, classes, scale,
                                                                                   row_loss, grad);
  check_launch("softmax cross-entropy");
}

void count_correct(const float* scores, const float* labels, std::int64_t rows, std::int64_t classes,
                   double* row_correct) {
  count_correct_kernel<<<blocks_for(rows), kThreads, 0, current_stream()>>>(scores, labels, rows, classes, row_correct);
  check_launch("count correct");
}

void accumulate(const float* x, float* y, std::int64_t count) {
  accumulate_kernel<<<blocks_for(count), kThreads, 0, current_stream()>>>(x, y, count);
  check_launch("accumulate");
}

void round_to_bf16(const float* x, float* y, std::int64_t count) {
  round_to_bf16_kernel<<<blocks_for(count), kThreads, 0, current_stream()>>>(x, y, count);
  check_launch("round to bf16");
}

void to_bf16(const float* x, std::uint16_t* y, std::int64_t count) {
  if (count <= 0) return;
  to_bf16_kernel<<<blocks_for(count), kThreads, 0, current_stream()>>>(x, y, count);
  check_launch("conversion to bf16");
}

void from_bf16(const std::uint16_t* x, float* y, std::int64_t count) {
  if (count <= 0) return;
  from_bf16_kernel<<<blocks_for(count), kThreads, 0, current_stream()>>>(x, y, count);
  check_launch("conversion from bf16");
}

void dropout_scales(const DropoutMask& mask, float* scales, std::int64_t count) {
  if (count <= 0) return;
  dropout_scales_kernel<<<blocks_for(count), kThreads, 0, current_stream()>>>(mask, scales, count);
  check_launch("dropout scales");
}

void multiply(const float* a, const float* b, float* y, std::int64_t count) {
  multiply_kernel<<<blocks_for(count), kThreads, 0, current_stream()>>>(a, b, y, count);
  check_launch("multiply");
}

void sgd_update(float* p, const float* g, float* momentum_buffer, std::int64_t count, const SgdStep& step) {
  sgd_update_kernel<<<blocks_for(count), kThreads, 0, current_stream()>>>(p, g, momentum_buffer, count, step);
  check_launch("sgd update");
}

void adam_update(float* p, const float* g, float* m, float* v, std::int64_t count, const AdamStep& step) {
  adam_update_kernel<<<blocks_for(count), kThreads, 0, current_stream()>>>(p, g, m, v, count, step);
  check_launch("adam update");
}

void from_bf16_finish(const std::uint16_t* x, const float* bias, float* y, std::int64_t batch, std::int64_t channels,
                      std::int64_t inner, bool leaky, float slope) {
  if (batch * channels * inner <= 0) return;
  std::int64_t chunks = 0;
  const unsigned blocks = plane_blocks(batch * channels, inner, chunks);
  finish_kernel<<<blocks, kThreads, 0, current_stream()>>>(x, bias, y, channels, inner, chunks, leaky, slope);
  check_launch("conversion from bf16 with the bias and activation");
}

void finish_output(float* y, const float* bias, std::int64_t batch, std::int64_t channels, std::int64_t inner,
                   bool leaky, float slope) {
  if (batch * channels * inner <= 0) return;
  std::int64_t chunks = 0;
  const unsigned blocks = plane_blocks(batch * channels, inner, chunks);
  finish_kernel<<<blocks, kThreads, 0, current_stream()>>>(static_cast<const float*>(y), bias, y, channels, inner, chunks,
                                                           leaky, slope);
  check_launch("bias and activation");
}

void bf16_channel_sums(const std::uint16_t* values, std::int64_t batch, std::int64_t channels, std::int64_t inner,
                       float* sums) {
  if (channels == 0) return;
  if (batch * inner == 0) {
    cuda::fill(sums, channels, 0.0f);
    return;
  }
  // Two passes in an order fixed by the shape (a run repeats itself exactly): chunk sums spread
  // over the whole GPU (one block per channel would leave it mostly idle on large planes), then
  // each channel's chunk sums.
  std::int64_t chunks = 0;
  const unsigned blocks = plane_blocks(channels * batch, inner, chunks);
  const std::int64_t per_channel = batch * chunks;
  auto* partial = static_cast<double*>(cuda::allocate(static_cast<std::size_t>(blocks) * sizeof(double)));
  bf16_chunk_sums_kernel<<<blocks, kThreads, 0, current_stream()>>>(values, channels, inner, chunks, per_channel,
                                                                    partial);
  check_launch("bf16 channel sums (chunks)");
  row_sums_kernel<float><<<static_cast<unsigned>(channels), kThreads, 0, current_stream()>>>(partial, per_channel, sums);
  check_launch("bf16 channel sums (rows)");
  cuda::release(partial);  // stream-ordered: later work on the stream runs after the kernels above
}

void channel_sums(const float* x, const float* dy, const double* mean, const double* inverse_std, std::int64_t batch,
                  std::int64_t channels, std::int64_t inner, double* sums) {
  if (channels == 0) return;
  if (batch * inner == 0) {
    const cudaError_t status =
        cudaMemsetAsync(sums, 0, static_cast<std::size_t>(2 * channels) * sizeof(double), current_stream());
    if (status != cudaSuccess) fail("CUDA: zeroing the batch norm sums failed: {}", cudaGetErrorString(status));
    return;
  }
  // Two passes in an order fixed by the shape, as bf16_channel_sums.
  std::int64_t chunks = 0;
  const unsigned blocks = plane_blocks(channels * batch, inner, chunks);
  const std::int64_t per_channel = batch * chunks;
  auto* partial = static_cast<double*>(cuda::allocate(2 * static_cast<std::size_t>(blocks) * sizeof(double)));
  channel_chunk_sums_kernel<<<blocks, kThreads, 0, current_stream()>>>(x, dy, mean, inverse_std, channels, inner, chunks,
                                                                       per_channel, partial);
  check_launch("batch norm sums (chunks)");
  for (int half = 0; half < 2; ++half)
    row_sums_kernel<double><<<static_cast<unsigned>(channels), kThreads, 0, current_stream()>>>(
        partial + half * static_cast<std::int64_t>(blocks), per_channel, sums + half * channels);
  check_launch("batch norm sums (rows)");
  cuda::release(partial);  // stream-ordered: later work on the stream runs after the kernels above
}

void batch_norm_normalize(const float* x, float* y, std::int64_t count, std::int64_t channels, std::int64_t inner,
                          const float* scale, const float* shift) {
  batch_norm_normalize_kernel<<<blocks_for(count), kThreads, 0, current_stream()>>>(x, y, count, channels, inner, scale,
                                                                                   shift);
  check_launch("batch norm normalize");
}

void batch_norm_backward(const float* x, const float* dy, float* dx, std::int64_t count, std::int64_t channels,
                         std::int64_t inner, const double* scale, const double* mean, const double* inverse_std,
                         const double* mean_dy, const double* mean_dy_xhat) {
  batch_norm_backward_kernel<<<blocks_for(count), kThreads, 0, current_stream()>>>(
      x, dy, dx, count, channels, inner, scale, mean, inverse_std, mean_dy, mean_dy_xhat);
  check_launch("batch norm backward");
}

}  // namespace tessera::cuda_kernels
