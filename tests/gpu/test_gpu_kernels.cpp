// The CUDA backend against the host backend: every kernel family (convolution forward and both
// backward passes, 2-D and 3-D, strides, padding, dilation, with and without bias; max and
// average pooling, overlapping windows and spatial tiles; linear layers) and Tessera's own
// element-wise kernels give the host's results within 1e-5 (fp32), plus the device memory the
// layers stand on (caching allocator, host <-> device copies). bf16 convolutions: Native (cuDNN's
// bf16 configuration) gives the host's results rounded to bf16, Exact the host's results.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>

#include "layers/bf16_bits.hpp"
#include "layers/cuda_kernels.hpp"
#include "layers/pool_box.hpp"
#include "gpu/gpu_test_util.hpp"
#include "layers/layer_test_utils.hpp"
#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/layers/dnn_backend.hpp"
#include "tessera/tensor/box_ops.hpp"
#include "tessera/tensor/tensor.hpp"

namespace tessera {
namespace {

constexpr double kTolerance = 1e-5;
const Device kGpu = Device::cuda(0);

Tensor random_tensor(std::int64_t count, unsigned seed) { return testing::random_tensor(Shape({count}), seed); }

class GpuKernels : public ::testing::Test {
 protected:
  std::unique_ptr<DnnBackend> host = make_host_backend();
  std::unique_ptr<DnnBackend> gpu = make_cuda_backend();
};

ConvolutionGeometry convolution(std::int64_t n, std::int64_t c, std::int64_t f, std::vector<std::int64_t> size,
                                std::int64_t kernel, std::int64_t stride, std::int64_t padding, std::int64_t dilation,
                                bool bias) {
  ConvolutionGeometry g;
  g.batch = n;
  g.in_channels = c;
  g.out_channels = f;
  g.input_size = size;
  g.bias = bias;
  for (auto extent : size) {
    g.kernel.push_back(kernel);
    g.stride.push_back(stride);
    g.padding.push_back(padding);
    g.dilation.push_back(dilation);
    g.output_size.push_back((extent + 2 * padding - dilation * (kernel - 1) - 1) / stride + 1);
  }
  return g;
}

/// A convolution's random operands, the host backend's results on them (forward, then both
/// backward passes), the operands copied to the GPU and buffers there for the GPU's results.
struct ConvolutionRun {
  ConvolutionRun(DnnBackend& host, const ConvolutionGeometry& g, unsigned& seed)
      : x(random_tensor(g.input_elements(), seed++)),
        weights(random_tensor(g.weight_elements(), seed++)),
        bias(random_tensor(g.out_channels, seed++)),
        dy(random_tensor(g.output_elements(), seed++)),
        y(Shape({g.output_elements()})),
        dx(Shape({g.input_elements()})),
        dw(Shape({g.weight_elements()})),
        db(Shape({g.out_channels})),
        gx(x.to(kGpu)),
        gweights(weights.to(kGpu)),
        gbias(bias.to(kGpu)),
        gdy(dy.to(kGpu)),
        gy(y.shape(), kGpu),
        gdx(dx.shape(), kGpu),
        gdw(dw.shape(), kGpu),
        gdb(db.shape(), kGpu) {
    host.convolution().forward(g, x.data(), weights.data(), bias.data(), y.data());
    host.convolution().backward(g, x.data(), dy.data(), weights.data(), dx.data(), dw.data(), db.data());
  }
  /// The same on the GPU, into gy, gdx, gdw, gdb.
  void on(DnnBackend& gpu, const ConvolutionGeometry& g) {
    gpu.convolution().forward(g, gx.data(), gweights.data(), gbias.data(), gy.data());
    gpu.convolution().backward(g, gx.data(), gdy.data(), gweights.data(), gdx.data(), gdw.data(), gdb.data());
  }

