#pragma once
// The heavy kernels behind the layers: one small interface per kernel family (convolution,
// pooling, linear), implemented by oneDNN on the host and by cuDNN/cuBLAS (+ Tessera's own
// kernels) on CUDA.
// Layers describe a call by a geometry value; a backend builds whatever it needs for a geometry
// once (oneDNN primitives, cuDNN descriptors), caches it, and reuses it on every later call.
//
// Tensors cross this interface as raw pointers to plain, contiguous float32 buffers in
// N x C x (D) x H x W order (N x F for linear layers). No library types appear here.
// A backend object is not thread-safe: each executor owns its own.
#include <compare>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/device.hpp"
#include "tessera/core/precision.hpp"
#include "tessera/layers/dropout_mask.hpp"
#include "tessera/layers/update_steps.hpp"

namespace tessera {

/// One convolution call. Per-spatial-dimension vectors hold 2 (H, W) or 3 (D, H, W) entries.
struct ConvolutionGeometry {
  std::int64_t batch = 0;
  std::int64_t in_channels = 0;
  std::int64_t out_channels = 0;
  std::vector<std::int64_t> input_size;
  std::vector<std::int64_t> kernel;
  std::vector<std::int64_t> stride;
  std::vector<std::int64_t> padding;   ///< on both sides
  std::vector<std::int64_t> dilation;  ///< 1 = a dense kernel (PyTorch's convention)
  std::vector<std::int64_t> output_size;
  bool bias = true;
  Precision precision = Precision::F32;
  /// forward only: a leaky ReLU (relu: slope 0) applied to the output after the bias, in the same
  /// pass, where the kernels fuse that slope (ConvolutionKernels::fuses_leaky_relu); the executor
  /// fuses a relu/leaky_relu layer running in place over the output (LayerContext::
  /// leaky_relu_after); the result is what that layer computes.
  bool leaky_relu = false;
  float leaky_slope = 0;
  /// On a spatial tile, the part of the input window that holds input data, per spatial dimension
  /// (the rest holds the layer's padding as zeros); both empty: all of it. Outside it no caller
  /// reads the input gradient: backward-data may skip it (Tessera's Winograd kernels write zeros).
  std::vector<std::int64_t> data_begin, data_extent;

  auto operator<=>(const ConvolutionGeometry&) const = default;
  /// The same geometry without the fused activation (the convolution itself).
  ConvolutionGeometry without_activation() const {
    ConvolutionGeometry g = *this;
    g.leaky_relu = false;
    g.leaky_slope = 0;
    return g;
  }
  std::string to_string() const;
  std::int64_t input_elements() const;   ///< batch x in_channels x input_size
  std::int64_t output_elements() const;  ///< batch x out_channels x output_size
  std::int64_t weight_elements() const;  ///< out_channels x in_channels x kernel (no bias)
};

enum class PoolingMode { Max, AverageExcludePadding };

struct PoolingGeometry {
  PoolingMode mode = PoolingMode::Max;
  std::int64_t batch = 0;
  std::int64_t channels = 0;
  std::vector<std::int64_t> input_size;
  std::vector<std::int64_t> kernel;
  std::vector<std::int64_t> stride;
  std::vector<std::int64_t> padding;  ///< on both sides
  std::vector<std::int64_t> output_size;
  /// A spatial tile (all empty: whole samples): the global position of local input element 0,
  /// the global input extents (windows are clipped to them) and the global position of local
  /// output element 0. The local input must cover every window's part inside the global input.
  std::vector<std::int64_t> input_origin;
  std::vector<std::int64_t> global_input_size;
  std::vector<std::int64_t> output_origin;
  /// Where the output (and its gradient) lie (both empty: a dense tensor of output_size): in a
  /// tensor of the same samples and channels and these spatial extents, from this spatial offset
  /// (a reader's halo window that the pooling writes into; host kernels only).
  std::vector<std::int64_t> output_within;
  std::vector<std::int64_t> output_offset;

  auto operator<=>(const PoolingGeometry&) const = default;
  std::string to_string() const;
};

/// output (batch x out_features) = input (batch x in_features) * weights^T + bias, with the
/// weights stored out_features x in_features (PyTorch's layout).
struct LinearGeometry {
  std::int64_t batch = 0;
  std::int64_t in_features = 0;
  std::int64_t out_features = 0;
  bool bias = true;
  Precision precision = Precision::F32;

