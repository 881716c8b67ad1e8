// Convolution forward / backward-data / backward-weights with oneDNN. Primitives for a geometry
// are built on its first use and kept: building one costs far more than running it on the
// small tiles of a distributed layer.
//
// 3-D backward-weights: oneDNN 2.6 has no jit kernel for it on AVX2 and falls back to im2col +
// gemm, several times slower than the 2-D jit kernels. Where the library's choice is not a jit
// kernel, the 3-D problem is decomposed into 2-D ones:
//   dW[f,c,kd,kh,kw] = sum over (n, od) of the 2-D backward-weights of the plane pair
//                      (X[n,:,d,:,:], dY[n,:,od,:,:]),  d = od*stride_d + kd*dilation_d - padding_d,
// over the od whose d lies inside the input. Both operands are first copied (oneDNN reorders
// between strided views, built once per geometry, into buffers kept with it) into 2-D images
// ordered depth-major, [d][n][image], in a layout the 2-D jit kernels take (channel blocks of 8,
// channels-last, or plain for X with few channels), so that the valid pairs of one kd are one
// contiguous 2-D batch that the 2-D kernels read in place. Per kd (PerDepth) a 2-D problem with
// the input's channels, or, for inputs with fewer than 8 channels, where a 2-D kernel would waste
// most of each vector, one 2-D problem whose channels are (c, kd) pairs (Folded: an im2col along
// depth only). The bias gradient comes from a 2-D problem that covers every (n, od) pair, or
// else from a loop over dY. On CosmoFlow's layers (AVX2, one thread, batch 4) it measured
// 1.3-2x faster than the gemm, copies included. The 2-D jit kernels sum in fp32 in a longer
// sequence than the gemm: against a double-precision sum their error was up to ~10x the gemm's
// (2e-5 relative with strong cancellation over 131k terms): the accuracy of the 2-D layers.
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>
#include <string>

#include "layers/host_direct_convolution.hpp"
#include "layers/host_winograd_convolution.hpp"
#include "layers/host_loops.hpp"
#include "layers/onednn_common.hpp"
#include "tessera/core/error.hpp"

namespace tessera::onednn {
namespace {

using dnnl::algorithm;
using dnnl::prop_kind;

/// Automatic mode decomposes 3-D backward-weights from this many multiply-adds (CosmoFlow's
/// smallest layer at batch 1 has 7M).
constexpr std::int64_t kDecomposeFromMultiplyAdds = std::int64_t{1} << 20;

/// Automatic mode runs the Winograd kernels from this many 2 x 2 x 2 output tiles per call (at 16,
/// CosmoFlow's conv5 at 4^3 and batch 2, they measured 1.4-1.7x slower than oneDNN, the weights'
/// transform as long as the products; at 128, its conv4 at 8^3, 1.3-1.4x faster).
constexpr std::int64_t kWinogradFromTiles = 128;
/// ... and their backward-weights from this many tiles per thread (CosmoFlow's conv3 at 16^3 and
/// batch 2, 1 024 tiles: 1.3x faster than oneDNN; its conv4 at 8^3, 128 tiles: 1.9x slower, the
/// lanes' sums and the weights' transforms as long as the products).
constexpr std::int64_t kWinogradWeightsFromTiles = 1024;

/// floor(a / b) for b > 0.
std::int64_t floor_div(std::int64_t a, std::int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

dnnl::memory::desc strided_desc(const Dims& dims, const Dims& strides) {
  return dnnl::memory::desc(dims, dnnl::memory::data_type::f32, strides);
}

/// dims (N, C, spatial...) with C in blocks of 8 innermost (nChw8c / nCdhw8c: C padded to a
/// multiple of 8) and the given outer strides, in elements (C's: per block of 8).
dnnl::memory::desc blocked_view(const Dims& dims, const Dims& strides) {
  dnnl::memory::desc desc(dims, dnnl::memory::data_type::f32, dims.size() == 5 ? Tag::nCdhw8c : Tag::nChw8c);
  for (std::size_t i = 0; i < strides.size(); ++i) desc.data.format_desc.blocking.strides[i] = strides[i];
  return desc;
}

std::int64_t round_up_8(std::int64_t value) { return (value + 7) / 8 * 8; }

/// How a 2-D operand of a decomposed 3-D backward-weights lays out one (n, od) pair.
enum class PairLayout { Plain, ChannelsLast, Blocked8 };

/// The layout's 2-D tag; its floats per pair of `channels` planes of `plane` elements.
Tag tag_of(PairLayout layout) {
  return layout == PairLayout::Plain ? Tag::nchw : layout == PairLayout::ChannelsLast ? Tag::nhwc : Tag::nChw8c;
}
std::int64_t pair_size(PairLayout layout, std::int64_t channels, std::int64_t plane) {
  return plane * (layout == PairLayout::Blocked8 ? round_up_8(channels) : channels);
}

/// A depth-major destination view for dims (N, C, depths, H, W) in `layout`: element (n, c, i, h, w)
/// at pair i*N + n, channel c*channel_step of `channels` (channel_step > 1: interleaved with
/// other views, Plain and ChannelsLast only).
dnnl::memory::desc pair_view(PairLayout layout, const Dims& dims, std::int64_t channels, std::int64_t channel_step) {
  const std::int64_t n = dims[0], height = dims[3], width = dims[4], plane = height * width;
  const std::int64_t pair = pair_size(layout, channels, plane);
  switch (layout) {
    case PairLayout::Plain:
      return strided_desc(dims, {pair, channel_step * plane, n * pair, width, 1});
    case PairLayout::ChannelsLast:
      return strided_desc(dims, {pair, channel_step, n * pair, width * channels, channels});
    case PairLayout::Blocked8:
      break;
  }
  return blocked_view(dims, {pair, plane * 8, n * pair, width * 8, 8});
}

/// A reorder from a strided view of a caller's buffer (at from_offset elements) into an owned one.
struct ViewCopy {
  dnnl::memory from, to;
  dnnl::reorder reorder;
  std::int64_t from_offset = 0;
};

/// One 2-D backward-weights problem of a decomposed 3-D one.
struct DepthSlice {
  dnnl::convolution_backward_weights primitive;
  dnnl::memory input, grad_output;      ///< views into DecomposedWeights' buffers
  dnnl::memory grad_weights;            ///< in the primitive's layout, owned
  dnnl::memory user_grad_weights;       ///< strided view of the caller's dW at weights_offset
  dnnl::reorder to_user;
  std::int64_t weights_offset = 0;
  dnnl::memory grad_bias;  ///< set on the one slice that covers every pair and computes the bias
};

/// 3-D backward-weights as 2-D jit problems (see the top of this file), built once per geometry.
struct DecomposedWeights {
  std::vector<float> input_buffer, grad_output_buffer;
  std::vector<ViewCopy> input_copies;
  ViewCopy grad_output_copy;
  std::vector<DepthSlice> slices;
  std::vector<std::int64_t> empty_depths;  ///< kd that no pair reaches: dW[:, :, kd] = 0
  bool bias_by_loop = false;               ///< no slice covers every pair: sum dY directly
  std::string implementation;
  bool jit = true;  ///< every 2-D primitive is a jit one
};

/// Everything built for one geometry. The backward primitives need the forward descriptor as
/// a hint and are built on the first backward call (evaluation never needs them).
struct ConvolutionPlan {
  bool blocked = false;
  dnnl::memory::dims strides, dilations, padding_left, padding_right;
  dnnl::memory::desc user_input, user_weights, user_bias, user_output;

  dnnl::convolution_forward::primitive_desc forward_descriptor;
  dnnl::convolution_forward forward;
  /// Forward with a fused leaky ReLU, by slope: the same layouts as `forward` (so the same
  /// Operands serve), made when first asked for.
  std::map<float, dnnl::convolution_forward> fused_forward;
  Operand input, weights, output;
  dnnl::memory bias;

  bool has_backward = false;
  dnnl::convolution_backward_data backward_data;
  Operand data_grad_output, data_weights, data_grad_input;
  dnnl::convolution_backward_weights backward_weights;
  Operand weights_input, weights_grad_output, weights_grad_weights;
  dnnl::memory grad_bias;
  bool shared_grad_output = false;
  std::unique_ptr<DecomposedWeights> decomposed;  ///< set: used instead of backward_weights
};

class OneDnnConvolution final : public ConvolutionKernels {
 public:
  OneDnnConvolution(Context& context, HostConvolutionLayout layout, BackwardWeights3d backward_weights_3d)
      : context_(context), layout_(layout), backward_weights_3d_(backward_weights_3d) {}

  void forward(const ConvolutionGeometry& geometry, const float* input, const float* weights, const float* bias,
               float* output) override {
    if (direct(geometry)) return direct_.forward(geometry, input, weights, bias, output);
    if (winograd(geometry)) return winograd_.forward(geometry, input, weights, bias, output);
    ConvolutionPlan& plan = plan_for(geometry.without_activation());  // one plan per convolution
    auto& stream = context_.stream;
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, plan.input.bind_input(input, stream)},
        {DNNL_ARG_WEIGHTS, plan.weights.bind_input(weights, stream)},
        {DNNL_ARG_DST, plan.output.bind_output(output)}};
    if (geometry.bias) {
      plan.bias.set_data_handle(const_cast<float*>(bias));
      args.emplace(DNNL_ARG_BIAS, plan.bias);
    }
    (geometry.leaky_relu ? fused_forward(plan, geometry) : plan.forward).execute(stream, args);
    plan.output.finish_output(stream);
    stream.wait();
  }