  Tensor x, weights, bias, dy, y, dx, dw, db;
  Tensor gx, gweights, gbias, gdy, gy, gdx, gdw, gdb;
};

TEST_F(GpuKernels, ConvolutionMatchesHost) {
  const std::vector<ConvolutionGeometry> geometries = {
      convolution(2, 3, 8, {17, 13}, 3, 1, 1, 1, true),
      convolution(3, 4, 5, {20, 19}, 5, 2, 0, 2, true),
      convolution(2, 16, 8, {9, 9}, 1, 1, 0, 1, false),
      convolution(2, 2, 6, {11, 10, 9}, 3, 1, 1, 1, true),
      convolution(1, 4, 8, {12, 12, 12}, 3, 2, 1, 1, true),
      convolution(2, 3, 4, {13, 11, 12}, 3, 1, 2, 2, false),
  };
  unsigned seed = 1;
  for (const auto& g : geometries) {
    SCOPED_TRACE(g.to_string());
    ConvolutionRun r(*host, g, seed);
    for (int repeat = 0; repeat < 2; ++repeat) {  // the first call also searches the algorithms
      r.on(*gpu, g);
      EXPECT_LT(gpu_difference(r.y, r.gy), kTolerance) << "forward, call " << repeat;
      EXPECT_LT(gpu_difference(r.dx, r.gdx), kTolerance) << "backward data, call " << repeat;
      EXPECT_LT(gpu_difference(r.dw, r.gdw), kTolerance) << "backward weights, call " << repeat;
      if (g.bias) {
        EXPECT_LT(gpu_difference(r.db, r.gdb), kTolerance) << "bias gradient, call " << repeat;
      }
    }
  }
  // Strict fp32 by default: no algorithm may run on TF32 tensor-op math.
  for (const auto& line : gpu->implementations()) EXPECT_EQ(line.find("tensor-op"), std::string::npos) << line;
}

/// The fp32 value of the bf16 nearest to v (the host's rounding).
float bf16_of(float v) {
  std::uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits = bf16_round_bits(bits);
  std::memcpy(&v, &bits, 4);
  return v;
}

/// Bf16Convolutions::Native against the host's bf16 operands: cuDNN's bf16 configuration sums the
/// same bf16 products in fp32 (in another order) and rounds the sum to bf16 once, so every result
/// is the host's fp32 result rounded to bf16, but where the two sums straddle a rounding boundary
/// (then one bf16 step apart). Most elements must equal round(host) exactly: results left in fp32
/// (the Exact path run by mistake) would not.
void expect_bf16_of(const Tensor& host_result, const Tensor& gpu_result, const char* what) {
  const Tensor got = gpu_result.to(Device::host());
  float largest = 0.0f;
  for (std::int64_t i = 0; i < host_result.numel(); ++i) largest = std::max(largest, std::fabs(host_result.data()[i]));
  std::int64_t same = 0, beyond = 0;
  for (std::int64_t i = 0; i < host_result.numel(); ++i) {
    const float want = bf16_of(host_result.data()[i]), have = got.data()[i];
    if (have == want) ++same;
    // One bf16 step is at most 2^-7 of the value.
    if (!(std::fabs(have - want) <= std::ldexp(std::fabs(want), -7) + 1e-5f * largest)) ++beyond;
  }
  EXPECT_EQ(beyond, 0) << what << ": results more than one bf16 step from the host's rounded";
  EXPECT_GE(static_cast<double>(same), 0.9 * static_cast<double>(host_result.numel()))
      << what << ": results are not the host's rounded to bf16";
}

TEST(GpuBf16Convolutions, NativeResultsAreTheHostsRoundedToBf16) {
  auto host = make_host_backend();
  auto gpu = make_cuda_backend();  // Bf16Convolutions::Native, the default
  const std::vector<ConvolutionGeometry> geometries = {
      convolution(2, 4, 16, {10, 9, 8}, 3, 1, 1, 1, false),  // CosmoFlow's kind
      convolution(1, 3, 8, {12, 11, 10}, 3, 2, 1, 1, false),
      convolution(2, 8, 16, {12, 11}, 3, 1, 1, 1, false),
      convolution(2, 8, 16, {12, 11}, 3, 1, 1, 1, true),
  };
  unsigned seed = 40;
  for (ConvolutionGeometry g : geometries) {
    g.precision = Precision::BF16;
    SCOPED_TRACE(g.to_string());
    ConvolutionRun r(*host, g, seed);
    const Tensor &y = r.y, &dx = r.dx, &dw = r.dw, &db = r.db, &gx = r.gx, &gweights = r.gweights, &gdy = r.gdy;
    const Tensor &gy = r.gy, &gdx = r.gdx, &gdw = r.gdw, &gdb = r.gdb;
    const std::int64_t in = g.input_elements(), w = g.weight_elements();
    for (int repeat = 0; repeat < 2; ++repeat) {
      SCOPED_TRACE(repeat == 0 ? "first call (algorithm search)" : "second call");
      r.on(*gpu, g);
      if (g.bias) {
        // The bias is added in fp32 after the rounding: within a bf16 step of the largest value.
        EXPECT_LT(gpu_difference(y, gy), std::ldexp(1.0, -7)) << "forward";
        // The bias gradient sums the rounded output gradient, as the host does (in another order).
        EXPECT_LT(gpu_difference(db, gdb), 1e-5) << "bias gradient";
      } else {
        expect_bf16_of(y, gy, "forward");
      }
      expect_bf16_of(dx, gdx, "backward data");
      expect_bf16_of(dw, gdw, "backward weights");
    }
    // Called one direction at a time too (the output gradient rounded by each), and without an
    // input gradient (a model's first layer).
    Tensor gdx1(Shape({in}), kGpu), gdw1(Shape({w}), kGpu), gdb1(Shape({g.out_channels}), kGpu);
    gpu->convolution().backward_data(g, gdy.data(), gweights.data(), gdx1.data());
    gpu->convolution().backward_weights(g, gx.data(), gdy.data(), gdw1.data(), gdb1.data());
    expect_bf16_of(dx, gdx1, "backward data alone");
    expect_bf16_of(dw, gdw1, "backward weights alone");
    Tensor gdw2(Shape({w}), kGpu), gdb2(Shape({g.out_channels}), kGpu);
    gpu->convolution().backward(g, gx.data(), gdy.data(), gweights.data(), nullptr, gdw2.data(), gdb2.data());
    expect_bf16_of(dw, gdw2, "backward weights without an input gradient");
    if (g.bias) {
      EXPECT_LT(gpu_difference(db, gdb1), 1e-5);
      EXPECT_LT(gpu_difference(db, gdb2), 1e-5);
    }
  }
  // Every direction ran on bf16 tensors (none fell back to the exact path).
  int on_bf16 = 0;
  for (const auto& line : gpu->implementations()) {
    EXPECT_EQ(line.find("no usable"), std::string::npos) << line;
    if (line.find("on bf16 tensors: cuDNN algorithm") != std::string::npos) ++on_bf16;
  }
  EXPECT_EQ(on_bf16, 3 * static_cast<int>(geometries.size()));
  // The three bf16 buffers are the kernels' scratch, and go when released.
  std::int64_t inputs = 0, outputs = 0, weights = 0;
  for (const auto& g : geometries) {
    inputs = std::max(inputs, g.input_elements());
    outputs = std::max(outputs, g.output_elements());
    weights = std::max(weights, g.weight_elements());
  }
  EXPECT_EQ(gpu->convolution().scratch_bytes(),
            static_cast<std::int64_t>(sizeof(std::uint16_t)) * (inputs + outputs + weights));
  gpu->convolution().release_scratch();
  EXPECT_EQ(gpu->convolution().scratch_bytes(), 0);
}

TEST(GpuBf16Convolutions, ExactResultsAreTheHosts) {
  auto host = make_host_backend();
  CudaBackendOptions options;
  options.bf16_convolutions = Bf16Convolutions::Exact;
  auto gpu = make_cuda_backend(options);
  ConvolutionGeometry g = convolution(2, 4, 16, {10, 9, 8}, 3, 1, 1, 1, true);
  g.precision = Precision::BF16;
  unsigned seed = 60;
  ConvolutionRun r(*host, g, seed);
  r.on(*gpu, g);
  // The same bf16 products summed in fp32 on both sides: fp32's agreement, not bf16's.
  EXPECT_LT(gpu_difference(r.y, r.gy), 1e-4);
  EXPECT_LT(gpu_difference(r.dx, r.gdx), 1e-4);
  EXPECT_LT(gpu_difference(r.dw, r.gdw), 1e-4);
  EXPECT_LT(gpu_difference(r.db, r.gdb), 1e-4);
  for (const auto& line : gpu->implementations()) EXPECT_EQ(line.find("on bf16 tensors"), std::string::npos) << line;
}

PoolingGeometry pooling(PoolingMode mode, std::int64_t n, std::int64_t c, std::vector<std::int64_t> size,
                        std::int64_t kernel, std::int64_t stride, std::int64_t padding) {
  PoolingGeometry g;
  g.mode = mode;
  g.batch = n;
  g.channels = c;
  g.input_size = size;
  for (auto extent : size) {
    g.kernel.push_back(kernel);
    g.stride.push_back(stride);
    g.padding.push_back(padding);
    g.output_size.push_back((extent + 2 * padding - kernel) / stride + 1);
  }
  return g;
}

/// A spatial tile of a 3-D pooling (kernel 3, stride 1, padding 1) of a 16-row H split in two:
/// the first tile holds global input rows [3, 13) (its rows [4, 12) and a halo row on each side)
/// and computes global outputs [4, 12); the edge tile holds rows [7, 16) (halo row 7, no row past
/// the global end) and computes outputs [8, 16), whose last windows are clipped to the input.
PoolingGeometry tile(PoolingMode mode, bool edge) {
  PoolingGeometry g = pooling(mode, 2, 3, {8, edge ? 9 : 10, 8}, 3, 1, 1);
  g.global_input_size = {8, 16, 8};
  g.input_origin = {0, edge ? 7 : 3, 0};
  g.output_origin = {0, edge ? 8 : 4, 0};
  g.output_size = {8, 8, 8};
  return g;
}

TEST_F(GpuKernels, PoolingMatchesHost) {
  const std::vector<PoolingGeometry> geometries = {
      pooling(PoolingMode::Max, 2, 3, {16, 12}, 2, 2, 0),
      pooling(PoolingMode::Max, 2, 4, {9, 10, 11}, 3, 2, 1),
      pooling(PoolingMode::Max, 1, 8, {16, 16, 16}, 2, 2, 0),
      pooling(PoolingMode::AverageExcludePadding, 2, 3, {9, 10, 11}, 3, 1, 1),
      pooling(PoolingMode::AverageExcludePadding, 3, 2, {15, 14}, 3, 2, 1),
      tile(PoolingMode::AverageExcludePadding, false),
      tile(PoolingMode::AverageExcludePadding, true),
      tile(PoolingMode::Max, false),
      tile(PoolingMode::Max, true),
  };
  unsigned seed = 100;
  for (const auto& g : geometries) {
    SCOPED_TRACE(g.to_string());
    const PoolBox box = pool_box(g);
    const std::int64_t in = box.planes * box.in_plane(), out = box.planes * box.out_plane();
    const Tensor x = random_tensor(in, seed++), dy = random_tensor(out, seed++);
    const std::size_t workspace_bytes = host->pooling().workspace_bytes(g);
    ASSERT_EQ(workspace_bytes, gpu->pooling().workspace_bytes(g));
    const auto workspace_floats = static_cast<std::int64_t>((workspace_bytes + 3) / 4);
    Tensor y(Shape({out})), dx(Shape({in})), workspace(Shape({std::max<std::int64_t>(workspace_floats, 1)}));
    host->pooling().forward(g, x.data(), y.data(), workspace.data());
    host->pooling().backward(g, dy.data(), workspace.data(), dx.data());

    const Tensor gx = x.to(kGpu), gdy = dy.to(kGpu);
    Tensor gy(Shape({out}), kGpu), gdx(Shape({in}), kGpu), gworkspace(workspace.shape(), kGpu);
    gdx.fill(7.0f);  // backward must overwrite, not accumulate
    gpu->pooling().forward(g, gx.data(), gy.data(), gworkspace.data());
    gpu->pooling().backward(g, gdy.data(), gworkspace.data(), gdx.data());
    EXPECT_LT(gpu_difference(y, gy), kTolerance) << "forward";
    EXPECT_LT(gpu_difference(dx, gdx), kTolerance) << "backward";
  }
}

TEST_F(GpuKernels, LinearMatchesHost) {
  for (bool bias : {true, false}) {
    const LinearGeometry g{7, 33, 17, bias};
    SCOPED_TRACE(g.to_string());
    const Tensor x = random_tensor(7 * 33, 1), weights = random_tensor(17 * 33, 2), b = random_tensor(17, 3);
    const Tensor dy = random_tensor(7 * 17, 4);
    Tensor y(Shape({7 * 17})), dx(Shape({7 * 33})), dw(Shape({17 * 33})), db(Shape({17}));
    host->linear().forward(g, x.data(), weights.data(), b.data(), y.data());
    host->linear().backward_data(g, dy.data(), weights.data(), dx.data());
    host->linear().backward_weights(g, x.data(), dy.data(), dw.data(), db.data());

    const Tensor gx = x.to(kGpu), gweights = weights.to(kGpu), gb = b.to(kGpu), gdy = dy.to(kGpu);
    Tensor gy(y.shape(), kGpu), gdx(dx.shape(), kGpu), gdw(dw.shape(), kGpu), gdb(db.shape(), kGpu);
    gpu->linear().forward(g, gx.data(), gweights.data(), gb.data(), gy.data());
    gpu->linear().backward_data(g, gdy.data(), gweights.data(), gdx.data());
    gpu->linear().backward_weights(g, gx.data(), gdy.data(), gdw.data(), gdb.data());
    EXPECT_LT(gpu_difference(y, gy), kTolerance);
    EXPECT_LT(gpu_difference(dx, gdx), kTolerance);
    EXPECT_LT(gpu_difference(dw, gdw), kTolerance);
    if (bias) {
      EXPECT_LT(gpu_difference(db, gdb), kTolerance);
    }
  }
}

TEST(GpuElementwise, LeakyReluLossAndUpdateMatchHost) {
  const std::int64_t n = 100003;  // not a multiple of the block size
  const Tensor x = random_tensor(n, 11), dy = random_tensor(n, 12), target = random_tensor(n, 13);
  const float slope = 0.3f, rate = 0.05f;
  Tensor y(Shape({n})), dx(Shape({n})), grad(Shape({n})), updated = x.clone();
  double loss = 0.0;
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = x.data()[i];
    y.data()[i] = std::max(v, 0.0f) + slope * std::min(v, 0.0f);
    dx.data()[i] = dy.data()[i] * (v > 0 ? 1.0f : slope);
    const double d = static_cast<double>(v) - target.data()[i];
    loss += d * d;
    grad.data()[i] = static_cast<float>(2.0 * d / static_cast<double>(n));
    updated.data()[i] = v - rate * dy.data()[i];
  }
  loss /= static_cast<double>(n);