  auto operator<=>(const LinearGeometry&) const = default;
  std::string to_string() const;
};

/// A max pooling's backward as a convolution it reads can take it instead of the dense gradient of
/// its output (ConvolutionKernels::backward_weights_from_pooling): the pooling's geometry (of its
/// last forward), its output gradient and the positions of its maxima (its workspace), and with a
/// leaky ReLU between them (max_backward_through_leaky_relu) its output and the slope.
struct PooledGradient {
  const PoolingGeometry* geometry = nullptr;
  const float* grad_output = nullptr;
  const void* workspace = nullptr;
  const float* output = nullptr;  ///< null: no leaky ReLU between them
  float slope = 0.0f;
};

/// Where a convolution's forward writes the max pooling of its output (the convolution's output
/// itself not kept): the pooling's geometry, its output (or its reader's window, as the geometry
/// says) and the places of its maxima (the pooling's workspace).
struct PooledOutput {
  const PoolingGeometry* geometry = nullptr;
  float* output = nullptr;
  std::int32_t* argmax = nullptr;
};

class ConvolutionKernels {
 public:
  virtual ~ConvolutionKernels() = default;
  /// `bias` is ignored when the geometry has none.
  virtual void forward(const ConvolutionGeometry& geometry, const float* input, const float* weights,
                       const float* bias, float* output) = 0;
  virtual void backward_data(const ConvolutionGeometry& geometry, const float* grad_output,
                             const float* weights, float* grad_input) = 0;
  /// Overwrites grad_weights (and grad_bias when the geometry has a bias).
  virtual void backward_weights(const ConvolutionGeometry& geometry, const float* input,
                                const float* grad_output, float* grad_weights, float* grad_bias) = 0;
  /// Both backward passes (grad_input may be null: not needed). Backends that convert
  /// grad_output to another layout override this to convert it once for both.
  virtual void backward(const ConvolutionGeometry& geometry, const float* input, const float* grad_output,
                        const float* weights, float* grad_input, float* grad_weights, float* grad_bias) {
    if (grad_input) backward_data(geometry, grad_output, weights, grad_input);
    backward_weights(geometry, input, grad_output, grad_weights, grad_bias);
  }
  /// Whether backward_weights_from_pooling computes this convolution's weight gradients from what
  /// a max pooling of this `pooling` reads of its output (default: none does).
  virtual bool reads_pooled_gradient(const ConvolutionGeometry& geometry, const PoolingGeometry& pooling) {
    (void)geometry;
    (void)pooling;
    return false;
  }
  /// backward_weights with the output gradient that max pooling's backward would write (through
  /// the leaky ReLU, if any) made from `pooled` as it is needed: the same values, without a pass
  /// that writes the convolution's whole output gradient (where reads_pooled_gradient).
  virtual void backward_weights_from_pooling(const ConvolutionGeometry& geometry, const float* input,
                                             const PooledGradient& pooled, float* grad_weights, float* grad_bias);
  /// forward followed by max pooling's forward of `pooled.geometry` (where reads_pooled_gradient
  /// says so for it): the pooling's output and maxima, the convolution's output not kept.
  virtual void forward_pooled(const ConvolutionGeometry& geometry, const float* input, const float* weights,
                              const float* bias, const PooledOutput& pooled);
  /// Bytes of buffers the kernels keep between calls on the tensors' device (bf16's rounded
  /// operands, see bf16_operands.hpp); 0 for kernels that keep none.
  virtual std::int64_t scratch_bytes() const { return 0; }
  /// Frees those buffers (the next call makes them again, as large as it needs).
  virtual void release_scratch() {}
  /// Whether forward applies a leaky ReLU of this slope (ConvolutionGeometry::leaky_relu) exactly
  /// as leaky_relu_forward does, NaNs included: every backend fuses slopes > 0, and says whether
  /// it fuses 0 (StepOptions::fuses_zero_slope).
  virtual bool fuses_leaky_relu(float slope) const = 0;
};

class PoolingKernels {
 public:
  virtual ~PoolingKernels() = default;
  /// Bytes of the opaque workspace that forward fills and backward reads (the positions of the
  /// maxima for max pooling; 0 for average pooling).
  virtual std::size_t workspace_bytes(const PoolingGeometry& geometry) = 0;
  virtual void forward(const PoolingGeometry& geometry, const float* input, float* output,
                       void* workspace) = 0;
  virtual void backward(const PoolingGeometry& geometry, const float* grad_output,
                        const void* workspace, float* grad_input) = 0;
  /// Max pooling's backward through the leaky ReLU (this slope) that made its input: what
  /// backward writes, times 1 where the input at the maximum > 0 and the slope elsewhere (the
  /// leaky ReLU's backward in the same pass). That input is the maximum itself, this pooling's
  /// `output` (a window of NaNs or -inf yields -inf at a NaN or -inf: the slope either way), so
  /// the input need not outlive forward. The executor asks it for windows that do not overlap
  /// only: each input then gets one output's gradient at most, and the product is the two
  /// passes' to the bit.
  virtual void max_backward_through_leaky_relu(const PoolingGeometry& geometry, const float* grad_output,
                                               const void* workspace, const float* output, float slope,
                                               float* grad_input) = 0;
};

class LinearKernels {
 public:
  virtual ~LinearKernels() = default;
  virtual void forward(const LinearGeometry& geometry, const float* input, const float* weights,
                       const float* bias, float* output) = 0;
  virtual void backward_data(const LinearGeometry& geometry, const float* grad_output,
                             const float* weights, float* grad_input) = 0;
  /// Overwrites grad_weights (and grad_bias when the geometry has a bias).
  virtual void backward_weights(const LinearGeometry& geometry, const float* input,
                                const float* grad_output, float* grad_weights, float* grad_bias) = 0;
  /// As ConvolutionKernels::scratch_bytes and release_scratch.
  virtual std::int64_t scratch_bytes() const { return 0; }
  virtual void release_scratch() {}
};

/// The element-wise work of the layers, losses and optimizers, on the backend's device (host
/// loops, or Tessera's CUDA kernels). Layers call these instead of looping themselves, so that
/// the same layer code runs on either device. Every operation is a fixed sequence of fp32
/// operations per element, so the host and CUDA results agree to the last bit where no sum is
/// involved (the optimizer updates).
class ElementwiseKernels {
 public:
  virtual ~ElementwiseKernels() = default;
  /// y = max(x, 0) + slope * min(x, 0).
  virtual void leaky_relu_forward(const float* x, float* y, std::int64_t count, float slope) = 0;
  /// dx = dy * (x > 0 ? 1 : slope).
  virtual void leaky_relu_backward(const float* x, const float* dy, float* dx, std::int64_t count, float slope) = 0;
  /// Returns the sum over i of weight * (prediction_i - target_i)^2 (accumulated in double) and,
  /// when `grad` is not null, writes grad_i = 2 * weight * scale * (prediction_i - target_i).
  virtual double squared_error(const float* prediction, const float* target, std::int64_t count, double weight,
                               double scale, float* grad) = 0;
  /// Softmax cross-entropy of `rows` score rows of `classes` against class indices stored as
  /// floats (already checked to be valid): returns the sum of the rows' losses (log-sum-exp in
  /// double, summed in row order) and, when `grad` is not null, writes
  /// grad = (softmax(row) - one_hot(label)) * scale.
  virtual double softmax_cross_entropy(const float* scores, const float* labels, std::int64_t rows,
                                       std::int64_t classes, double scale, float* grad) = 0;
  /// Rows whose largest score (the first of equal ones) is at their label.
  virtual std::int64_t count_correct(const float* scores, const float* labels, std::int64_t rows,
                                     std::int64_t classes) = 0;
  /// y += x.
  virtual void accumulate(const float* x, float* y, std::int64_t count) = 0;
  /// y = x rounded to the nearest bf16 value (ties to even; infinities and NaNs stay what they
  /// are), as fp32; y may be x. The same bits on every device.
  virtual void round_to_bf16(const float* x, float* y, std::int64_t count) = 0;
  /// y = x rounded as round_to_bf16 rounds it, stored as bf16 (the upper 16 bits of the rounded
  /// fp32 value): the executor's bf16 copies of the activations that backward reads.
  virtual void to_bf16(const float* x, std::uint16_t* y, std::int64_t count) = 0;
  /// y = the fp32 value of bf16 x (exact).
  virtual void from_bf16(const std::uint16_t* x, float* y, std::int64_t count) = 0;
  /// scales[i] = dropout_scale(mask, i) for the `count` elements of the local tensor.
  virtual void dropout_scales(const DropoutMask& mask, float* scales, std::int64_t count) = 0;
  /// y = a * b, element by element (y may be a or b).
  virtual void multiply(const float* a, const float* b, float* y, std::int64_t count) = 0;
  /// `rows` rows of `length` floats from `source` (rows `source_stride` apart) to `destination`
  /// (rows `destination_stride` apart); the two do not overlap.
  virtual void copy_rows(const float* source, std::int64_t source_stride, float* destination,
                         std::int64_t destination_stride, std::int64_t rows, std::int64_t length) = 0;
  /// One SGD step over `count` parameters `p` with gradients `g`; `momentum_buffer` is null
  /// without momentum.
  virtual void sgd_update(float* p, const float* g, float* momentum_buffer, std::int64_t count,
                          const SgdStep& step) = 0;
  /// One Adam step over `count` parameters with first and second moments `m`, `v`.
  virtual void adam_update(float* p, const float* g, float* m, float* v, std::int64_t count, const AdamStep& step) = 0;