  // oneDNN's relu post-op: with a slope, s > 0 ? s : slope * s; with none (relu), a maximum with
  // 0 that turns NaNs into 0 (which the layer lets through): not fused.
  bool fuses_leaky_relu(float slope) const override { return slope > 0.0f; }

  void backward_data(const ConvolutionGeometry& geometry, const float* grad_output, const float* weights,
                     float* grad_input) override {
    if (winograd(geometry)) return winograd_backward_data(geometry, grad_output, weights, grad_input);
    ConvolutionPlan& plan = backward_plan_for(geometry);
    auto& stream = context_.stream;
    plan.backward_data.execute(stream, {{DNNL_ARG_DIFF_DST, plan.data_grad_output.bind_input(grad_output, stream)},
                                        {DNNL_ARG_WEIGHTS, plan.data_weights.bind_input(weights, stream)},
                                        {DNNL_ARG_DIFF_SRC, plan.data_grad_input.bind_output(grad_input)}});
    plan.data_grad_input.finish_output(stream);
    stream.wait();
  }

  void backward_weights(const ConvolutionGeometry& geometry, const float* input, const float* grad_output,
                        float* grad_weights, float* grad_bias) override {
    if (direct(geometry)) return direct_.backward_weights(geometry, input, grad_output, grad_weights, grad_bias);
    if (winograd_weights(geometry))
      return winograd_.backward_weights(geometry, input, grad_output, grad_weights, grad_bias);
    ConvolutionPlan& plan = backward_plan_for(geometry);
    if (plan.decomposed) {
      run_decomposed(*plan.decomposed, geometry, input, grad_output, grad_weights, grad_bias);
      return;
    }
    auto& stream = context_.stream;
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, plan.weights_input.bind_input(input, stream)},
        {DNNL_ARG_DIFF_DST, plan.weights_grad_output.bind_input(grad_output, stream)},
        {DNNL_ARG_DIFF_WEIGHTS, plan.weights_grad_weights.bind_output(grad_weights)}};
    if (geometry.bias) {
      plan.grad_bias.set_data_handle(grad_bias);
      args.emplace(DNNL_ARG_DIFF_BIAS, plan.grad_bias);
    }
    plan.backward_weights.execute(stream, args);
    plan.weights_grad_weights.finish_output(stream);
    stream.wait();
  }

  bool reads_pooled_gradient(const ConvolutionGeometry& geometry, const PoolingGeometry& pooling) override {
    return direct(geometry) && host::pooled_gradient_applies(geometry, pooling);
  }

  void backward_weights_from_pooling(const ConvolutionGeometry& geometry, const float* input,
                                     const PooledGradient& pooled, float* grad_weights, float* grad_bias) override {
    if (!pooled.geometry || !reads_pooled_gradient(geometry, *pooled.geometry))
      return ConvolutionKernels::backward_weights_from_pooling(geometry, input, pooled, grad_weights, grad_bias);
    direct_.backward_weights_from_pooling(geometry, input, pooled, grad_weights, grad_bias);
  }

  void forward_pooled(const ConvolutionGeometry& geometry, const float* input, const float* weights, const float* bias,
                      const PooledOutput& pooled) override {
    if (!pooled.geometry || !reads_pooled_gradient(geometry.without_activation(), *pooled.geometry))
      return ConvolutionKernels::forward_pooled(geometry, input, weights, bias, pooled);
    direct_.forward_pooled(geometry, input, weights, bias, pooled);
  }

  void backward(const ConvolutionGeometry& geometry, const float* input, const float* grad_output,
                const float* weights, float* grad_input, float* grad_weights, float* grad_bias) override {
    if (direct(geometry)) {
      if (grad_input) backward_data(geometry, grad_output, weights, grad_input);
      direct_.backward_weights(geometry, input, grad_output, grad_weights, grad_bias);
      return;
    }
    if (winograd(geometry)) {
      if (grad_input) winograd_backward_data(geometry, grad_output, weights, grad_input);
      backward_weights(geometry, input, grad_output, grad_weights, grad_bias);
      return;
    }
    ConvolutionPlan& plan = backward_plan_for(geometry);
    if (!grad_input || !plan.shared_grad_output || plan.decomposed) {
      ConvolutionKernels::backward(geometry, input, grad_output, weights, grad_input, grad_weights, grad_bias);
      return;
    }
    // Both passes read grad_output in the same layout: convert it once.
    auto& stream = context_.stream;
    dnnl::memory& converted = plan.data_grad_output.bind_input(grad_output, stream);
    plan.backward_data.execute(stream, {{DNNL_ARG_DIFF_DST, converted},
                                        {DNNL_ARG_WEIGHTS, plan.data_weights.bind_input(weights, stream)},
                                        {DNNL_ARG_DIFF_SRC, plan.data_grad_input.bind_output(grad_input)}});
    plan.data_grad_input.finish_output(stream);
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, plan.weights_input.bind_input(input, stream)},
        {DNNL_ARG_DIFF_DST, converted},
        {DNNL_ARG_DIFF_WEIGHTS, plan.weights_grad_weights.bind_output(grad_weights)}};
    if (geometry.bias) {
      plan.grad_bias.set_data_handle(grad_bias);
      args.emplace(DNNL_ARG_DIFF_BIAS, plan.grad_bias);
    }
    plan.backward_weights.execute(stream, args);
    plan.weights_grad_weights.finish_output(stream);
    stream.wait();
  }

 private:
  /// Winograd's backward-data with its tiles, 2 planes deep, over an even number of planes: where
  /// the planes to compute (the data region's, along D) are odd in number and the last or the
  /// first is the window's own (a spatial tile's halo plane), that plane comes apart from 2-D
  /// convolutions of the output gradient's planes with the kernel's slices (oneDNN) rather than a
  /// whole tile of Winograd's.
  void winograd_backward_data(const ConvolutionGeometry& g, const float* grad_output, const float* weights,
                              float* grad_input) {
    const std::int64_t window = g.input_size[0];
    const std::int64_t begin = g.data_begin.empty() ? 0 : g.data_begin[0];
    const std::int64_t extent = g.data_begin.empty() ? window : g.data_extent[0];
    // (Winograd computes a region along D only where it starts within 2 - padding.)
    const std::int64_t reach = 2 - g.padding[0];
    std::int64_t plane = -1;
    if (extent % 2 == 1 && extent >= 3 && begin + extent == window && begin <= reach) plane = window - 1;
    else if (extent % 2 == 1 && extent >= 3 && begin == 0 && reach >= 1) plane = 0;
    if (plane < 0) return winograd_.backward_data(g, grad_output, weights, grad_input);
    rest_geometry_ = g;
    if (rest_geometry_.data_begin.empty()) {
      rest_geometry_.data_begin = {0, 0, 0};
      rest_geometry_.data_extent = g.input_size;
    }
    rest_geometry_.data_extent[0] = extent - 1;
    if (plane == begin) rest_geometry_.data_begin[0] = begin + 1;
    winograd_.backward_data(rest_geometry_, grad_output, weights, grad_input);  // zeros at `plane`
    edge_plane_backward_data(g, plane, grad_output, weights, grad_input);
  }

  /// grad_input's plane `plane` along D: the sum over the kernel's depth j of the 2-D backward-data
  /// of grad_output's plane plane + padding - j with the weights' slice j.
  void edge_plane_backward_data(const ConvolutionGeometry& g, std::int64_t plane, const float* grad_output,
                                const float* weights, float* grad_input) {
    const std::int64_t N = g.batch, C = g.in_channels, K = g.out_channels, out_depth = g.output_size[0];
    const std::int64_t in_plane = g.input_size[1] * g.input_size[2], out_plane = g.output_size[1] * g.output_size[2];
    const std::int64_t taps = g.kernel[1] * g.kernel[2];
    ConvolutionGeometry& g2 = plane_geometry_;  // assigned field by field: its vectors keep their memory
    g2.batch = N;
    g2.in_channels = C;
    g2.out_channels = K;
    g2.input_size = {g.input_size[1], g.input_size[2]};
    g2.kernel = {g.kernel[1], g.kernel[2]};
    g2.stride = {1, 1};
    g2.padding = {g.padding[1], g.padding[2]};
    g2.dilation = {1, 1};
    g2.output_size = {g.output_size[1], g.output_size[2]};
    g2.bias = false;
    g2.precision = Precision::F32;
    g2.leaky_relu = false;
    g2.leaky_slope = 0;
    g2.data_begin.clear();
    g2.data_extent.clear();
    plane_grad_output_.resize(static_cast<std::size_t>(N * K * out_plane));
    plane_weights_.resize(static_cast<std::size_t>(K * C * taps));
    plane_grad_input_.resize(static_cast<std::size_t>(N * C * in_plane));
    plane_sum_.assign(static_cast<std::size_t>(N * C * in_plane), 0.0f);
    for (std::int64_t j = 0; j < g.kernel[0]; ++j) {
      const std::int64_t o = plane + g.padding[0] - j;
      if (o < 0 || o >= out_depth) continue;
      for (std::int64_t nk = 0; nk < N * K; ++nk)
        std::copy_n(grad_output + (nk * out_depth + o) * out_plane, out_plane,
                    plane_grad_output_.data() + nk * out_plane);
      for (std::int64_t kc = 0; kc < K * C; ++kc)
        std::copy_n(weights + (kc * g.kernel[0] + j) * taps, taps, plane_weights_.data() + kc * taps);
      backward_data(g2, plane_grad_output_.data(), plane_weights_.data(), plane_grad_input_.data());
      for (std::size_t i = 0; i < plane_sum_.size(); ++i) plane_sum_[i] += plane_grad_input_[i];
    }
    const std::int64_t in_depth = g.input_size[0];
    for (std::int64_t nc = 0; nc < N * C; ++nc)
      std::copy_n(plane_sum_.data() + nc * in_plane, in_plane, grad_input + (nc * in_depth + plane) * in_plane);
  }

  /// Records, once per convolution (with or without a fused activation), which kernels run it;
  /// `recorded` holds both forms, so that later calls find theirs without a copy.
  void record_once(std::set<ConvolutionGeometry>& recorded, const ConvolutionGeometry& geometry, const char* what,
                   const char* implementation) {
    if (recorded.contains(geometry)) return;
    const ConvolutionGeometry plain = geometry.without_activation();
    if (recorded.insert(plain).second) context_.record(what + plain.to_string(), implementation);
    recorded.insert(geometry);
  }

  /// Whether Tessera's direct kernels run this convolution's forward and backward-weights: where
  /// they apply, unless a test forced a layout or a 3-D backward-weights mode.
  bool direct(const ConvolutionGeometry& geometry) {
    if (layout_ != HostConvolutionLayout::Automatic || backward_weights_3d_ != BackwardWeights3d::Automatic ||
        !host::direct_convolution_applies(geometry))
      return false;
    record_once(direct_recorded_, geometry, "convolution forward and backward weights ",
                "tessera direct (one input channel, plain layout)");
    return true;
  }

  /// On a CPU with AVX-512, unless TESSERA_WINOGRAD=0 turns the Winograd kernels off.
  static bool winograd_available() {
    const char* setting = std::getenv("TESSERA_WINOGRAD");
    return __builtin_cpu_supports("avx512f") && !(setting && std::string(setting) == "0");
  }

  /// Whether Tessera's Winograd kernels run this convolution's forward and backward-data: where
  /// they apply on a CPU with AVX-512 to at least kWinogradFromTiles tiles (where they measured
  /// faster), unless a test forced a layout or a 3-D backward-weights mode.
  bool winograd(const ConvolutionGeometry& geometry) {
    static const bool available = winograd_available();
    if (!available || layout_ != HostConvolutionLayout::Automatic || backward_weights_3d_ != BackwardWeights3d::Automatic ||
        !host::winograd_convolution_applies(geometry))
      return false;
    if (host::winograd_tiles(geometry) < kWinogradFromTiles) return false;
    record_once(winograd_recorded_, geometry, "convolution forward and backward data ",
                "tessera winograd F(2x2x2, 3x3x3) (plain layout)");
    return true;
  }

  /// Whether they also run its backward-weights: from kWinogradWeightsFromTiles tiles per thread.
  bool winograd_weights(const ConvolutionGeometry& geometry) {
    if (!winograd(geometry) || host::winograd_tiles(geometry) < kWinogradWeightsFromTiles * omp_get_max_threads())
      return false;
    record_once(winograd_weights_recorded_, geometry, "convolution backward weights ",
                "tessera winograd F(2x2x2, 3x3x3) (plain layout)");
    return true;
  }

  bool blocked_for(const ConvolutionGeometry& geometry) const {
    return layout_ == HostConvolutionLayout::Blocked ||
           (layout_ == HostConvolutionLayout::Automatic &&
            (geometry.in_channels >= 8 || (geometry.input_size.size() == 3 && taps(geometry) >= 27)));
  }

  static std::int64_t taps(const ConvolutionGeometry& geometry) {
    std::int64_t count = 1;
    for (auto k : geometry.kernel) count *= k;
    return count;
  }

  dnnl::memory::desc chosen_or_any(const dnnl::memory::desc& plain, bool blocked) const {
    return blocked ? dnnl::memory::desc(plain.dims(), dnnl::memory::data_type::f32, Tag::any) : plain;
  }

  /// The forward of `geometry`'s convolution with its leaky ReLU fused (oneDNN's relu post-op with
  /// that slope, after the bias), on the layouts `plan` chose for the convolution alone.
  dnnl::convolution_forward& fused_forward(ConvolutionPlan& plan, const ConvolutionGeometry& geometry) {
    auto found = plan.fused_forward.find(geometry.leaky_slope);
    if (found != plan.fused_forward.end()) return found->second;
    const auto& pd = plan.forward_descriptor;
    auto descriptor = geometry.bias
        ? dnnl::convolution_forward::desc(prop_kind::forward_training, algorithm::convolution_direct, pd.src_desc(),
                                          pd.weights_desc(), plan.user_bias, pd.dst_desc(), plan.strides,
                                          plan.dilations, plan.padding_left, plan.padding_right)
        : dnnl::convolution_forward::desc(prop_kind::forward_training, algorithm::convolution_direct, pd.src_desc(),
                                          pd.weights_desc(), pd.dst_desc(), plan.strides, plan.dilations,
                                          plan.padding_left, plan.padding_right);
    dnnl::post_ops ops;
    ops.append_eltwise(1.0f, algorithm::eltwise_relu, geometry.leaky_slope, 0.0f);
    dnnl::primitive_attr attributes;
    attributes.set_post_ops(ops);
    const dnnl::convolution_forward::primitive_desc fused(descriptor, attributes, context_.engine);
    TESSERA_CHECK(fused.src_desc() == pd.src_desc() && fused.weights_desc() == pd.weights_desc() &&
                      fused.dst_desc() == pd.dst_desc(),
                  "oneDNN chose other layouts for convolution {} with its activation", geometry.to_string());
    context_.record("convolution forward " + geometry.to_string(), fused);
    return plan.fused_forward.emplace(geometry.leaky_slope, dnnl::convolution_forward(fused)).first->second;
  }

  ConvolutionPlan& plan_for(const ConvolutionGeometry& geometry) {
    TESSERA_CHECK(!geometry.leaky_relu, "convolution plans are the convolution's alone: {}", geometry.to_string());
    auto found = plans_.find(geometry);
    if (found != plans_.end()) return *found->second;

    auto plan = std::make_unique<ConvolutionPlan>();
    const auto& g = geometry;
    const bool three_d = g.input_size.size() == 3;
    Dims weight_dims{g.out_channels, g.in_channels};
    weight_dims.insert(weight_dims.end(), g.kernel.begin(), g.kernel.end());
    plan->user_input = activation_desc(g.batch, g.in_channels, g.input_size, false);
    plan->user_output = activation_desc(g.batch, g.out_channels, g.output_size, false);
    plan->user_weights = dnnl::memory::desc(weight_dims, dnnl::memory::data_type::f32, three_d ? Tag::oidhw : Tag::oihw);
    plan->user_bias = dnnl::memory::desc({g.out_channels}, dnnl::memory::data_type::f32, Tag::x);
    for (std::size_t i = 0; i < g.input_size.size(); ++i) {
      plan->strides.push_back(g.stride[i]);
      plan->dilations.push_back(g.dilation[i] - 1);  // oneDNN counts the gaps: 0 = dense
      plan->padding_left.push_back(g.padding[i]);
      // What the right side must be for oneDNN's output-size rule to give our output size;
      // negative when the last input rows are not reached by any window.
      const std::int64_t reach = (g.output_size[i] - 1) * g.stride[i] + (g.kernel[i] - 1) * g.dilation[i] + 1;
      plan->padding_right.push_back(reach - g.input_size[i] - g.padding[i]);
    }

    plan->blocked = blocked_for(g);
    const auto input_desc = chosen_or_any(plan->user_input, plan->blocked);
    const auto weights_desc = chosen_or_any(plan->user_weights, plan->blocked);
    const auto output_desc = chosen_or_any(plan->user_output, plan->blocked);
    auto descriptor = g.bias
        ? dnnl::convolution_forward::desc(prop_kind::forward_training, algorithm::convolution_direct, input_desc,
                                          weights_desc, plan->user_bias, output_desc, plan->strides, plan->dilations,
                                          plan->padding_left, plan->padding_right)
        : dnnl::convolution_forward::desc(prop_kind::forward_training, algorithm::convolution_direct, input_desc,
                                          weights_desc, output_desc, plan->strides, plan->dilations,
                                          plan->padding_left, plan->padding_right);
    plan->forward_descriptor = dnnl::convolution_forward::primitive_desc(descriptor, context_.engine);
    const auto& pd = plan->forward_descriptor;
    plan->forward = dnnl::convolution_forward(pd);
    plan->input = Operand(plan->user_input, pd.src_desc(), context_.engine, true);
    plan->weights = Operand(plan->user_weights, pd.weights_desc(), context_.engine, true);
    plan->output = Operand(plan->user_output, pd.dst_desc(), context_.engine, false);
    plan->bias = dnnl::memory(plan->user_bias, context_.engine, DNNL_MEMORY_NONE);
    context_.record("convolution forward " + g.to_string(), pd);

    return *plans_.emplace(geometry, std::move(plan)).first->second;
  }

  ConvolutionPlan& backward_plan_for(const ConvolutionGeometry& geometry) {
    ConvolutionPlan& plan = plan_for(geometry);
    if (plan.has_backward) return plan;
    const auto& engine = context_.engine;

    dnnl::convolution_backward_data::desc data_descriptor(
        algorithm::convolution_direct, chosen_or_any(plan.user_input, plan.blocked), chosen_or_any(plan.user_weights, plan.blocked),
        chosen_or_any(plan.user_output, plan.blocked), plan.strides, plan.dilations, plan.padding_left, plan.padding_right);
    dnnl::convolution_backward_data::primitive_desc data_pd(data_descriptor, engine, plan.forward_descriptor);
    plan.backward_data = dnnl::convolution_backward_data(data_pd);
    plan.data_grad_output = Operand(plan.user_output, data_pd.diff_dst_desc(), engine, true);
    plan.data_weights = Operand(plan.user_weights, data_pd.weights_desc(), engine, true);
    plan.data_grad_input = Operand(plan.user_input, data_pd.diff_src_desc(), engine, false);
    context_.record("convolution backward data " + geometry.to_string(), data_pd);

    const bool bias = geometry.bias;
    // Backward-weights keeps the plain layout below 8 input channels also where forward is
    // blocked, except with AVX-512: oneDNN's blocked 3-D jit kernel for one input channel is
    // the fastest there, and on AVX2 the slowest (docs/benchmarks.md, "3-D backward-weights").
    const bool weights_blocked =
        plan.blocked && (layout_ == HostConvolutionLayout::Blocked || geometry.in_channels >= 8 || context_.avx512());
    auto weights_descriptor = bias
        ? dnnl::convolution_backward_weights::desc(algorithm::convolution_direct, chosen_or_any(plan.user_input, weights_blocked),
                                                   chosen_or_any(plan.user_weights, weights_blocked), plan.user_bias,
                                                   chosen_or_any(plan.user_output, weights_blocked), plan.strides, plan.dilations,
                                                   plan.padding_left, plan.padding_right)
        : dnnl::convolution_backward_weights::desc(algorithm::convolution_direct, chosen_or_any(plan.user_input, weights_blocked),
                                                   chosen_or_any(plan.user_weights, weights_blocked), chosen_or_any(plan.user_output, weights_blocked),
                                                   plan.strides, plan.dilations, plan.padding_left,
                                                   plan.padding_right);
    dnnl::convolution_backward_weights::primitive_desc weights_pd(weights_descriptor, engine, plan.forward_descriptor);
    const std::string what = "convolution backward weights " + geometry.to_string();

    const std::string direct = weights_pd.impl_info_str();
    const bool direct_is_slow = direct.find("gemm") != std::string::npos || direct.find("ref") != std::string::npos;
    // Small problems keep the direct primitive: the 2-D calls and copies would gain little there.
    std::int64_t multiply_adds = geometry.batch * geometry.in_channels * geometry.out_channels;
    for (std::size_t i = 0; i < geometry.kernel.size(); ++i) multiply_adds *= geometry.kernel[i] * geometry.output_size[i];
    const bool worth_decomposing = direct_is_slow && multiply_adds >= kDecomposeFromMultiplyAdds;
    const auto mode = backward_weights_3d_;
    if (geometry.input_size.size() == 3 && mode != BackwardWeights3d::Direct &&
        (mode != BackwardWeights3d::Automatic || worth_decomposing)) {
      const bool folded =
          mode == BackwardWeights3d::Folded || (mode == BackwardWeights3d::Automatic && geometry.in_channels < 8);
      // The operand layouts to try, best first (measured); the first with jit 2-D kernels wins.
      using Layouts = std::pair<PairLayout, PairLayout>;  // X, dY
      const Layouts blocked{PairLayout::Blocked8, PairLayout::Blocked8};
      const Layouts channels_last{PairLayout::ChannelsLast, PairLayout::ChannelsLast};
      const Layouts plain_input{PairLayout::Plain, PairLayout::Blocked8};
      std::vector<Layouts> candidates{channels_last, plain_input};
      if (folded) candidates = {plain_input, channels_last};
      else if (geometry.in_channels >= 8) candidates = {blocked, channels_last};
      std::unique_ptr<DecomposedWeights> decomposed;
      for (const auto& [input_layout, output_layout] : candidates) {
        try {
          auto attempt = build_decomposed(geometry, plan, folded, input_layout, output_layout);
          if (!decomposed || attempt->jit) decomposed = std::move(attempt);  // forced modes: the first if none is jit
        } catch (const dnnl::error&) {
          if (mode != BackwardWeights3d::Automatic) throw;
        }
        if (decomposed && decomposed->jit) break;
      }
      if (decomposed && (decomposed->jit || mode != BackwardWeights3d::Automatic)) {
        context_.record(what, decomposed->implementation + "; direct: " + direct + ")");
        plan.decomposed = std::move(decomposed);
        plan.has_backward = true;
        return plan;
      }
    }

    plan.backward_weights = dnnl::convolution_backward_weights(weights_pd);
    plan.weights_input = Operand(plan.user_input, weights_pd.src_desc(), engine, true);
    plan.weights_grad_output = Operand(plan.user_output, weights_pd.diff_dst_desc(), engine, true);
    plan.weights_grad_weights = Operand(plan.user_weights, weights_pd.diff_weights_desc(), engine, false);
    plan.grad_bias = dnnl::memory(plan.user_bias, engine, DNNL_MEMORY_NONE);
    plan.shared_grad_output = data_pd.diff_dst_desc() == weights_pd.diff_dst_desc();
    context_.record(what, weights_pd);

    plan.has_backward = true;
    return plan;
  }

  /// The 2-D problems of a 3-D backward-weights (see the top of this file).
  std::unique_ptr<DecomposedWeights> build_decomposed(const ConvolutionGeometry& g, const ConvolutionPlan& plan,
                                                      bool folded, PairLayout input_layout,
                                                      PairLayout output_layout) {
    const auto& engine = context_.engine;
    auto result = std::make_unique<DecomposedWeights>();
    auto& dw = *result;
    const std::int64_t n_count = g.batch, c_count = g.in_channels, f_count = g.out_channels;
    const std::int64_t depth = g.input_size[0], height = g.input_size[1], width = g.input_size[2];
    const std::int64_t out_depth = g.output_size[0], out_height = g.output_size[1], out_width = g.output_size[2];
    const std::int64_t kd_count = g.kernel[0], kh = g.kernel[1], kw = g.kernel[2];
    const std::int64_t stride = g.stride[0], dilation = g.dilation[0], padding = g.padding[0];
    const std::int64_t plane = height * width, out_plane = out_height * out_width;
    const std::int64_t channels = folded ? c_count * kd_count : c_count;  // of the 2-D problems
    // The 2-D operands' layouts: the 2-D jit kernels (oneDNN 2.6, AVX2) take dY blocked by 8
    // channels or channels-last, never plain; X in the same layout, or plain for few channels.
    if (folded && input_layout == PairLayout::Blocked8) throw dnnl::error(dnnl_unimplemented, "folded X blocked");
    const std::int64_t pair_input = pair_size(input_layout, channels, plane);
    const std::int64_t pair_output = pair_size(output_layout, f_count, out_plane);
    const Dims input_strides{c_count * depth * plane, depth * plane, stride * plane, width, 1};  // X[n, c, od*s + off]

    // The output depths od in [first_valid(kd), last_valid(kd)] reach an input plane
    // d = od*stride + kd*dilation - padding inside [0, depth).
    auto first_valid = [&](std::int64_t kd) {
      const std::int64_t offset = kd * dilation - padding;
      return std::max<std::int64_t>(0, -floor_div(offset, stride));
    };
    auto last_valid = [&](std::int64_t kd) {
      const std::int64_t offset = kd * dilation - padding;
      return std::min(out_depth - 1, floor_div(depth - 1 - offset, stride));
    };

    // dY[n, f, od] -> grad_output_buffer[od][n][f, oh, ow in output_layout].
    dw.grad_output_buffer.resize(static_cast<std::size_t>(n_count * out_depth * pair_output));
    {
      const Dims dims{n_count, f_count, out_depth, out_height, out_width};
      auto& copy = dw.grad_output_copy;
      copy.from = dnnl::memory(plan.user_output, engine, DNNL_MEMORY_NONE);
      copy.to = dnnl::memory(pair_view(output_layout, dims, f_count, 1), engine, dw.grad_output_buffer.data());
      copy.reorder = dnnl::reorder(copy.from, copy.to);
    }

    // X -> input_buffer. Per kd: the planes of all d in one residue class modulo the stride,
    // [class][q][n][c, h, w in input_layout] with d = q*stride + class, so that od = first..last
    // of one kd are consecutive. Folded: [od][n][(c, kd), h, w], zero where d falls outside the
    // input (those positions are never written).
    std::vector<std::int64_t> class_start;
    if (folded) {
      dw.input_buffer.assign(static_cast<std::size_t>(n_count * out_depth * pair_input), 0.0f);
      for (std::int64_t kd = 0; kd < kd_count; ++kd) {
        const std::int64_t first = first_valid(kd), last = last_valid(kd);
        if (first > last) continue;
        const Dims dims{n_count, c_count, last - first + 1, height, width};
        ViewCopy copy;
        copy.from = dnnl::memory(strided_desc(dims, input_strides), engine, DNNL_MEMORY_NONE);
        copy.from_offset = (first * stride + kd * dilation - padding) * plane;
        const std::int64_t channel = input_layout == PairLayout::Plain ? kd * plane : kd;  // (0, kd)
        copy.to = dnnl::memory(pair_view(input_layout, dims, channels, kd_count), engine,
                               dw.input_buffer.data() + first * n_count * pair_input + channel);
        copy.reorder = dnnl::reorder(copy.from, copy.to);
        dw.input_copies.push_back(std::move(copy));
      }
    } else {
      dw.input_buffer.resize(static_cast<std::size_t>(n_count * depth * pair_input));
      std::int64_t start = 0;
      for (std::int64_t r = 0; r < std::min(stride, depth); ++r) {
        class_start.push_back(start);
        const std::int64_t count = (depth - r + stride - 1) / stride;
        const Dims dims{n_count, c_count, count, height, width};
        ViewCopy copy;
        copy.from = dnnl::memory(strided_desc(dims, input_strides), engine, DNNL_MEMORY_NONE);
        copy.from_offset = r * plane;
        copy.to = dnnl::memory(pair_view(input_layout, dims, channels, 1), engine, dw.input_buffer.data() + start);
        copy.reorder = dnnl::reorder(copy.from, copy.to);
        dw.input_copies.push_back(std::move(copy));
        start += count * n_count * pair_input;
      }
    }

    // The 2-D problems: weights in the kernel's own layout, reordered into dW.
    const Dims strides{plan.strides[1], plan.strides[2]}, dilations{plan.dilations[1], plan.dilations[2]};
    const Dims padding_left{plan.padding_left[1], plan.padding_left[2]};
    const Dims padding_right{plan.padding_right[1], plan.padding_right[2]};
    const auto f32 = dnnl::memory::data_type::f32;
    const Dims weight_dims{f_count, channels, kh, kw};
    // dW[f, c, kd] for one kd (c stride kd_count*kh*kw), or all of dW when folded ((c, kd) pairs).
    const auto user_weights =
        strided_desc(weight_dims, {c_count * kd_count * kh * kw, folded ? kh * kw : kd_count * kh * kw, kw, 1});
    auto add_slice = [&](std::int64_t pairs, float* input, float* grad_output, std::int64_t weights_offset,
                         bool with_bias) {
      const dnnl::memory::desc input_desc({pairs, channels, height, width}, f32, tag_of(input_layout));
      const dnnl::memory::desc output_desc({pairs, f_count, out_height, out_width}, f32, tag_of(output_layout));
      const dnnl::memory::desc weights_desc(weight_dims, f32, Tag::any);
      auto hint = with_bias ? dnnl::convolution_forward::desc(prop_kind::forward_training, algorithm::convolution_direct,
                                                              input_desc, weights_desc, plan.user_bias, output_desc,
                                                              strides, dilations, padding_left, padding_right)
                            : dnnl::convolution_forward::desc(prop_kind::forward_training, algorithm::convolution_direct,
                                                              input_desc, weights_desc, output_desc, strides, dilations,
                                                              padding_left, padding_right);
      dnnl::convolution_forward::primitive_desc hint_pd(hint, engine);
      auto descriptor = with_bias
          ? dnnl::convolution_backward_weights::desc(algorithm::convolution_direct, input_desc, weights_desc,
                                                     plan.user_bias, output_desc, strides, dilations, padding_left,
                                                     padding_right)
          : dnnl::convolution_backward_weights::desc(algorithm::convolution_direct, input_desc, weights_desc,
                                                     output_desc, strides, dilations, padding_left, padding_right);
      dnnl::convolution_backward_weights::primitive_desc pd(descriptor, engine, hint_pd);
      const std::string implementation = pd.impl_info_str();
      if (implementation.find("gemm") != std::string::npos || implementation.find("ref") != std::string::npos)
        dw.jit = false;
      if (dw.implementation.empty()) dw.implementation = implementation;
      DepthSlice slice;
      slice.primitive = dnnl::convolution_backward_weights(pd);
      slice.input = dnnl::memory(pd.src_desc(), engine, input);
      slice.grad_output = dnnl::memory(pd.diff_dst_desc(), engine, grad_output);
      slice.grad_weights = dnnl::memory(pd.diff_weights_desc(), engine);
      slice.user_grad_weights = dnnl::memory(user_weights, engine, DNNL_MEMORY_NONE);
      slice.to_user = dnnl::reorder(slice.grad_weights, slice.user_grad_weights);
      slice.weights_offset = weights_offset;
      if (with_bias) slice.grad_bias = dnnl::memory(plan.user_bias, engine, DNNL_MEMORY_NONE);
      dw.slices.push_back(std::move(slice));
    };

    if (folded) {
      add_slice(n_count * out_depth, dw.input_buffer.data(), dw.grad_output_buffer.data(), 0, g.bias);
      dw.implementation += " (3-D backward weights as one 2-D problem, kd folded into channels";
    } else {
      // The bias gradient comes from the first slice that covers every (n, od) pair, if any.
      bool bias_pending = g.bias;
      for (std::int64_t kd = 0; kd < kd_count; ++kd) {
        const std::int64_t first = first_valid(kd), last = last_valid(kd);
        if (first > last) {
          dw.empty_depths.push_back(kd);
          continue;
        }
        const std::int64_t offset = kd * dilation - padding;
        const std::int64_t r = offset - floor_div(offset, stride) * stride;
        const std::int64_t q = first + floor_div(offset, stride);
        add_slice((last - first + 1) * n_count, dw.input_buffer.data() + class_start[r] + q * n_count * pair_input,
                  dw.grad_output_buffer.data() + first * n_count * pair_output, kd * kh * kw,
                  bias_pending && first == 0 && last == out_depth - 1);
        if (first == 0 && last == out_depth - 1) bias_pending = false;
      }
      dw.bias_by_loop = bias_pending;
      if (dw.implementation.empty()) dw.implementation = "none";
      dw.implementation += " (3-D backward weights as 2-D per kd";
    }
    return result;
  }

  void run_decomposed(DecomposedWeights& dw, const ConvolutionGeometry& g, const float* input,
                      const float* grad_output, float* grad_weights, float* grad_bias) {
    auto& stream = context_.stream;
    for (auto& copy : dw.input_copies) {
      copy.from.set_data_handle(const_cast<float*>(input) + copy.from_offset);
      copy.reorder.execute(stream, copy.from, copy.to);
    }
    dw.grad_output_copy.from.set_data_handle(const_cast<float*>(grad_output));
    dw.grad_output_copy.reorder.execute(stream, dw.grad_output_copy.from, dw.grad_output_copy.to);
    for (auto& slice : dw.slices) {
      std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, slice.input},
                                                 {DNNL_ARG_DIFF_DST, slice.grad_output},
                                                 {DNNL_ARG_DIFF_WEIGHTS, slice.grad_weights}};
      if (slice.grad_bias) {
        slice.grad_bias.set_data_handle(grad_bias);
        args.emplace(DNNL_ARG_DIFF_BIAS, slice.grad_bias);
      }
      slice.primitive.execute(stream, args);
      slice.user_grad_weights.set_data_handle(grad_weights + slice.weights_offset);
      slice.to_user.execute(stream, slice.grad_weights, slice.user_grad_weights);
    }
    stream.wait();

    const std::int64_t kd_count = g.kernel[0], taps = g.kernel[1] * g.kernel[2];
    if (!dw.empty_depths.empty()) {
      const auto* empty = dw.empty_depths.data();
      const std::size_t empty_count = dw.empty_depths.size();
      host_for("conv3d backward weights: unreached kd", g.out_channels * g.in_channels, [=](std::int64_t fc) {
        for (std::size_t i = 0; i < empty_count; ++i) {
          float* w = grad_weights + (fc * kd_count + empty[i]) * taps;
          std::fill(w, w + taps, 0.0f);
        }
      });
    }
    if (dw.bias_by_loop) {
      const std::int64_t n_count = g.batch, f_count = g.out_channels;
      const std::int64_t volume = g.output_size[0] * g.output_size[1] * g.output_size[2];
      host_for(
          "conv3d backward bias", f_count,
          [=](std::int64_t f) {
            double sum = 0.0;
            for (std::int64_t n = 0; n < n_count; ++n) {
              const float* dy = grad_output + (n * f_count + f) * volume;
              for (std::int64_t i = 0; i < volume; ++i) sum += dy[i];
            }
            grad_bias[f] = static_cast<float>(sum);
          },
          n_count * volume);
    }
  }

  Context& context_;
  HostConvolutionLayout layout_;
  BackwardWeights3d backward_weights_3d_;
  std::map<ConvolutionGeometry, std::unique_ptr<ConvolutionPlan>> plans_;
  host::DirectConvolution direct_;
  std::set<ConvolutionGeometry> direct_recorded_;
  host::WinogradConvolution winograd_;
  std::set<ConvolutionGeometry> winograd_recorded_, winograd_weights_recorded_;
  /// winograd_backward_data's geometries and edge_plane_backward_data's planes (kept, so that a
  /// training step allocates nothing).
  ConvolutionGeometry rest_geometry_, plane_geometry_;
  std::vector<float> plane_grad_output_, plane_weights_, plane_grad_input_, plane_sum_;
};

}  // namespace

std::unique_ptr<ConvolutionKernels> make_convolution_kernels(Context& context, HostConvolutionLayout layout,
                                                             BackwardWeights3d backward_weights_3d) {
  return std::make_unique<OneDnnConvolution>(context, layout, backward_weights_3d);
}

}  // namespace tessera::onednn