  const Tensor gx = x.to(kGpu), gdy = dy.to(kGpu), gtarget = target.to(kGpu);
  Tensor gy(Shape({n}), kGpu), gdx(Shape({n}), kGpu), ggrad(Shape({n}), kGpu);
  Tensor gupdated = gx.clone();
  cuda_kernels::leaky_relu_forward(gx.data(), gy.data(), n, slope);
  cuda_kernels::leaky_relu_backward(gx.data(), gdy.data(), gdx.data(), n, slope);
  const auto backend = make_cuda_backend();  // the loss through the backend's interface
  const double gloss = backend->elementwise().squared_error(gx.data(), gtarget.data(), n,
                                                            1.0 / static_cast<double>(n), 1.0, ggrad.data());
  SgdStep plain;
  plain.lr = rate;
  cuda_kernels::sgd_update(gupdated.data(), gdy.data(), nullptr, n, plain);
  EXPECT_LT(gpu_difference(y, gy), kTolerance);
  EXPECT_LT(gpu_difference(dx, gdx), kTolerance);
  EXPECT_LT(gpu_difference(grad, ggrad), kTolerance);
  EXPECT_LT(gpu_difference(updated, gupdated), kTolerance);
  EXPECT_NEAR(gloss, loss, 1e-9 * loss);  // both sums in double
}

// The optimizers' updates on the GPU equal the host's bit for bit (the same fp32 operations,
// each rounded on its own), for every variant: SGD plain, with weight decay, momentum, Nesterov;
// Adam with L2 decay, AdamW with decoupled decay; three steps each, so the state is read back.
TEST(GpuElementwise, OptimizerUpdatesEqualTheHostExactly) {
  const std::int64_t n = 4099;
  ElementwiseKernels& host = host_elementwise();
  ElementwiseKernels& gpu = elementwise_kernels(kGpu);
  struct Sgd {
    const char* name;
    SgdStep step;
    bool buffer;
  };
  const Sgd sgds[] = {{"plain", {0.1f, 0.0f, 0.0f, false}, false},
                      {"weight decay", {0.1f, 0.0f, 0.01f, false}, false},
                      {"momentum", {0.05f, 0.9f, 0.01f, false}, true},
                      {"nesterov", {0.05f, 0.9f, 0.0f, true}, true}};
  for (const Sgd& c : sgds) {
    SCOPED_TRACE(c.name);
    Tensor p = random_tensor(n, 31), buf(Shape({n}));
    buf.fill(0.0f);
    Tensor gp = p.to(kGpu), gbuf = buf.to(kGpu);
    for (int t = 0; t < 3; ++t) {
      const Tensor g = random_tensor(n, static_cast<unsigned>(40 + t));
      const Tensor gg = g.to(kGpu);
      host.sgd_update(p.data(), g.data(), c.buffer ? buf.data() : nullptr, n, c.step);
      gpu.sgd_update(gp.data(), gg.data(), c.buffer ? gbuf.data() : nullptr, n, c.step);
    }
    EXPECT_EQ(max_relative_difference(p, gp.to(Device::host())), 0.0);
    EXPECT_EQ(max_relative_difference(buf, gbuf.to(Device::host())), 0.0);
  }
  for (const bool decoupled : {false, true}) {
    SCOPED_TRACE(decoupled ? "adamw" : "adam");
    Tensor p = random_tensor(n, 32), m(Shape({n})), v(Shape({n}));
    m.fill(0.0f);
    v.fill(0.0f);
    Tensor gp = p.to(kGpu), gm = m.to(kGpu), gv = v.to(kGpu);
    for (int t = 1; t <= 3; ++t) {
      const double lr = 1e-2, wd = 0.05, beta1 = 0.9, beta2 = 0.999;
      AdamStep s;
      s.l2_decay = decoupled ? 0.0f : static_cast<float>(wd);
      s.decoupled_scale = decoupled ? static_cast<float>(1.0 - lr * wd) : 1.0f;
      s.beta1 = static_cast<float>(beta1);
      s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
      s.beta2 = static_cast<float>(beta2);
      s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
      s.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, t)));
      s.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, t)));
      s.epsilon = 1e-8f;
      const Tensor g = random_tensor(n, static_cast<unsigned>(50 + t));
      const Tensor gg = g.to(kGpu);
      host.adam_update(p.data(), g.data(), m.data(), v.data(), n, s);
      gpu.adam_update(gp.data(), gg.data(), gm.data(), gv.data(), n, s);
    }
    EXPECT_EQ(max_relative_difference(p, gp.to(Device::host())), 0.0);
    EXPECT_EQ(max_relative_difference(m, gm.to(Device::host())), 0.0);
    EXPECT_EQ(max_relative_difference(v, gv.to(Device::host())), 0.0);
  }
}