  // Batch norm over x of batch x channels x inner (row-major). Per-channel arrays (`sums`, `scale`,
  // `shift`, `mean`, ...) are host memory of `channels` entries (`sums`: 2 x channels); the
  // tensors are on the kernels' device. Sums are accumulated in double.
  /// sums[c] = the sum of x over channel c, sums[channels + c] = the sum of x^2.
  virtual void batch_norm_statistics(const float* x, std::int64_t batch, std::int64_t channels, std::int64_t inner,
                                     double* sums) = 0;
  /// y = scale[c] * x + shift[c].
  virtual void batch_norm_normalize(const float* x, float* y, std::int64_t batch, std::int64_t channels,
                                    std::int64_t inner, const float* scale, const float* shift) = 0;
  /// sums[c] = the sum of dy over channel c, sums[channels + c] = the sum of dy * xhat with
  /// xhat = (x - mean[c]) * inverse_std[c].
  virtual void batch_norm_backward_sums(const float* x, const float* dy, std::int64_t batch, std::int64_t channels,
                                        std::int64_t inner, const double* mean, const double* inverse_std,
                                        double* sums) = 0;
  /// dx = scale[c] * (dy - mean_dy[c] - xhat * mean_dy_xhat[c]) (in double, xhat as above); with
  /// `mean_dy` null (statistics that were constants) dx = scale[c] * dy.
  virtual void batch_norm_backward(const float* x, const float* dy, float* dx, std::int64_t batch,
                                   std::int64_t channels, std::int64_t inner, const double* scale, const double* mean,
                                   const double* inverse_std, const double* mean_dy, const double* mean_dy_xhat) = 0;
};

/// The host's element-wise kernels (what the host backend's elementwise() returns).
ElementwiseKernels& host_elementwise();
/// The element-wise kernels for tensors on `device`: the host's, or the CUDA kernels (on the
/// stream of that GPU, which they make current). A GPU in a build without CUDA is an Error.
ElementwiseKernels& elementwise_kernels(const Device& device);

class DnnBackend {
 public:
  virtual ~DnnBackend() = default;
  virtual std::string name() const = 0;
  virtual ConvolutionKernels& convolution() = 0;
  virtual PoolingKernels& pooling() = 0;
  virtual LinearKernels& linear() = 0;
  virtual ElementwiseKernels& elementwise() = 0;
  /// One line per kernel built so far: what it computes and which implementation the library
  /// chose for it (for diagnostics and for tests that reject slow reference kernels).
  virtual std::vector<std::string> implementations() const = 0;
  /// How convolutions with bf16 operands have run so far: "exact" (fp32 results; the host, and
  /// Bf16Convolutions::Exact), "native" (bf16 tensors and results), or "native, N exact" when N
  /// (shape, direction) pairs had no cuDNN algorithm on bf16 tensors and ran exact.
  virtual std::string bf16_convolutions() const { return "exact"; }
};

/// How the host backend lays tensors out inside a convolution.
enum class HostConvolutionLayout {
  /// Blocked where it measured faster: when the input has 8 or more channels, and for 3-D
  /// kernels of 27 or more taps (3 x 3 x 3 and up). A 2-D convolution with fewer channels (a
  /// network's first layer) converts its large output to and from the blocked layout for more
  /// than the blocked kernels save; a 3 x 3 x 3 one reads 27 inputs per output and channel, and
  /// the plain layout's im2col gemm for it measured ~1.4x slower than the direct blocked kernel
  /// with its conversion (CosmoFlow's conv1, one input channel: 28 -> 19 ms per step at 64^3 and
  /// batch 2, 136 -> 94 ms at 128^3 and batch 1). Backward-weights stays plain below 8 channels
  /// even then (decomposed into 2-D problems): oneDNN's blocked 3-D kernel measured 3x slower
  /// there (one input channel on a tile; 2-7 channels not measured separately). One input
  /// channel at stride and dilation 1 with kernel width 3 (a network's first layer) runs
  /// forward and backward-weights on Tessera's direct kernels instead, in the plain layout. On
  /// CPUs with AVX-512, 3 x 3 x 3 convolutions at stride 1 with 8 or more channels in and out run
  /// forward and backward-data on Tessera's Winograd kernels (plain layout) where a call has 128 or
  /// more 2 x 2 x 2 output tiles: 1.2-2x faster than oneDNN's direct blocked kernels on
  /// CosmoFlow's layers (docs/benchmarks.md); rounding within ~3e-7 of the largest output.
  /// Their backward-weights from 1 024 tiles per thread. TESSERA_WINOGRAD=0 turns them off.
  Automatic,
  /// The library picks blocked layouts; cached reorders convert at the call boundary.
  Blocked,
  /// Plain N x C x (D) x H x W everywhere; no reorders.
  Plain,
};

struct HostBackendOptions {
  HostConvolutionLayout convolution_layout = HostConvolutionLayout::Automatic;
};

/// The oneDNN backend (threads: see set_backend_threads in runtime.hpp).
std::unique_ptr<DnnBackend> make_host_backend(const HostBackendOptions& options = {});

/// How the CUDA backend runs convolutions with bf16 operands (Precision::BF16).
enum class Bf16Convolutions {
  /// cuDNN's bf16 configuration: bf16 tensors, fp32 sums, bf16 tensor cores (twice TF32's rate).
  /// cuDNN writes bf16 results, so outputs, input gradients and weight gradients are the host's
  /// fp32 results rounded to bf16 (as PyTorch's autocast keeps them; one bf16 step apart where
  /// the two fp32 sums straddle a rounding boundary). GEMM-type algorithms only; a deterministic
  /// one unless the fastest is more than 10 % faster (then a run does not repeat itself exactly;
  /// implementations() says which ran). The bias is added in fp32, and its gradient is the sum of the rounded output
  /// gradient, as on the host. A direction cuDNN cannot run in bf16 (and GPUs before compute
  /// capability 8.0) runs as Exact, said in implementations().
  Native,
  /// The host's results: cuDNN's GEMM-type algorithms on TF32 tensor cores over the operands
  /// rounded to bf16 (exact products, fp32 sums and results), at TF32's rate.
  Exact,
};

/// "native" or "exact"; an InputError otherwise.
Bf16Convolutions parse_bf16_convolutions(const std::string& text);

struct CudaBackendOptions {
  /// Lets cuDNN and cuBLAS use TF32 tensor cores for fp32 (faster, ~1e-3 relative). Off: strict
  /// fp32, results within ~1e-6 of the host backend.
  bool allow_tf32 = false;
  Bf16Convolutions bf16_convolutions = Bf16Convolutions::Native;
  /// The largest workspace a cuDNN algorithm may use; 0: a sixteenth of the GPU's memory, at
  /// least 1 GiB (an H200: 8.7 GiB; 3-D convolutions' fastest algorithms may need GiBs).
  std::size_t workspace_limit = 0;
};

/// The cuDNN/cuBLAS backend on the current GPU (cuda::set_device); its kernels take device
/// pointers and run on cuda::stream(). In a build without CUDA, or with no GPU, it throws an
/// Error that says why.
std::unique_ptr<DnnBackend> make_cuda_backend(const CudaBackendOptions& options = {});

}  // namespace tessera
