// Layers on the GPU against the same layers on the host (convolution 2-D/3-D, max and average
// pooling, linear, ReLU, leaky ReLU, flatten, add, concat, batch norm with batch statistics,
// dropout: the same masks) and the losses, each built twice with
// the same initial weights, one moved to the GPU
// (Layer::move_to): outputs, input gradients and parameter gradients within 1e-5 of the largest
// value, the losses (MSE, softmax cross-entropy) within 1e-9. Convolutions and linear layers with
// bf16 operands (Precision::BF16; convolutions Bf16Convolutions::Exact: cuDNN and cuBLAS on
// tensor cores over the rounded operands, the host's fp32 kernels over the same): within 1e-4
// (both multiply the same bf16 values exactly and sum in fp32), and nearer the host's bf16 result
// than its fp32 one. Native bf16 convolutions (bf16 results): within one bf16 step of the largest
// value here; element by element in test_gpu_kernels.cpp. Convolutions with a fused leaky ReLU
// (LayerContext::leaky_relu_after: the host's oneDNN post-op, the GPU's bias-and-activation
// pass) in fp32, bf16 exact and bf16 native; a fused relu leaves no negative output.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "layers/layer_test_utils.hpp"
#include "gpu/gpu_test_util.hpp"
#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/layers/dnn_backend.hpp"
#include "tessera/layers/layer.hpp"

namespace tessera {
namespace {

using testing::OptionList;

constexpr double kTolerance = 1e-5;
const Device kGpu = Device::cuda(0);


struct Case {
  std::string type;
  OptionList options;
  std::vector<Shape> inputs;
  double tolerance = kTolerance;
  Bf16Convolutions bf16_convolutions = Bf16Convolutions::Exact;
  std::optional<float> leaky_relu_after = std::nullopt;  ///< a fused activation (conv)
};

constexpr double kBf16Tolerance = 1e-4;
/// Native bf16 convolutions round their results to bf16: within one bf16 step (2^-7 of a value)
/// of the largest value.
constexpr double kNativeBf16Tolerance = 0.0078125;

/// The options without `precision` (the layer in fp32).
OptionList without_precision(const OptionList& options) {
  OptionList out;
  for (const auto& option : options)
    if (option.first != "precision") out.push_back(option);
  return out;
}

class GpuLayers : public ::testing::TestWithParam<Case> {
 protected:
  std::unique_ptr<DnnBackend> host_backend = make_host_backend();
  std::unique_ptr<DnnBackend> gpu_backend = make_cuda_backend(bf16_as(GetParam().bf16_convolutions));

  static CudaBackendOptions bf16_as(Bf16Convolutions way) {
    CudaBackendOptions options;
    options.bf16_convolutions = way;
    return options;
  }