TEST(GpuElementwise, Bf16RoundingEqualsTheHostBitForBit) {
  // Values of every magnitude, exact ties, infinities, NaNs and subnormals.
  std::vector<float> values;
  for (int e = -130; e <= 128; e += 3)
    for (float m : {1.0f, 1.00390625f, 1.01171875f, 1.3f, -1.7f, 1.99999f}) values.push_back(std::ldexp(m, e));
  values.push_back(std::numeric_limits<float>::infinity());
  values.push_back(-std::numeric_limits<float>::infinity());
  values.push_back(std::numeric_limits<float>::quiet_NaN());
  const auto n = static_cast<std::int64_t>(values.size());
  Tensor x(Shape({n}));
  std::copy(values.begin(), values.end(), x.data());
  Tensor expected = x.clone();
  host_elementwise().round_to_bf16(expected.data(), expected.data(), n);
  Tensor gx = x.to(kGpu);
  Tensor gy(Shape({n}), kGpu);
  elementwise_kernels(kGpu).round_to_bf16(gx.data(), gy.data(), n);
  const Tensor y = gy.to(Device::host());
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint32_t want, got;
    std::memcpy(&want, expected.data() + i, 4);
    std::memcpy(&got, y.data() + i, 4);
    EXPECT_EQ(got, want) << "round_to_bf16 of " << values[static_cast<std::size_t>(i)];
  }
  // Stored as bf16 (cuDNN's bf16 tensors, the executor's bf16 activations) and widened back: the
  // same values, bit for bit.
  auto* stored = static_cast<std::uint16_t*>(cuda::allocate(static_cast<std::size_t>(n) * sizeof(std::uint16_t)));
  Tensor widened(Shape({n}), kGpu);
  elementwise_kernels(kGpu).to_bf16(gx.data(), stored, n);
  elementwise_kernels(kGpu).from_bf16(stored, widened.data(), n);
  const Tensor back = widened.to(Device::host());
  cuda::release(stored);
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint32_t want, got;
    std::memcpy(&want, expected.data() + i, 4);
    std::memcpy(&got, back.data() + i, 4);
    EXPECT_EQ(got, want) << "to_bf16 and back of " << values[static_cast<std::size_t>(i)];
  }
  // In place.
  elementwise_kernels(kGpu).round_to_bf16(gx.data(), gx.data(), n);
  EXPECT_EQ(max_relative_difference(y, gx.to(Device::host())), 0.0);
}

