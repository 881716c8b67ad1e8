// The oneDNN backend's 3-D backward-weights decomposed into 2-D jit problems (per kernel depth
// position, or with the depth positions folded into the channels) against oneDNN's own 3-D
// primitive (im2col + gemm on AVX2), over strides, padding, dilation, unreached depth taps,
// batch and channel counts; and the implementation the backend records for diagnostics. The
// direct kernels for one input channel against a double-precision loop.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <unistd.h>

#include "layer_test_utils.hpp"
#include "layers/host_direct_convolution.hpp"
#include "layers/host_stream.hpp"
#include "layers/host_winograd_convolution.hpp"
#include "layers/onednn_common.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/layers/runtime.hpp"

namespace tessera::testing {
namespace {

using onednn::BackwardWeights3d;

struct Case {
  std::int64_t batch, in_channels, out_channels;
  std::vector<std::int64_t> input, kernel, stride, padding, dilation;
  bool bias;
};

ConvolutionGeometry geometry_of(const Case& c) {
  ConvolutionGeometry g;
  g.batch = c.batch;
  g.in_channels = c.in_channels;
  g.out_channels = c.out_channels;
  g.input_size = c.input;
  g.kernel = c.kernel;
  g.stride = c.stride;
  g.padding = c.padding;
  g.dilation = c.dilation;
  g.bias = c.bias;
  for (std::size_t i = 0; i < 3; ++i)
    g.output_size.push_back((c.input[i] + 2 * c.padding[i] - c.dilation[i] * (c.kernel[i] - 1) - 1) / c.stride[i] + 1);
  return g;
}

std::vector<float> random_values(std::int64_t count, std::uint64_t stream) {
  std::vector<float> values(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i)
    values[static_cast<std::size_t>(i)] = 2.0f * random_uniform(7, stream, static_cast<std::uint64_t>(i)) - 1.0f;
  return values;
}

/// Milliseconds one call of `call` takes (the timing benchmarks below).
template <class Call>
double time_ms(Call&& call) {
  const auto start = std::chrono::steady_clock::now();
  call();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

/// max |a - b| / max |b|.
double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double difference = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    difference = std::max(difference, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return scale > 0 ? difference / scale : difference;
}

/// The bias gradient matches `want` where the convolution has a bias, and is left untouched (123,
/// as the tests fill it) where not.
void expect_bias_gradient(bool bias, const std::vector<float>& got, const std::vector<float>& want, double tolerance) {
  if (bias) {
    EXPECT_LT(relative_difference(got, want), tolerance);
  } else {
    EXPECT_EQ(got, std::vector<float>(got.size(), 123.0f));
  }
}

std::int64_t product(const std::vector<std::int64_t>& values) {
  std::int64_t result = 1;
  for (auto v : values) result *= v;
  return result;
}

const std::vector<Case> cases = {
    // stride 2 in depth, padding
    {2, 8, 16, {6, 7, 5}, {3, 3, 3}, {2, 1, 1}, {1, 1, 1}, {1, 1, 1}, true},
    // dilation in depth, larger depth padding, stride in height, batch 1
    {1, 16, 8, {5, 6, 6}, {3, 2, 3}, {1, 2, 1}, {2, 0, 1}, {2, 1, 1}, true},
    // kernel 1 in depth, one channel, batch 3
    {3, 1, 8, {7, 6, 5}, {1, 3, 3}, {1, 1, 1}, {0, 1, 1}, {1, 1, 1}, true},
    // stride 2 and kernel 2 in depth, dilation in height, no bias, batch 3
    {3, 8, 4, {4, 5, 5}, {2, 3, 3}, {2, 2, 1}, {0, 1, 0}, {1, 2, 1}, false},
    // CosmoFlow's first two layers in small (large enough for the automatic choice to decompose)
    {2, 1, 16, {16, 16, 16}, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, true},
    {2, 8, 16, {8, 16, 16}, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, true},
    // kd = 0 reaches no input plane (stride 3, one output depth)
    {2, 8, 8, {2, 5, 4}, {3, 3, 3}, {3, 1, 1}, {1, 1, 1}, {1, 1, 1}, true},
    // kernel 2, padding 1 in depth: no kd reaches every output depth (bias summed separately)
    {2, 8, 16, {4, 5, 5}, {2, 3, 3}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, true},
    // 16 channels, padding right negative in depth (the last plane is not reached)
    {3, 16, 16, {6, 4, 4}, {2, 3, 3}, {2, 1, 1}, {0, 1, 1}, {1, 1, 1}, true},
};

struct Gradients {
  std::vector<float> weights, bias, input;
};

Gradients run(BackwardWeights3d mode, const ConvolutionGeometry& g, const std::vector<float>& input,
              const std::vector<float>& grad_output, const std::vector<float>& weights, bool with_input,
              std::vector<std::string>* implementations = nullptr, int repeats = 1) {
  onednn::Context context;
  auto kernels = onednn::make_convolution_kernels(context, HostConvolutionLayout::Automatic, mode);
  Gradients result;
  result.weights.assign(weights.size(), 123.0f);  // overwritten entirely
  result.bias.assign(static_cast<std::size_t>(g.out_channels), 123.0f);
  result.input.assign(input.size(), 0.0f);
  for (int i = 0; i < repeats; ++i) {
    if (with_input)
      kernels->backward(g, input.data(), grad_output.data(), weights.data(), result.input.data(), result.weights.data(),
                        result.bias.data());
    else
      kernels->backward_weights(g, input.data(), grad_output.data(), result.weights.data(), result.bias.data());
  }
  if (implementations) *implementations = context.implementations;
  return result;
}

std::string weights_line(const std::vector<std::string>& implementations) {
  for (const auto& line : implementations)
    if (line.find("convolution backward weights") != std::string::npos) return line;
  return "";
}

TEST(OneDnnConvolution3d, DecomposedBackwardWeightsMatchesDirect) {
  std::uint64_t stream = 1;
  for (const Case& c : cases) {
    const ConvolutionGeometry g = geometry_of(c);
    SCOPED_TRACE(g.to_string());
    const std::int64_t input_count = g.batch * g.in_channels * product(g.input_size);
    const std::int64_t output_count = g.batch * g.out_channels * product(g.output_size);
    const std::int64_t weight_count = g.out_channels * g.in_channels * product(g.kernel);
    const auto input = random_values(input_count, stream++);
    const auto grad_output = random_values(output_count, stream++);
    const auto weights = random_values(weight_count, stream++);

    std::vector<std::string> direct_lines;
    const Gradients direct = run(BackwardWeights3d::Direct, g, input, grad_output, weights, true, &direct_lines);
    EXPECT_EQ(weights_line(direct_lines).find("as 2-D"), std::string::npos);
    EXPECT_EQ(weights_line(direct_lines).find("as one 2-D"), std::string::npos);

    for (auto mode : {BackwardWeights3d::PerDepth, BackwardWeights3d::Folded, BackwardWeights3d::Automatic}) {
      for (bool with_input : {false, true}) {
        SCOPED_TRACE(std::string(mode == BackwardWeights3d::PerDepth ? "per kd"
                                 : mode == BackwardWeights3d::Folded ? "folded"
                                                                     : "automatic") +
                     (with_input ? ", with backward data" : ""));
        std::vector<std::string> lines;
        // Twice: the second call reuses the plan built by the first.
        const Gradients decomposed = run(mode, g, input, grad_output, weights, with_input, &lines, 2);
        EXPECT_LT(relative_difference(decomposed.weights, direct.weights), 1e-5);
        expect_bias_gradient(g.bias, decomposed.bias, direct.bias, 1e-5);
        if (with_input) {
          EXPECT_LT(relative_difference(decomposed.input, direct.input), 1e-5);
        }

        const std::string line = weights_line(lines);
        if (mode == BackwardWeights3d::PerDepth) {
          EXPECT_NE(line.find("(3-D backward weights as 2-D per kd"), std::string::npos) << line;
        }
        if (mode == BackwardWeights3d::Folded) {
          EXPECT_NE(line.find("kd folded into channels"), std::string::npos) << line;
        }
        if (mode == BackwardWeights3d::Automatic && host::direct_convolution_applies(g)) {
          // One input channel at stride 1: Tessera's direct kernels, not oneDNN's.
          ASSERT_FALSE(lines.empty());
          EXPECT_NE(lines.front().find("tessera direct"), std::string::npos) << lines.front();
        } else if (mode == BackwardWeights3d::Automatic) {
          // Decomposed only when oneDNN's own choice is not a jit kernel, and then only into jit
          // 2-D kernels (else the direct primitive is kept: e.g. 4 filters have no 2-D jit kernel).
          const std::string own = weights_line(direct_lines);
          const bool slow = own.find("gemm") != std::string::npos || own.find(": ref") != std::string::npos;
          const bool decomposed_here = line.find("3-D backward weights as") != std::string::npos;
          const std::int64_t multiply_adds = output_count * g.in_channels * product(g.kernel);
          if (slow && multiply_adds >= (1 << 20)) {
            EXPECT_TRUE(decomposed_here) << line;
          }
          if (decomposed_here) {
            EXPECT_TRUE(slow) << own;
            EXPECT_NE(line.find(": jit"), std::string::npos) << line;
          } else {
            EXPECT_EQ(line, own);
          }
          std::printf("  %s\n", line.c_str());
          EXPECT_EQ(line.find(": ref"), std::string::npos) << line;
        }
      }
    }
  }
}

TEST(OneDnnConvolution3d, TwoDimensionalIsNeverDecomposed) {
  ConvolutionGeometry g;
  g.batch = 2, g.in_channels = 8, g.out_channels = 8;
  g.input_size = {6, 6}, g.kernel = {3, 3}, g.stride = {1, 1}, g.padding = {1, 1}, g.dilation = {1, 1};
  g.output_size = {6, 6};
  const auto input = random_values(2 * 8 * 36, 1), grad_output = random_values(2 * 8 * 36, 2);
  const auto weights = random_values(8 * 8 * 9, 3);
  std::vector<std::string> lines;
  const Gradients direct = run(BackwardWeights3d::Direct, g, input, grad_output, weights, true);
  const Gradients forced = run(BackwardWeights3d::PerDepth, g, input, grad_output, weights, true, &lines);
  EXPECT_EQ(forced.weights, direct.weights);
  EXPECT_EQ(weights_line(lines).find("as 2-D"), std::string::npos);
}

/// A double-precision loop over every output and tap (2-D geometries as depth 1): the forward
/// (with the fused leaky ReLU where asked), the input's, weights' and bias's gradients.
struct Reference {
  std::vector<float> output, grad_input, grad_weights, grad_bias;
};

Reference reference_convolution(const ConvolutionGeometry& g, const std::vector<float>& input,
                                const std::vector<float>& weights, const std::vector<float>& bias,
                                const std::vector<float>& grad_output) {
  const bool three_d = g.input_size.size() == 3;
  const std::size_t o = three_d ? 0 : 1;  // offset of height in a 3-entry (d, h, w) view
  auto at = [&](const std::vector<std::int64_t>& v, std::int64_t fill, std::size_t i) { return i < o ? fill : v[i - o]; };
  const std::int64_t in[3] = {at(g.input_size, 1, 0), at(g.input_size, 1, 1), at(g.input_size, 1, 2)};
  const std::int64_t out[3] = {at(g.output_size, 1, 0), at(g.output_size, 1, 1), at(g.output_size, 1, 2)};
  const std::int64_t k[3] = {at(g.kernel, 1, 0), at(g.kernel, 1, 1), at(g.kernel, 1, 2)};
  const std::int64_t pad[3] = {at(g.padding, 0, 0), at(g.padding, 0, 1), at(g.padding, 0, 2)};
  const std::int64_t taps = k[0] * k[1] * k[2], volume = out[0] * out[1] * out[2];
  Reference r;
  r.output.assign(static_cast<std::size_t>(g.output_elements()), 0.0f);
  std::vector<double> dw(static_cast<std::size_t>(g.out_channels * g.in_channels * taps), 0.0), db(static_cast<std::size_t>(g.out_channels), 0.0);
  std::vector<double> dx(static_cast<std::size_t>(g.input_elements()), 0.0);
  for (std::int64_t n = 0; n < g.batch; ++n)
    for (std::int64_t f = 0; f < g.out_channels; ++f)
      for (std::int64_t i = 0; i < volume; ++i) {
        const std::int64_t od = i / (out[1] * out[2]), oh = i / out[2] % out[1], ow = i % out[2];
        const std::size_t y = static_cast<std::size_t>((n * g.out_channels + f) * volume + i);
        double sum = g.bias ? bias[static_cast<std::size_t>(f)] : 0.0;
        db[static_cast<std::size_t>(f)] += grad_output[y];
        for (std::int64_t c = 0; c < g.in_channels; ++c)
          for (std::int64_t t = 0; t < taps; ++t) {
            const std::int64_t d = od + t / (k[1] * k[2]) - pad[0], h = oh + t / k[2] % k[1] - pad[1], w = ow + t % k[2] - pad[2];
            if (d < 0 || d >= in[0] || h < 0 || h >= in[1] || w < 0 || w >= in[2]) continue;
            const std::size_t xi = static_cast<std::size_t>((((n * g.in_channels + c) * in[0] + d) * in[1] + h) * in[2] + w);
            const double x = input[xi];
            const std::size_t wi = static_cast<std::size_t>((f * g.in_channels + c) * taps + t);
            sum += x * weights[wi];
            dw[wi] += x * grad_output[y];
            dx[xi] += static_cast<double>(weights[wi]) * grad_output[y];
          }
        const float value = static_cast<float>(sum);
        r.output[y] = g.leaky_relu ? std::max(value, 0.0f) + g.leaky_slope * std::min(value, 0.0f) : value;
      }
  r.grad_input.assign(dx.begin(), dx.end());
  r.grad_weights.assign(dw.begin(), dw.end());
  r.grad_bias.assign(db.begin(), db.end());
  return r;
}

/// Random operands of a convolution and what the double-precision loop computes from them.
struct Problem {
  std::vector<float> input, weights, bias, grad_output;
  Reference expected;
};

Problem random_problem(const ConvolutionGeometry& g, std::uint64_t& stream) {
  Problem p;
  p.input = random_values(g.input_elements(), stream++);
  p.weights = random_values(g.weight_elements(), stream++);
  p.bias = random_values(g.out_channels, stream++);
  p.grad_output = random_values(g.output_elements(), stream++);
  p.expected = reference_convolution(g, p.input, p.weights, p.bias, p.grad_output);
  return p;
}

/// Runs `check(g, problem)` on a random problem of `g` without and with a fused leaky ReLU, each at
/// one thread and two; the backend's threads are restored after.
template <class Check>
void with_activations_and_threads(ConvolutionGeometry g, std::uint64_t& stream, Check&& check) {
  const int threads = backend_threads();
  for (int leaky = 0; leaky < 2; ++leaky) {
    g.leaky_relu = leaky == 1;
    g.leaky_slope = leaky ? 0.01f : 0.0f;
    const Problem p = random_problem(g, stream);
    for (int thread_count : {1, 2}) {
      SCOPED_TRACE(g.to_string() + (leaky ? " leaky" : "") + " threads " + std::to_string(thread_count));
      set_backend_threads(thread_count);
      check(g, p);
    }
  }
  set_backend_threads(threads);
}

TEST(DirectConvolution, OneInputChannelMatchesADoublePrecisionLoop) {
  // 2-D and 3-D; filter counts below, at and past the blocks of 8 and 16; rows shorter than, equal
  // to and past a vector of 16 (and its multiples); padding 0 to 2 with kernels up to 5; one thread
  // and two (the backward's per-thread sums).
  const std::vector<Case> direct_cases = {
      {3, 1, 32, {1, 28, 28}, {1, 3, 3}, {1, 1, 1}, {0, 1, 1}, {1, 1, 1}, true},
      {2, 1, 16, {9, 12, 16}, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, true},
      {1, 1, 13, {5, 7, 35}, {3, 5, 3}, {1, 1, 1}, {2, 2, 2}, {1, 1, 1}, false},
      {2, 1, 1, {4, 4, 5}, {2, 3, 3}, {1, 1, 1}, {0, 0, 0}, {1, 1, 1}, true},
      {1, 1, 24, {3, 6, 33}, {3, 1, 3}, {1, 1, 1}, {1, 0, 1}, {1, 1, 1}, true},
  };
  std::uint64_t stream = 100;
  for (const Case& c : direct_cases) {
    for (bool two_d : {false, true}) {
      if (two_d && c.input[0] != 1) continue;
      ConvolutionGeometry g = geometry_of(c);
      if (two_d) {
        for (auto* v : {&g.input_size, &g.kernel, &g.stride, &g.padding, &g.dilation, &g.output_size}) v->erase(v->begin());
      }
      ASSERT_TRUE(host::direct_convolution_applies(g)) << g.to_string();
      with_activations_and_threads(g, stream, [](const ConvolutionGeometry& v, const Problem& p) {
        const auto& [input, weights, bias, grad_output, expected] = p;
        onednn::Context context;
        auto kernels = onednn::make_convolution_kernels(context, HostConvolutionLayout::Automatic, BackwardWeights3d::Automatic);
        std::vector<float> output(expected.output.size(), 123.0f), grad_weights(expected.grad_weights.size(), 123.0f);
        std::vector<float> grad_bias(expected.grad_bias.size(), 123.0f);
        kernels->forward(v, input.data(), weights.data(), bias.data(), output.data());
        kernels->backward_weights(v, input.data(), grad_output.data(), grad_weights.data(), grad_bias.data());
        EXPECT_LT(relative_difference(output, expected.output), 1e-6);
        EXPECT_LT(relative_difference(grad_weights, expected.grad_weights), 1e-6);
        expect_bias_gradient(v.bias, grad_bias, expected.grad_bias, 1e-6);
        ASSERT_FALSE(context.implementations.empty());
        EXPECT_NE(context.implementations.front().find("tessera direct"), std::string::npos);
      });
    }
  }
}

TEST(WinogradConvolution, MatchesADoublePrecisionLoop) {
  // Channel counts below, at and past a group of 16 output channels; outputs of odd and even
  // extents; rows of 4 tiles (lane by lane), of 8 and 16 (whole segments of 8) and of 19 (a short
  // last segment), partial tiles and a last block of one segment; padding 0 to 2; one thread and
  // two. The kernels are called directly, so that every CPU runs them.
  const std::vector<Case> winograd_cases = {
      {2, 16, 32, {8, 8, 32}, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, true},
      {1, 8, 24, {5, 7, 16}, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, true},
      {3, 12, 8, {4, 9, 5}, {3, 3, 3}, {1, 1, 1}, {0, 1, 2}, {1, 1, 1}, false},
      {1, 17, 9, {6, 5, 37}, {3, 3, 3}, {1, 1, 1}, {2, 0, 1}, {1, 1, 1}, true},
      // No padding and whole tiles (a spatial tile's window): the input is read in place, along
      // rows of segments and lane by lane; with a short last segment it is copied.
      {2, 8, 16, {10, 6, 34}, {3, 3, 3}, {1, 1, 1}, {0, 0, 0}, {1, 1, 1}, true},
      {1, 9, 8, {6, 6, 10}, {3, 3, 3}, {1, 1, 1}, {0, 0, 0}, {1, 1, 1}, false},
      {1, 8, 8, {4, 4, 22}, {3, 3, 3}, {1, 1, 1}, {0, 0, 0}, {1, 1, 1}, true},
  };
  std::uint64_t stream = 300;
  for (const Case& c : winograd_cases) {
    const ConvolutionGeometry g = geometry_of(c);
    ASSERT_TRUE(host::winograd_convolution_applies(g)) << g.to_string();
    with_activations_and_threads(g, stream, [](const ConvolutionGeometry& v, const Problem& p) {
      const auto& [input, weights, bias, grad_output, expected] = p;
      host::WinogradConvolution kernels;
      std::vector<float> output(expected.output.size(), 123.0f), grad_input(expected.grad_input.size(), 123.0f);
      std::vector<float> grad_weights(expected.grad_weights.size(), 123.0f), grad_bias(expected.grad_bias.size(), 123.0f);
      kernels.forward(v, input.data(), weights.data(), bias.data(), output.data());
      kernels.backward_data(v, grad_output.data(), weights.data(), grad_input.data());
      kernels.backward_weights(v, input.data(), grad_output.data(), grad_weights.data(), grad_bias.data());
      // Winograd's transforms add rounding: measured up to 3e-7 of the largest value here, in all
      // three passes (fp32 sums: 1e-7).
      EXPECT_LT(relative_difference(output, expected.output), 2e-6);
      EXPECT_LT(relative_difference(grad_input, expected.grad_input), 2e-6);
      EXPECT_LT(relative_difference(grad_weights, expected.grad_weights), 2e-6);
      expect_bias_gradient(v.bias, grad_bias, expected.grad_bias, 1e-6);
    });
  }
}

/// A convolution whose backward-data computes a data region of its input window: [begin, begin +
/// extent) per spatial dimension (both empty: the whole input).
struct RegionCase {
  Case convolution;
  std::vector<std::int64_t> begin, extent;
};

/// Checks an input gradient computed over `c`'s data region: inside it the double-precision
/// loop's (`expected`), and zeros outside wherever `zero_outside(within_d, within_hw)` says.
template <typename ZeroOutside>
void expect_data_region(const ConvolutionGeometry& g, const RegionCase& c, const std::vector<float>& grad_input,
                        const std::vector<float>& expected, const ZeroOutside& zero_outside) {
  const auto& in = g.input_size;
  const std::vector<std::int64_t> begin = c.begin.empty() ? std::vector<std::int64_t>{0, 0, 0} : c.begin;
  const std::vector<std::int64_t> extent = c.extent.empty() ? in : c.extent;
  std::vector<float> inside, expected_inside;
  std::size_t nonzero_outside = 0;
  for (std::int64_t nc = 0; nc < g.batch * g.in_channels; ++nc)
    for (std::int64_t z = 0; z < in[0]; ++z)
      for (std::int64_t y = 0; y < in[1]; ++y)
        for (std::int64_t x = 0; x < in[2]; ++x) {
          const auto i = static_cast<std::size_t>(((nc * in[0] + z) * in[1] + y) * in[2] + x);
          const bool within_d = z >= begin[0] && z < begin[0] + extent[0];
          const bool within_hw = y >= begin[1] && y < begin[1] + extent[1] && x >= begin[2] && x < begin[2] + extent[2];
          if (within_d && within_hw) {
            inside.push_back(grad_input[i]);
            expected_inside.push_back(expected[i]);
          } else if (grad_input[i] != 0.0f && zero_outside(within_d, within_hw)) {
            ++nonzero_outside;
          }
        }
  EXPECT_LT(relative_difference(inside, expected_inside), 2e-6);
  EXPECT_EQ(nonzero_outside, 0u);
}

/// body(g, p, c) for every case, its geometry naming the data region and its random problem, at
/// 1 and 2 threads.
template <typename Body>
void each_region_case(const std::vector<RegionCase>& region_cases, std::uint64_t stream, const Body& body) {
  const int threads = backend_threads();
  for (const RegionCase& c : region_cases) {
    ConvolutionGeometry g = geometry_of(c.convolution);
    const Problem p = random_problem(g, stream);
    g.data_begin = c.begin;
    g.data_extent = c.extent;
    for (int thread_count : {1, 2}) {
      SCOPED_TRACE(g.to_string() + " threads " + std::to_string(thread_count));
      set_backend_threads(thread_count);
      body(g, p, c);
    }
  }
  set_backend_threads(threads);
}

TEST(WinogradConvolution, BackwardDataComputesTheDataRegionOfAWindow) {
  // A spatial tile's convolution has no padding of its own: its window holds the padding as zeros,
  // and the geometry names the part that holds data. Backward-data computes the input gradient
  // there (rows of segments and lane by lane; a region starting past 2 - padding in one
  // dimension, which the kernels then compute whole) and writes zeros around it.
  const std::vector<RegionCase> region_cases = {
      {{1, 16, 8, {10, 12, 36}, {3, 3, 3}, {1, 1, 1}, {0, 0, 0}, {1, 1, 1}, true}, {1, 1, 1}, {9, 10, 34}},
      {{2, 8, 16, {9, 7, 11}, {3, 3, 3}, {1, 1, 1}, {0, 0, 0}, {1, 1, 1}, false}, {0, 2, 1}, {8, 5, 9}},
      {{1, 12, 9, {8, 6, 20}, {3, 3, 3}, {1, 1, 1}, {0, 0, 0}, {1, 1, 1}, true}, {3, 0, 2}, {5, 6, 17}},
  };
  each_region_case(region_cases, 500, [](const ConvolutionGeometry& g, const Problem& p, const RegionCase& c) {
    ASSERT_TRUE(host::winograd_convolution_applies(g)) << g.to_string();
    host::WinogradConvolution kernels;
    std::vector<float> grad_input(p.expected.grad_input.size(), 123.0f);
    kernels.backward_data(g, p.grad_output.data(), p.weights.data(), grad_input.data());
    // (a region starting past 2 - padding along D: computed whole along D)
    expect_data_region(g, c, grad_input, p.expected.grad_input,
                       [&](bool, bool within_hw) { return !within_hw || c.begin[0] <= 2; });
  });
}

TEST(WinogradConvolution, TheBackendComputesAnOddRegionsEdgePlaneApart) {
  // A tile's data region with an odd number of planes along D, the window's last (the halo after
  // the held planes) or its first (the halo before them), and a whole input of odd depth: the
  // backend computes that plane from 2-D convolutions, the rest by Winograd's tiles. Inside the
  // region the input gradient is the double-precision loop's; the other planes are zeros.
  const std::vector<RegionCase> region_cases = {
      {{1, 16, 8, {12, 12, 16}, {3, 3, 3}, {1, 1, 1}, {0, 0, 0}, {1, 1, 1}, true}, {1, 1, 1}, {11, 10, 14}},
      {{2, 8, 16, {12, 10, 12}, {3, 3, 3}, {1, 1, 1}, {0, 0, 0}, {1, 1, 1}, false}, {0, 1, 1}, {11, 8, 10}},
      {{1, 9, 12, {9, 12, 12}, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, true}, {}, {}},
  };
  each_region_case(region_cases, 700, [](const ConvolutionGeometry& g, const Problem& p, const RegionCase& c) {
    ASSERT_EQ((c.extent.empty() ? g.input_size : c.extent)[0] % 2, 1);
    onednn::Context context;
    auto kernels =
        onednn::make_convolution_kernels(context, HostConvolutionLayout::Automatic, BackwardWeights3d::Automatic);
    std::vector<float> grad_input(p.expected.grad_input.size(), 123.0f);
    kernels->backward_data(g, p.grad_output.data(), p.weights.data(), grad_input.data());
    const char* setting = std::getenv("TESSERA_WINOGRAD");  // 0: turned off
    const bool available = __builtin_cpu_supports("avx512f") && !(setting && std::string(setting) == "0");
    ASSERT_FALSE(context.implementations.empty());
    EXPECT_EQ(context.implementations.front().find("tessera winograd") != std::string::npos, available)
        << context.implementations.front();
    expect_data_region(g, c, grad_input, p.expected.grad_input, [](bool within_d, bool) { return !within_d; });
  });
}

TEST(WinogradConvolution, TheBackendRunsItWhereItAppliesOnAvx512) {
  // On AVX-512: 3^3 tiles of 2 x 2 x 2 outputs are too few; 8^3 take the Winograd forward and
  // backward-data; 16^3 (2 048 or more per thread) its backward-weights too.
  const int threads = backend_threads();
  set_backend_threads(2);
  for (std::int64_t extent : {6, 16, 32}) {
    ConvolutionGeometry g = geometry_of({1, 16, 16, {extent, extent, extent}, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, true});
    onednn::Context context;
    auto kernels = onednn::make_convolution_kernels(context, HostConvolutionLayout::Automatic, BackwardWeights3d::Automatic);
    const auto input = random_values(g.input_elements(), 1), weights = random_values(g.weight_elements(), 2);
    const auto bias = random_values(g.out_channels, 3), grad_output = random_values(g.output_elements(), 4);
    std::vector<float> output(grad_output.size()), grad_input(input.size()), grad_weights(weights.size()), grad_bias(bias.size());
    kernels->forward(g, input.data(), weights.data(), bias.data(), output.data());
    kernels->backward(g, input.data(), grad_output.data(), weights.data(), grad_input.data(), grad_weights.data(),
                      grad_bias.data());
    ASSERT_FALSE(context.implementations.empty());
    const char* setting = std::getenv("TESSERA_WINOGRAD");  // 0: turned off
    const bool available = __builtin_cpu_supports("avx512f") && !(setting && std::string(setting) == "0");
    const bool winograd = context.implementations.front().find("tessera winograd") != std::string::npos;
    EXPECT_EQ(winograd, extent >= 16 && available) << context.implementations.front();
    const std::string weights_by = weights_line(context.implementations);
    EXPECT_EQ(weights_by.find("tessera winograd") != std::string::npos, extent == 32 && available) << weights_by;
  }
  set_backend_threads(threads);
  for (auto change : {0, 1, 2, 3, 4}) {
    ConvolutionGeometry other = geometry_of({1, change == 0 ? 4 : 16, 16, {6, 6, 6}, {3, 3, change == 1 ? 5 : 3},
                                              {1, change == 2 ? 2 : 1, 1}, {1, 1, change == 4 ? 3 : 1}, {change == 3 ? 2 : 1, 1, 1}, true});
    EXPECT_FALSE(host::winograd_convolution_applies(other)) << other.to_string();
  }
}

// Outputs larger than the caches are written in streaming stores (host_stream.hpp): the first
// convolution's forward and max pooling's one-pass backward (rows of 32 or more; rows whose
// length is no multiple of 4 are copied), with and without the leaky ReLUs fused into them, write
// the same values to the bit either way.
TEST(StreamingStores, ChangeNothingButHowTheOutputIsWritten) {
  auto backend = make_host_backend();
  LayerContext ctx;
  ctx.backend = backend.get();
  const auto run = [&](bool stream, const auto& body) {
    host::set_streaming_threshold(stream ? 0 : std::numeric_limits<std::int64_t>::max());
    Tensor result = body();
    host::set_streaming_threshold(-1);
    return result;
  };
  for (const Shape& shape : {Shape::image(2, 1, {6, 4, 64}), Shape::image(3, 1, {8, 64}), Shape::image(1, 1, {4, 6, 30})})
    for (bool leaky : {false, true}) {
      SCOPED_TRACE(shape.to_string() + (leaky ? " leaky" : ""));
      auto conv = make_layer("conv", {{"filters", {"16"}}, {"kernel", {"3"}}, {"padding", {"1"}}});
      const Shape out = conv->setup({shape});
      conv->init_parameters(5);
      const Tensor x = random_tensor(shape, 70);
      const Tensor* in[] = {&x};
      ctx.leaky_relu_after = leaky ? std::optional<float>(0.1f) : std::nullopt;
      const auto forward = [&] {
        Tensor y;
        conv->forward(in, y, ctx);
        return y;
      };
      const Tensor plain = run(false, forward), streamed = run(true, forward);
      ASSERT_EQ(plain.shape().dims(), out.dims());
      EXPECT_EQ(max_relative_difference(plain, streamed, 1.0), 0.0);
      ctx.leaky_relu_after.reset();

      auto pool = make_layer("maxpool", {{"kernel", {"2"}}}, 4);
      const Shape pooled = pool->setup({out});
      const Tensor dz = random_tensor(pooled, 71);
      const Tensor* pool_in[] = {&plain};
      Tensor z;
      pool->forward(pool_in, z, ctx);
      ctx.leaky_relu_before = leaky ? std::optional<float>(0.1f) : std::nullopt;
      const auto backward = [&] {
        Tensor dy;
        Tensor* grads[] = {&dy};
        pool->backward(pool_in, z, dz, grads, ctx);
        return dy;
      };
      const Tensor dy_plain = run(false, backward), dy_streamed = run(true, backward);
      EXPECT_EQ(max_relative_difference(dy_plain, dy_streamed, 1.0), 0.0);
      std::int64_t nonzero = 0;
      for (std::int64_t i = 0; i < dy_plain.numel(); ++i) nonzero += dy_plain.data()[i] != 0.0f;
      EXPECT_EQ(nonzero, dz.numel()) << "one input per window gets its gradient";
      ctx.leaky_relu_before.reset();
    }
}

// A convolution of one input channel computes its weight gradients from the max pooling that
// reads it (through a leaky ReLU or not): the gradient, maxima and output of 2-wide windows at
// their stride, made into its output gradient a row at a time. The same sums to the bit as the
// pooling's backward followed by backward-weights, in 2-D and 3-D, with rows that fill vectors or
// end in part of one, and blocks of 8 filters or fewer; refused where the windows are not pairs
// at their stride or do not tile the output.
TEST(DirectConvolution, WeightGradientsFromThePoolingEqualThoseFromItsBackward) {
  auto backend = make_host_backend();
  LayerContext ctx;
  ctx.backend = backend.get();
  for (const Shape& shape :
       {Shape::image(2, 1, {4, 6, 64}), Shape::image(1, 1, {2, 4, 40}), Shape::image(3, 1, {6, 36})})
    for (const char* filters : {"16", "5"})
      for (bool leaky : {false, true}) {
        SCOPED_TRACE(shape.to_string() + " filters " + filters + (leaky ? " leaky" : ""));
        auto conv = make_layer("conv", {{"filters", {filters}}, {"kernel", {"3"}}, {"padding", {"1"}}});
        const Shape out = conv->setup({shape});
        conv->init_parameters(5);
        ASSERT_TRUE(conv->traits().reads_pooled_gradient);
        const Tensor x = random_tensor(shape, 80);
        const Tensor* in[] = {&x};
        ctx.leaky_relu_after = leaky ? std::optional<float>(0.1f) : std::nullopt;
        Tensor y;
        conv->forward(in, y, ctx);
        ctx.leaky_relu_after.reset();
        auto pool = make_layer("maxpool", {{"kernel", {"2"}}}, 4);
        const Shape pooled_shape = pool->setup({out});
        ASSERT_TRUE(pool->traits().pools_in_pairs);
        const Tensor* pool_in[] = {&y};
        Tensor z;
        pool->forward(pool_in, z, ctx);
        const Tensor dz = random_tensor(pooled_shape, 81);
        const std::optional<float> slope = leaky ? std::optional<float>(0.1f) : std::nullopt;

        ctx.leaky_relu_before = slope;
        Tensor dy;
        Tensor* pool_grads[] = {&dy};
        pool->backward(pool_in, z, dz, pool_grads, ctx);
        ctx.leaky_relu_before.reset();
        Tensor* no_grads[] = {nullptr};
        conv->backward(in, y, dy, no_grads, ctx);
        std::vector<Tensor> dense;
        for (Parameter* p : conv->parameters()) dense.push_back(p->grad.clone());

        const std::optional<PooledGradient> pooled = pool->pooled_gradient(z, dz, slope);
        ASSERT_TRUE(pooled.has_value());
        ASSERT_TRUE(conv->reads_pooled_gradient(in, *pooled, ctx));
        for (Parameter* p : conv->parameters()) p->grad.fill(7.0f);
        ctx.pooled_gradient = &*pooled;
        conv->backward(in, y, Tensor(), no_grads, ctx);
        ctx.pooled_gradient = nullptr;
        for (std::size_t i = 0; i < dense.size(); ++i)
          EXPECT_EQ(max_relative_difference(dense[i], conv->parameters()[i]->grad, 1.0), 0.0) << "parameter " << i;
        EXPECT_GT(max_relative_difference(dense[0], Tensor(dense[0].shape()), 1.0), 0.0)
            << "a zero gradient proves nothing";
      }
  // Windows 3 wide, overlapping ones, pairs that leave the output's last row or column out, and
  // rows of fewer than kPooledRow windows (Fashion-MNIST's 14): refused.
  for (const Shape& shape : {Shape::image(1, 1, {7, 33}), Shape::image(1, 1, {28, 28})}) {
    auto conv = make_layer("conv", {{"filters", {"4"}}, {"kernel", {"3"}}, {"padding", {"1"}}});
    const Shape out = conv->setup({shape});
    conv->init_parameters(5);
    const Tensor x = random_tensor(shape, 82);
    const Tensor* in[] = {&x};
    Tensor y;
    conv->forward(in, y, ctx);
    const Tensor* pool_in[] = {&y};
    for (const OptionList& options : {OptionList{{"kernel", {"3"}}}, OptionList{{"kernel", {"2"}}, {"stride", {"1"}}},
                                      OptionList{{"kernel", {"2"}}}}) {
      auto pool = make_layer("maxpool", options, 4);
      pool->setup({out});
      Tensor z;
      pool->forward(pool_in, z, ctx);
      const std::optional<PooledGradient> pooled = pool->pooled_gradient(z, z, std::nullopt);
      EXPECT_TRUE(!pooled || !conv->reads_pooled_gradient(in, *pooled, ctx)) << pool->traits().pools_in_pairs;
    }
  }
}

// The direct convolution pooling its rows as it makes them (forward_pooled) writes the values and
// places of max pooling's forward over its output to the bit: 2 x 2 x 2 windows, rows of whole and
// part vectors, one group of 16 filters, a part of one, and more; with and without the leaky ReLU.
TEST(DirectConvolution, ForwardPooledEqualsTheConvolutionThenThePooling) {
  auto backend = make_host_backend();
  for (const std::vector<std::int64_t>& input : {std::vector<std::int64_t>{4, 6, 64}, {2, 4, 40}, {6, 4, 36}})
    for (std::int64_t filters : {16, 5, 20})
      for (bool leaky : {false, true}) {
        SCOPED_TRACE(
            fmt::format("input {}x{}x{}, {} filters{}", input[0], input[1], input[2], filters, leaky ? ", leaky" : ""));
        ConvolutionGeometry g = geometry_of({2, 1, filters, input, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, true});
        g.leaky_relu = leaky;
        g.leaky_slope = 0.1f;
        const std::vector<float> x = random_values(g.input_elements(), 90), w = random_values(g.weight_elements(), 91),
                                 b = random_values(filters, 92);
        host::DirectConvolution direct;
        std::vector<float> y(static_cast<std::size_t>(g.output_elements()));
        direct.forward(g, x.data(), w.data(), b.data(), y.data());
        PoolingGeometry pooling;
        pooling.batch = 2;
        pooling.channels = filters;
        pooling.input_size = g.output_size;
        pooling.kernel = pooling.stride = {2, 2, 2};
        pooling.padding = {0, 0, 0};
        pooling.output_size = {g.output_size[0] / 2, g.output_size[1] / 2, g.output_size[2] / 2};
        const std::size_t outputs = static_cast<std::size_t>(2 * filters * pooling.output_size[0] *
                                                             pooling.output_size[1] * pooling.output_size[2]);
        std::vector<float> z(outputs), fused_z(outputs, 7.0f);
        std::vector<std::int32_t> where(outputs), fused_where(outputs, -1);
        ASSERT_EQ(backend->pooling().workspace_bytes(pooling), outputs * sizeof(std::int32_t));
        backend->pooling().forward(pooling, y.data(), z.data(), where.data());
        ASSERT_TRUE(host::pooled_gradient_applies(g.without_activation(), pooling));
        host::DirectConvolution fused;
        fused.forward_pooled(g, x.data(), w.data(), b.data(),
                             PooledOutput{&pooling, fused_z.data(), fused_where.data()});
        EXPECT_EQ(std::memcmp(z.data(), fused_z.data(), outputs * sizeof(float)), 0);
        EXPECT_EQ(where, fused_where);
      }
}

// CosmoFlow 128^3's conv1 + act1 + pool1 forward, one sample, 1 thread: the convolution's forward
// and the pooling's, against forward_pooled (`--gtest_also_run_disabled_tests`).
TEST(DirectConvolution, DISABLED_BenchmarkForwardPooled) {
  set_backend_threads(1);
  auto backend = make_host_backend();
  ConvolutionGeometry g = geometry_of({1, 1, 16, {128, 128, 128}, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, true});
  g.leaky_relu = true;
  g.leaky_slope = 0.01f;
  const std::vector<float> x = random_values(g.input_elements(), 90), w = random_values(g.weight_elements(), 91),
                           b = random_values(16, 92);
  PoolingGeometry pooling;
  pooling.batch = 1;
  pooling.channels = 16;
  pooling.input_size = g.output_size;
  pooling.kernel = pooling.stride = {2, 2, 2};
  pooling.padding = {0, 0, 0};
  pooling.output_size = {64, 64, 64};
  std::vector<float> y(static_cast<std::size_t>(g.output_elements())), z(16 << 18);
  std::vector<std::int32_t> where(16 << 18);
  host::DirectConvolution direct;
  const auto time = [](const auto& body) {
    std::vector<double> times;
    for (int r = 0; r < 5; ++r) {
      const auto start = std::chrono::steady_clock::now();
      body();
      times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
    }
    std::sort(times.begin(), times.end());
    return times[2];
  };
  const double conv = time([&] { direct.forward(g, x.data(), w.data(), b.data(), y.data()); });
  const double pool = time([&] { backend->pooling().forward(pooling, y.data(), z.data(), where.data()); });
  const double fused = time([&] {
    direct.forward_pooled(g, x.data(), w.data(), b.data(), PooledOutput{&pooling, z.data(), where.data()});
  });
  std::printf("conv1 forward %.2f ms + pool1 forward %.2f ms = %.2f ms; forward_pooled %.2f ms\n", conv, pool,
              conv + pool, fused);
}

// The ranks on a node share its last-level cache: each rank's outputs stream from half of its
// share, so that more ranks stream smaller outputs.
TEST(StreamingStores, StartAtHalfOfTheRanksShareOfTheCache) {
  set_ranks_on_node(1);
  const std::int64_t alone = host::streaming_threshold();
  EXPECT_GE(alone, std::int64_t{64} << 10) << "half of a last-level cache";
  EXPECT_FALSE(host::streams_output(alone));
  EXPECT_TRUE(host::streams_output(alone + 1));
  // As many ranks as CPUs share the caches of every CPU: at least half as much each where two
  // share a cache (the whole machine's ranks spread over its caches).
  const int cpus = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  set_ranks_on_node(64 * cpus);
  const std::int64_t crowded = host::streaming_threshold();
  EXPECT_LE(crowded, alone / 64);
  EXPECT_TRUE(host::streams_output(crowded + 1));
  set_ranks_on_node(1);
  EXPECT_FALSE(host::streams_output(crowded + 1));
  EXPECT_EQ(host::streaming_threshold(), alone);
}

TEST(DirectConvolution, AppliesToOneInputChannelAtStrideAndDilationOne) {
  ConvolutionGeometry g = geometry_of({1, 1, 8, {6, 6, 6}, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, true});
  EXPECT_TRUE(host::direct_convolution_applies(g));
  for (auto change : {0, 1, 2, 3, 4}) {
    ConvolutionGeometry other = geometry_of({1, change == 0 ? 2 : 1, 8, {6, 6, 6}, {3, 3, change == 1 ? 5 : 3},
                                              {1, change == 2 ? 2 : 1, 1}, {1, 1, 1}, {change == 3 ? 2 : 1, 1, 1}, true});
    if (change == 4) other.kernel[0] = 9, other.padding[0] = 4, other.output_size[0] = 6;
    EXPECT_FALSE(host::direct_convolution_applies(other)) << other.to_string();
  }
}

/// Not a check: times backward-weights for CosmoFlow's five convolutions (batch 4, one thread as
/// bench_train runs), oneDNN's own 3-D primitive against the automatic choice, interleaved, and
/// prints the fastest of several runs. Run with --gtest_also_run_disabled_tests.
TEST(OneDnnConvolution3d, DISABLED_BenchmarkCosmoFlowBackwardWeights) {
  const int threads = backend_threads();
  set_backend_threads(1);
  const std::int64_t sizes[] = {64, 32, 16, 8, 4}, in[] = {1, 16, 32, 64, 64}, out[] = {16, 32, 64, 64, 64};
  for (int layer = 0; layer < 5; ++layer) {
    const std::int64_t s = sizes[layer];
    const ConvolutionGeometry g =
        geometry_of({4, in[layer], out[layer], {s, s, s}, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, true});
    const auto input = random_values(g.batch * g.in_channels * s * s * s, 1);
    const auto grad_output = random_values(g.batch * g.out_channels * s * s * s, 2);
    std::vector<float> grad_weights(static_cast<std::size_t>(g.out_channels * g.in_channels * 27)), grad_bias(64);
    onednn::Context direct_context, automatic_context;
    auto direct = onednn::make_convolution_kernels(direct_context, HostConvolutionLayout::Automatic, BackwardWeights3d::Direct);
    auto automatic =
        onednn::make_convolution_kernels(automatic_context, HostConvolutionLayout::Automatic, BackwardWeights3d::Automatic);
    double best[2] = {1e30, 1e30};
    for (int repeat = 0; repeat < 6; ++repeat) {
      int which = 0;
      for (auto* kernels : {direct.get(), automatic.get()}) {
        const double ms = time_ms(
            [&] { kernels->backward_weights(g, input.data(), grad_output.data(), grad_weights.data(), grad_bias.data()); });
        if (repeat > 0) best[which] = std::min(best[which], ms);
        ++which;
      }
    }
    std::printf("conv%d C=%lld F=%lld %lld^3: direct %.1f ms, automatic %.1f ms\n  %s\n", layer + 1,
                static_cast<long long>(g.in_channels), static_cast<long long>(g.out_channels), static_cast<long long>(s),
                best[0], best[1], weights_line(automatic_context.implementations).c_str());
  }
  set_backend_threads(threads);
}

/// Not a check: times the three passes of CosmoFlow's convolutions 2-5 (batch 2, one
/// thread, as bench_train runs at 2 ranks), oneDNN's blocked kernels (with their reorders) against
/// the Winograd kernels, interleaved; prints the fastest of several runs. Run with
/// --gtest_also_run_disabled_tests.
TEST(WinogradConvolution, DISABLED_BenchmarkCosmoFlow) {
  const int threads = backend_threads();
  set_backend_threads(1);
  const std::int64_t sizes[] = {32, 16, 8, 4}, in[] = {16, 32, 64, 64}, out[] = {32, 64, 64, 64};
  for (int layer = 0; layer < 4; ++layer) {
    const std::int64_t s = sizes[layer];
    const ConvolutionGeometry g =
        geometry_of({2, in[layer], out[layer], {s, s, s}, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, true});
    const auto input = random_values(g.input_elements(), 1), grad_output = random_values(g.output_elements(), 2);
    const auto weights = random_values(g.weight_elements(), 3), bias = random_values(g.out_channels, 4);
    std::vector<float> output(grad_output.size()), grad_input(input.size());
    onednn::Context context;
    auto blocked = onednn::make_convolution_kernels(context, HostConvolutionLayout::Blocked, BackwardWeights3d::Automatic);
    host::WinogradConvolution winograd;
    std::vector<float> grad_weights(static_cast<std::size_t>(g.weight_elements())), grad_bias(64);
    double best[6] = {1e30, 1e30, 1e30, 1e30, 1e30, 1e30};
    for (int repeat = 0; repeat < 6; ++repeat) {
      const double ms[6] = {
          time_ms([&] { blocked->forward(g, input.data(), weights.data(), bias.data(), output.data()); }),
          time_ms([&] { winograd.forward(g, input.data(), weights.data(), bias.data(), output.data()); }),
          time_ms([&] { blocked->backward_data(g, grad_output.data(), weights.data(), grad_input.data()); }),
          time_ms([&] { winograd.backward_data(g, grad_output.data(), weights.data(), grad_input.data()); }),
          time_ms([&] { blocked->backward_weights(g, input.data(), grad_output.data(), grad_weights.data(), grad_bias.data()); }),
          time_ms([&] { winograd.backward_weights(g, input.data(), grad_output.data(), grad_weights.data(), grad_bias.data()); })};
      for (int i = 0; i < 6 && repeat > 0; ++i) best[i] = std::min(best[i], ms[i]);
    }
    std::printf("conv%d C=%lld F=%lld %lld^3, ms oneDNN / Winograd: forward %.2f / %.2f, backward-data %.2f / %.2f, "
                "backward-weights %.2f / %.2f\n",
                layer + 2, static_cast<long long>(g.in_channels), static_cast<long long>(g.out_channels),
                static_cast<long long>(s), best[0], best[1], best[2], best[3], best[4], best[5]);
  }
  set_backend_threads(threads);
}

/// Not a check: times the Winograd kernels on rank 0's tile of CosmoFlow 128^3's conv2-conv4
/// split along D over 2 ranks (one thread): the whole sample's half (padding 1), the tile's window
/// (padding held as zeros, no data region named) and the same window naming its data region, as
/// the layer does. Run with --gtest_also_run_disabled_tests.
// A 2-rank tile's backward-data (its data region: the held planes and one halo plane) through
// the backend, which computes the halo plane apart, against Winograd's kernels computing a whole
// tile for it, and against the held planes alone.
TEST(WinogradConvolution, DISABLED_BenchmarkTheHaloPlaneApart) {
  const int threads = backend_threads();
  set_backend_threads(1);
  const std::int64_t sizes[] = {64, 32, 16, 8}, in[] = {16, 32, 64, 64}, out[] = {32, 64, 64, 64};
  for (int layer = 0; layer < 4; ++layer) {
    const std::int64_t s = sizes[layer];
    ConvolutionGeometry region =
        geometry_of({1, in[layer], out[layer], {s / 2 + 2, s + 2, s + 2}, {3, 3, 3}, {1, 1, 1}, {0, 0, 0}, {1, 1, 1}, true});
    region.data_begin = {1, 1, 1};
    region.data_extent = {s / 2 + 1, s, s};
    ConvolutionGeometry held = region;
    held.data_extent[0] = s / 2;
    const auto grad_output = random_values(region.output_elements(), 2), weights = random_values(region.weight_elements(), 3);
    std::vector<float> grad_input(static_cast<std::size_t>(region.input_elements()));
    onednn::Context context;
    auto kernels = onednn::make_convolution_kernels(context, HostConvolutionLayout::Automatic, BackwardWeights3d::Automatic);
    host::WinogradConvolution winograd;
    double best[3] = {1e30, 1e30, 1e30};
    for (int repeat = 0; repeat < 8; ++repeat) {
      best[0] = std::min(best[0], time_ms([&] { kernels->backward_data(region, grad_output.data(), weights.data(), grad_input.data()); }));
      best[1] = std::min(best[1], time_ms([&] { winograd.backward_data(region, grad_output.data(), weights.data(), grad_input.data()); }));
      best[2] = std::min(best[2], time_ms([&] { winograd.backward_data(held, grad_output.data(), weights.data(), grad_input.data()); }));
    }
    std::printf("conv%d tile %lld+1 x %lld^2, backward-data ms: the backend %.2f, Winograd's whole tiles %.2f, the held "
                "planes alone %.2f\n", layer + 2, static_cast<long long>(s / 2), static_cast<long long>(s), best[0],
                best[1], best[2]);
  }
  set_backend_threads(threads);
}

TEST(WinogradConvolution, DISABLED_BenchmarkTileOfCosmoFlow128) {
  const int threads = backend_threads();
  set_backend_threads(1);
  const std::int64_t sizes[] = {64, 32, 16}, in[] = {16, 32, 64}, out[] = {32, 64, 64};
  for (int layer = 0; layer < 3; ++layer) {
    const std::int64_t s = sizes[layer];
    const ConvolutionGeometry half =
        geometry_of({1, in[layer], out[layer], {s / 2, s, s}, {3, 3, 3}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, true});
    const ConvolutionGeometry window =
        geometry_of({1, in[layer], out[layer], {s / 2 + 2, s + 2, s + 2}, {3, 3, 3}, {1, 1, 1}, {0, 0, 0}, {1, 1, 1}, true});
    ConvolutionGeometry region = window;
    region.data_begin = {1, 1, 1};
    region.data_extent = {s / 2 + 1, s, s};
    double best[3][3];
    for (auto& b : best) std::fill(std::begin(b), std::end(b), 1e30);
    const ConvolutionGeometry* geometries[] = {&half, &window, &region};
    for (int repeat = 0; repeat < 6; ++repeat)
      for (int k = 0; k < 3; ++k) {
        const ConvolutionGeometry& g = *geometries[k];
        const auto input = random_values(g.input_elements(), 1), grad_output = random_values(g.output_elements(), 2);
        const auto weights = random_values(g.weight_elements(), 3), bias = random_values(g.out_channels, 4);
        std::vector<float> output(grad_output.size()), grad_input(input.size());
        std::vector<float> grad_weights(static_cast<std::size_t>(g.weight_elements())), grad_bias(g.out_channels);
        host::WinogradConvolution winograd;
        winograd.backward_data(g, grad_output.data(), weights.data(), grad_input.data());  // buffers allocated
        const double ms[3] = {
            time_ms([&] { winograd.forward(g, input.data(), weights.data(), bias.data(), output.data()); }),
            time_ms([&] { winograd.backward_data(g, grad_output.data(), weights.data(), grad_input.data()); }),
            time_ms([&] { winograd.backward_weights(g, input.data(), grad_output.data(), grad_weights.data(), grad_bias.data()); })};
        for (int i = 0; i < 3; ++i) best[k][i] = std::min(best[k][i], ms[i]);
      }
    std::printf("conv%d C=%lld F=%lld tile %lld x %lld^2, ms (half sample / window / data region): forward %.2f / %.2f / "
                "%.2f, backward-data %.2f / %.2f / %.2f, backward-weights %.2f / %.2f / %.2f\n",
                layer + 2, static_cast<long long>(in[layer]), static_cast<long long>(out[layer]),
                static_cast<long long>(s / 2), static_cast<long long>(s), best[0][0], best[1][0], best[2][0], best[0][1],
                best[1][1], best[2][1], best[0][2], best[1][2], best[2][2]);
  }
  set_backend_threads(threads);
}

}  // namespace
}  // namespace tessera::testing