  LayerContext context(DnnBackend& backend, std::int64_t batch) {
    LayerContext ctx;
    ctx.backend = &backend;
    ctx.global_batch = batch;
    ctx.seed = 5;
    ctx.training = true;
    return ctx;
  }
};

TEST_P(GpuLayers, MatchTheHost) {
  const Case& c = GetParam();
  auto host = testing::make_layer(c.type, c.options);
  auto gpu = testing::make_layer(c.type, c.options);
  const Shape output_shape = host->setup(c.inputs);
  gpu->setup(c.inputs);
  host->init_parameters(11);
  gpu->init_parameters(11);
  gpu->move_to(kGpu);
  for (Parameter* p : gpu->parameters()) EXPECT_EQ(p->value.device(), kGpu) << p->name;

  const std::size_t n = c.inputs.size();
  std::vector<Tensor> x, gx, dx(n), gdx(n);
  for (std::size_t k = 0; k < n; ++k) {
    x.push_back(testing::random_tensor(c.inputs[k], 1 + k));
    gx.push_back(x.back().to(kGpu));
  }
  const Tensor dy = testing::random_tensor(output_shape, 20);
  const Tensor gdy = dy.to(kGpu);
  std::vector<const Tensor*> in, gin;
  std::vector<Tensor*> grad_in, ggrad_in;
  for (std::size_t k = 0; k < n; ++k) {
    in.push_back(&x[k]);
    gin.push_back(&gx[k]);
    grad_in.push_back(&dx[k]);
    ggrad_in.push_back(&gdx[k]);
  }
  LayerContext host_ctx = context(*host_backend, c.inputs[0][0]);
  LayerContext gpu_ctx = context(*gpu_backend, c.inputs[0][0]);
  host_ctx.leaky_relu_after = gpu_ctx.leaky_relu_after = c.leaky_relu_after;
  Tensor y, gy;
  host->forward(in, y, host_ctx);
  host->backward(in, y, dy, grad_in, host_ctx);
  for (int call = 0; call < 2; ++call) {  // the first call also searches cuDNN's algorithms
    gpu->forward(gin, gy, gpu_ctx);
    gpu->backward(gin, gy, gdy, ggrad_in, gpu_ctx);
    ASSERT_EQ(gy.device(), kGpu);
    ASSERT_EQ(gy.shape().dims(), y.shape().dims());
    EXPECT_LT(gpu_difference(y, gy), c.tolerance) << "output, call " << call;
    for (std::size_t k = 0; k < n; ++k) {
      ASSERT_EQ(gdx[k].device(), kGpu);
      EXPECT_LT(gpu_difference(dx[k], gdx[k]), c.tolerance) << "gradient of input " << k << ", call " << call;
    }
    if (c.leaky_relu_after == 0.0f) {
      const Tensor back = gy.to(Device::host());
      EXPECT_GE(*std::min_element(back.data(), back.data() + back.numel()), 0.0f) << "the fused relu did not run";
    }
    const auto host_parameters = host->parameters(), gpu_parameters = gpu->parameters();
    for (std::size_t p = 0; p < host_parameters.size(); ++p)
      EXPECT_LT(gpu_difference(host_parameters[p]->grad, gpu_parameters[p]->grad), c.tolerance)
          << host_parameters[p]->name << ", call " << call;
  }
  if (without_precision(c.options).size() != c.options.size() && c.bf16_convolutions == Bf16Convolutions::Exact) {
    // A GPU path that ignored the bf16 operands would be nearer the host's fp32 result.
    auto fp32 = testing::make_layer(c.type, without_precision(c.options));
    fp32->setup(c.inputs);
    fp32->init_parameters(11);
    Tensor y32;
    fp32->forward(in, y32, host_ctx);
    EXPECT_LT(gpu_difference(y, gy), 0.1 * gpu_difference(y32, gy)) << "the GPU's bf16 output is not bf16's";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layers, GpuLayers,
    ::testing::Values(
        Case{"conv", {{"filters", {"6"}}, {"kernel", {"3"}}, {"padding", {"1"}}}, {Shape::image(2, 3, {9, 8})}},
        Case{"conv", {{"filters", {"4"}}, {"kernel", {"3"}}, {"stride", {"2"}}, {"padding", {"1"}}},
             {Shape::image(2, 2, {9, 8, 7})}},
        Case{"conv", {{"filters", {"5"}}, {"kernel", {"3"}}, {"dilation", {"2"}}, {"bias", {"false"}}},
             {Shape::image(1, 3, {10, 9, 8})}},
        Case{"maxpool", {{"kernel", {"2"}}}, {Shape::image(2, 3, {8, 8, 8})}},
        Case{"maxpool", {{"kernel", {"3"}}, {"stride", {"2"}}, {"padding", {"1"}}}, {Shape::image(2, 3, {9, 10})}},
        Case{"avgpool", {{"kernel", {"3"}}, {"stride", {"2"}}, {"padding", {"1"}}}, {Shape::image(2, 3, {9, 9, 9})}},
        Case{"linear", {{"out", {"7"}}}, {Shape::flat(5, 13)}},
        Case{"relu", {}, {Shape::image(2, 3, {5, 6})}},
        Case{"leaky_relu", {{"slope", {"0.3"}}}, {Shape::image(2, 3, {4, 5, 6})}},
        Case{"flatten", {}, {Shape::image(2, 3, {4, 5, 6})}},
        Case{"add", {}, {Shape::image(2, 3, {4, 5}), Shape::image(2, 3, {4, 5}), Shape::image(2, 3, {4, 5})}},
        Case{"concat", {}, {Shape::image(2, 3, {4, 5, 3}), Shape::image(2, 5, {4, 5, 3})}},
        Case{"batchnorm", {}, {Shape::image(4, 3, {5, 6})}},
        Case{"batchnorm", {{"epsilon", {"0.001"}}}, {Shape::image(2, 5, {4, 3, 6})}},
        Case{"dropout", {{"rate", {"0.3"}}}, {Shape::image(2, 3, {4, 5, 6})}},
        Case{"conv", {{"filters", {"8"}}, {"kernel", {"3"}}, {"padding", {"1"}}, {"precision", {"bf16"}}},
             {Shape::image(2, 8, {9, 8})}, kBf16Tolerance},
        Case{"conv", {{"filters", {"16"}}, {"kernel", {"3"}}, {"padding", {"1"}}, {"precision", {"bf16"}}},
             {Shape::image(2, 4, {8, 8, 8})}, kBf16Tolerance},
        Case{"conv", {{"filters", {"5"}}, {"kernel", {"3"}}, {"stride", {"2"}}, {"bias", {"false"}}, {"precision", {"bf16"}}},
             {Shape::image(1, 3, {10, 9, 8})}, kBf16Tolerance},
        Case{"linear", {{"out", {"24"}}, {"precision", {"bf16"}}}, {Shape::flat(8, 40)}, kBf16Tolerance},
        Case{"conv", {{"filters", {"8"}}, {"kernel", {"3"}}, {"padding", {"1"}}, {"precision", {"bf16"}}},
             {Shape::image(2, 8, {9, 8})}, kNativeBf16Tolerance, Bf16Convolutions::Native},
        Case{"conv", {{"filters", {"16"}}, {"kernel", {"3"}}, {"padding", {"1"}}, {"precision", {"bf16"}}},
             {Shape::image(2, 4, {8, 8, 8})}, kNativeBf16Tolerance, Bf16Convolutions::Native},
        // Fused activations: fp32 with and without bias, bf16 exact, bf16 native with and without bias.
        Case{"conv", {{"filters", {"4"}}, {"kernel", {"3"}}, {"padding", {"1"}}}, {Shape::image(2, 2, {9, 8, 7})},
             kTolerance, Bf16Convolutions::Exact, 0.01f},
        Case{"conv", {{"filters", {"6"}}, {"kernel", {"3"}}, {"bias", {"false"}}}, {Shape::image(2, 3, {9, 8})},
             kTolerance, Bf16Convolutions::Exact, 0.0f},
        Case{"conv", {{"filters", {"8"}}, {"kernel", {"3"}}, {"padding", {"1"}}, {"precision", {"bf16"}}},
             {Shape::image(2, 8, {9, 8})}, kBf16Tolerance, Bf16Convolutions::Exact, 0.2f},
        Case{"conv", {{"filters", {"16"}}, {"kernel", {"3"}}, {"padding", {"1"}}, {"precision", {"bf16"}}},
             {Shape::image(2, 4, {8, 8, 8})}, kNativeBf16Tolerance, Bf16Convolutions::Native, 0.01f},
        Case{"conv", {{"filters", {"8"}}, {"kernel", {"3"}}, {"bias", {"false"}}, {"precision", {"bf16"}}},
             {Shape::image(2, 8, {9, 8})}, kNativeBf16Tolerance, Bf16Convolutions::Native, 0.0f}),
    [](const ::testing::TestParamInfo<Case>& param) { return param.param.type + std::to_string(param.index); });

TEST(GpuLoss, MeanSquaredErrorMatchesTheHost) {
  auto backend = make_cuda_backend();
  auto host_backend = make_host_backend();
  LayerOptions options("loss mse");
  auto loss = create_loss("mse", options);
  const Tensor prediction = testing::random_tensor(Shape::flat(6, 4), 3), target = testing::random_tensor(Shape::flat(6, 4), 4);
  LayerContext host_ctx, gpu_ctx;
  host_ctx.backend = host_backend.get();
  gpu_ctx.backend = backend.get();
  host_ctx.global_batch = gpu_ctx.global_batch = 12;  // as if another rank held 6 more samples
  Tensor grad, ggrad;
  const double host_loss = loss->forward_backward(prediction, target, grad, host_ctx);
  const double gpu_loss = loss->forward_backward(prediction.to(kGpu), target.to(kGpu), ggrad, gpu_ctx);
  EXPECT_NEAR(gpu_loss, host_loss, 1e-9 * host_loss);
  EXPECT_EQ(ggrad.device(), kGpu);
  EXPECT_LT(gpu_difference(grad, ggrad), kTolerance);
}

// NaNs go through leaky ReLUs on the GPU as on the host (a NaN in the data must reach the loss):
// the layer, and a convolution with the activation fused (fp32, bf16 native), for relu and a slope.
TEST(GpuLayers, NansGoThroughLeakyRelusAsOnTheHost) {
  auto host_backend = make_host_backend();
  for (const Bf16Convolutions way : {Bf16Convolutions::Exact, Bf16Convolutions::Native})
    for (const char* precision : {"fp32", "bf16"})
      for (const float slope : {0.0f, 0.1f}) {
        SCOPED_TRACE(std::string(precision) + " slope " + std::to_string(slope));
        CudaBackendOptions options;
        options.bf16_convolutions = way;
        auto gpu_backend = make_cuda_backend(options);
        const Shape shape = Shape::image(2, 3, {6, 7});
        auto host_conv = testing::make_layer("conv", {{"filters", {"4"}}, {"kernel", {"3"}}, {"precision", {precision}}});
        auto gpu_conv = testing::make_layer("conv", {{"filters", {"4"}}, {"kernel", {"3"}}, {"precision", {precision}}});
        auto act = testing::make_layer("leaky_relu", {{"slope", {std::to_string(slope)}}}, 4);
        const Shape out_shape = host_conv->setup({shape});
        gpu_conv->setup({shape});
        act->setup({out_shape});
        host_conv->init_parameters(2);
        gpu_conv->init_parameters(2);
        gpu_conv->move_to(kGpu);
        Tensor x = testing::random_tensor(shape, 9);
        x.data()[10] = std::numeric_limits<float>::quiet_NaN();
        const Tensor gx = x.to(kGpu);
        LayerContext host_ctx, gpu_ctx;
        host_ctx.backend = host_backend.get();
        gpu_ctx.backend = gpu_backend.get();
        host_ctx.global_batch = gpu_ctx.global_batch = 2;
        const Tensor* in[] = {&x};
        const Tensor* gin[] = {&gx};
        Tensor conv_out, y, gconv_out, gy, gfused;
        host_conv->forward(in, conv_out, host_ctx);
        const Tensor* act_in[] = {&conv_out};
        act->forward(act_in, y, host_ctx);
        gpu_conv->forward(gin, gconv_out, gpu_ctx);
        const Tensor* gact_in[] = {&gconv_out};
        act->forward(gact_in, gy, gpu_ctx);
        ASSERT_TRUE(gpu_conv->traits().fuses_leaky_relu && gpu_backend->convolution().fuses_leaky_relu(slope));
        gpu_ctx.leaky_relu_after = slope;
        gpu_conv->forward(gin, gfused, gpu_ctx);
        const Tensor layer = gy.to(Device::host()), fused = gfused.to(Device::host());
        std::int64_t nans = 0;
        for (std::int64_t i = 0; i < y.numel(); ++i) {
          nans += std::isnan(y.data()[i]);
          EXPECT_EQ(std::isnan(layer.data()[i]), std::isnan(y.data()[i])) << "the layer, element " << i;
          EXPECT_EQ(std::isnan(fused.data()[i]), std::isnan(y.data()[i])) << "fused, element " << i;
        }
        EXPECT_GT(nans, 0);
      }
}

// Max pooling through the leaky ReLU before it (LayerContext::leaky_relu_before) on the GPU equals
// the host's, 2-D and 3-D.
TEST(GpuLayers, MaxPoolingThroughALeakyReluMatchesTheHost) {
  auto host_backend = make_host_backend();
  auto gpu_backend = make_cuda_backend();
  for (const Shape& shape : {Shape::image(2, 3, {8, 6}), Shape::image(2, 2, {6, 4, 5})}) {
    auto host = testing::make_layer("maxpool", {{"kernel", {"2"}}});
    auto gpu = testing::make_layer("maxpool", {{"kernel", {"2"}}});
    const Shape pooled = host->setup({shape});
    gpu->setup({shape});
    gpu->move_to(kGpu);
    Tensor x = testing::random_tensor(shape, 12);
    for (std::int64_t i = 0; i < x.numel(); ++i) x.data()[i] -= 0.6f;  // windows with no positive value too
    const Tensor dy = testing::random_tensor(pooled, 13);
    const Tensor gx = x.to(kGpu), gdy = dy.to(kGpu);
    LayerContext host_ctx, gpu_ctx;
    host_ctx.backend = host_backend.get();
    gpu_ctx.backend = gpu_backend.get();
    host_ctx.leaky_relu_before = gpu_ctx.leaky_relu_before = 0.1f;
    const Tensor* in[] = {&x};
    const Tensor* gin[] = {&gx};
    Tensor y, gy, dx, gdx;
    Tensor* grad[] = {&dx};
    Tensor* ggrad[] = {&gdx};
    host->forward(in, y, host_ctx);
    host->backward(in, y, dy, grad, host_ctx);
    gpu->forward(gin, gy, gpu_ctx);
    gpu->backward(gin, gy, gdy, ggrad, gpu_ctx);
    EXPECT_LT(gpu_difference(dx, gdx), kTolerance) << shape.to_string();
  }
}

TEST(GpuLayers, BatchNormInEvaluationModeMatchesTheHost) {
  // A training pass first moves the running statistics; evaluation then normalises with them and
  // its backward treats them as constants (the path without batch statistics).
  auto host_backend = make_host_backend();
  auto gpu_backend = make_cuda_backend();
  const Shape shape = Shape::image(3, 4, {5, 6});
  auto host = testing::make_layer("batchnorm", {});
  auto gpu = testing::make_layer("batchnorm", {});
  host->setup({shape});
  gpu->setup({shape});
  gpu->move_to(kGpu);
  const Tensor x = testing::random_tensor(shape, 7), dy = testing::random_tensor(shape, 8);
  const Tensor gx = x.to(kGpu), gdy = dy.to(kGpu);
  LayerContext host_ctx, gpu_ctx;
  host_ctx.backend = host_backend.get();
  gpu_ctx.backend = gpu_backend.get();
  host_ctx.global_batch = gpu_ctx.global_batch = 3;
  host_ctx.training = gpu_ctx.training = true;
  const Tensor* in[] = {&x};
  const Tensor* gin[] = {&gx};
  Tensor y, gy, dx, gdx;
  host->forward(in, y, host_ctx);
  gpu->forward(gin, gy, gpu_ctx);
  for (std::size_t b = 0; b < host->buffers().size(); ++b)
    EXPECT_LT(gpu_difference(*host->buffers()[b], *gpu->buffers()[b]), kTolerance) << "running statistic " << b;
  host_ctx.training = gpu_ctx.training = false;
  Tensor* grad_in[] = {&dx};
  Tensor* ggrad_in[] = {&gdx};
  host->forward(in, y, host_ctx);
  host->backward(in, y, dy, grad_in, host_ctx);
  gpu->forward(gin, gy, gpu_ctx);
  gpu->backward(gin, gy, gdy, ggrad_in, gpu_ctx);
  EXPECT_LT(gpu_difference(y, gy), kTolerance);
  EXPECT_LT(gpu_difference(dx, gdx), kTolerance);
  const auto hp = host->parameters(), gp = gpu->parameters();
  for (std::size_t p = 0; p < hp.size(); ++p) EXPECT_LT(gpu_difference(hp[p]->grad, gp[p]->grad), kTolerance) << hp[p]->name;
}

TEST(GpuLoss, SoftmaxCrossEntropyMatchesTheHost) {
  auto backend = make_cuda_backend();
  auto host_backend = make_host_backend();
  LayerOptions options("loss softmax_cross_entropy");
  auto loss = create_loss("softmax_cross_entropy", options);
  const std::int64_t rows = 37, classes = 10;
  const Tensor scores = testing::random_tensor(Shape::flat(rows, classes), 5);
  Tensor labels(Shape({rows}));
  for (std::int64_t n = 0; n < rows; ++n) labels.data()[n] = static_cast<float>((n * 7) % classes);
  LayerContext host_ctx, gpu_ctx;
  host_ctx.backend = host_backend.get();
  gpu_ctx.backend = backend.get();
  host_ctx.global_batch = gpu_ctx.global_batch = 64;
  Tensor grad, ggrad;
  const Tensor gscores = scores.to(kGpu), glabels = labels.to(kGpu);
  const double host_loss = loss->forward_backward(scores, labels, grad, host_ctx);
  const double gpu_loss = loss->forward_backward(gscores, glabels, ggrad, gpu_ctx);
  EXPECT_NEAR(gpu_loss, host_loss, 1e-9 * host_loss);
  EXPECT_EQ(ggrad.device(), kGpu);
  EXPECT_LT(gpu_difference(grad, ggrad), kTolerance);
  const std::int64_t host_correct = loss->correct(scores, labels);
  EXPECT_EQ(loss->correct(gscores, glabels), host_correct);
  // A bad label is refused on the GPU as on the host.
  Tensor bad = labels.clone();
  bad.data()[3] = 12.0f;
  EXPECT_THROW(loss->forward_backward(gscores, bad.to(kGpu), ggrad, gpu_ctx), InputError);
}

}  // namespace
}  // namespace tessera