TEST(GpuBoxOps, CopyAddAndFillEqualTheHost) {
  // The packing of halo exchanges and redistributions on the GPU (TileExchange on a GPU): regions
  // of 2-5 dimensions, with merged trailing runs and single-element strips.
  const std::vector<std::tuple<Box, Box, Box>> cases = {
      {Box{{1, 2}, {3, 4}}, Box{{0, 0}, {5, 7}}, Box{{1, 1}, {4, 6}}},
      {Box{{0, 1, 0}, {2, 1, 9}}, Box{{0, 0, 0}, {2, 3, 9}}, Box{{0, 1, 0}, {2, 1, 9}}},
      {Box{{0, 0, 3, 0, 0}, {2, 3, 1, 8, 8}}, Box{{0, 0, 0, 0, 0}, {2, 3, 6, 8, 8}}, Box{{0, 0, 2, 0, 0}, {2, 3, 3, 8, 8}}},
      {Box{{1, 0, 2, 2}, {1, 4, 5, 1}}, Box{{0, 0, 0, 0}, {3, 4, 9, 5}}, Box{{1, 0, 1, 1}, {2, 4, 6, 3}}},
  };
  for (const auto& [region, src_box, dst_box] : cases) {
    const Tensor src = random_tensor(src_box.numel(), 60), dst = random_tensor(dst_box.numel(), 61);
    Tensor host_copy = dst.clone(), host_add = dst.clone(), host_fill = dst.clone();
    copy_box(region, src.data(), src_box, host_copy.data(), dst_box);
    add_box(region, src.data(), src_box, host_add.data(), dst_box);
    fill_box(region, host_fill.data(), dst_box, 3.5f);
    const Tensor gsrc = src.to(kGpu);
    Tensor gcopy = dst.to(kGpu), gadd = dst.to(kGpu), gfill = dst.to(kGpu);
    copy_box(region, gsrc.data(), src_box, gcopy.data(), dst_box, kGpu);
    add_box(region, gsrc.data(), src_box, gadd.data(), dst_box, kGpu);
    fill_box(region, gfill.data(), dst_box, 3.5f, kGpu);
    EXPECT_EQ(max_relative_difference(host_copy, gcopy.to(Device::host())), 0.0);
    EXPECT_EQ(max_relative_difference(host_add, gadd.to(Device::host())), 0.0);
    EXPECT_EQ(max_relative_difference(host_fill, gfill.to(Device::host())), 0.0);
  }
}

TEST(GpuMemory, TensorsMoveBetweenHostAndDevice) {
  const Tensor host = random_tensor(1000, 21);
  const Tensor device = host.to(kGpu);
  EXPECT_EQ(device.device(), kGpu);
  EXPECT_EQ(max_relative_difference(host, device.to(Device::host())), 0.0);
  Tensor filled(Shape({5, 7}), kGpu);
  const Tensor zeros = filled.to(Device::host());
  for (std::int64_t i = 0; i < zeros.numel(); ++i) EXPECT_EQ(zeros.data()[i], 0.0f);
  filled.fill(2.5f);
  const Tensor back = filled.slice(1, 3).clone().to(Device::host());
  EXPECT_EQ(back.shape().dims(), (std::vector<std::int64_t>{2, 7}));
  for (std::int64_t i = 0; i < back.numel(); ++i) EXPECT_EQ(back.data()[i], 2.5f);
  EXPECT_THROW(filled.at({0, 0}), Error);  // elements of a device tensor are not host memory
}

TEST(GpuMemory, CachingAllocatorReusesReleasedBlocks) {
  cuda::empty_cache();
  const auto before = cuda::allocator_stats();
  void* first = cuda::allocate(3 << 20);
  const auto during = cuda::allocator_stats();
  EXPECT_EQ(during.device_allocations, before.device_allocations + 1);
  EXPECT_GE(during.bytes_in_use, before.bytes_in_use + (3u << 20));
  cuda::release(first);
  void* second = cuda::allocate((3 << 20) - 1000);  // rounds to the same block
  const auto after = cuda::allocator_stats();
  EXPECT_EQ(second, first);
  EXPECT_EQ(after.device_allocations, during.device_allocations);
  EXPECT_EQ(after.cache_hits, during.cache_hits + 1);
  cuda::release(second);
  cuda::empty_cache();
  EXPECT_EQ(cuda::allocator_stats().bytes_cached, 0u);
}

TEST(GpuMemory, OutOfMemoryIsAClearError) {
  try {
    cuda::allocate(std::size_t{1} << 50);  // a petabyte
    FAIL() << "no error for a petabyte";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("out of memory"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace tessera
