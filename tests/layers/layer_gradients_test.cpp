// Every layer's backward (input and parameter gradients) against central finite differences,
// in 2-D and 3-D variants where the layer has them.
#include "layer_test_utils.hpp"

namespace tessera::testing {
namespace {

class LayerGradients : public ::testing::Test {
 protected:
  std::unique_ptr<DnnBackend> backend_ = make_host_backend();
};

TEST_F(LayerGradients, Convolution2dStridePaddingDilationBias) {
  auto layer = make_layer("conv", {{"filters", {"4"}}, {"kernel", {"3"}}, {"stride", {"2"}}, {"padding", {"1"}},
                                   {"dilation", {"2"}}});
  check_layer_gradients(*layer, {random_tensor(Shape::image(2, 3, {7, 6}), 1)}, *backend_);
}

TEST_F(LayerGradients, Convolution2dManyChannelsBlockedLayoutNoBias) {
  // 8+ input channels: the backend's blocked-layout path with its reorders.
  auto layer = make_layer("conv", {{"filters", {"16"}}, {"kernel", {"2", "3"}}, {"padding", {"0", "1"}}, {"bias", {"false"}}});
  check_layer_gradients(*layer, {random_tensor(Shape::image(2, 8, {5, 6}), 2)}, *backend_);
}

TEST_F(LayerGradients, Convolution3d) {
  auto layer = make_layer("conv", {{"filters", {"3"}}, {"kernel", {"3"}}, {"stride", {"1", "2", "1"}}, {"padding", {"1"}}});
  check_layer_gradients(*layer, {random_tensor(Shape::image(2, 2, {4, 5, 4}), 3)}, *backend_);
}

TEST_F(LayerGradients, Convolution3dBlockedDilated) {
  auto layer = make_layer("conv", {{"filters", {"8"}}, {"kernel", {"2"}}, {"dilation", {"2"}}, {"padding", {"1"}}});
  check_layer_gradients(*layer, {random_tensor(Shape::image(1, 8, {4, 4, 5}), 4)}, *backend_);
}

TEST_F(LayerGradients, MaxPool2d) {
  auto layer = make_layer("maxpool", {{"kernel", {"2"}}});
  check_layer_gradients(*layer, {distinct_values(Shape::image(2, 3, {5, 6}), 5)}, *backend_);
}

TEST_F(LayerGradients, MaxPool3dOverlappingPadded) {
  auto layer = make_layer("maxpool", {{"kernel", {"3"}}, {"stride", {"2"}}, {"padding", {"1"}}});
  check_layer_gradients(*layer, {distinct_values(Shape::image(2, 2, {4, 5, 5}), 6)}, *backend_);
}

TEST_F(LayerGradients, AvgPool2dExcludePadding) {
  auto layer = make_layer("avgpool", {{"kernel", {"3"}}, {"stride", {"2"}}, {"padding", {"1"}}});
  check_layer_gradients(*layer, {random_tensor(Shape::image(2, 3, {6, 5}), 7)}, *backend_);
}

TEST_F(LayerGradients, AvgPool3d) {
  auto layer = make_layer("avgpool", {{"kernel", {"2"}}, {"stride", {"1", "2", "2"}}});
  check_layer_gradients(*layer, {random_tensor(Shape::image(2, 2, {3, 4, 4}), 8)}, *backend_);
}

TEST_F(LayerGradients, BatchNorm2dTraining) {
  auto layer = make_layer("batchnorm", {});
  check_layer_gradients(*layer, {random_tensor(Shape::image(3, 2, {3, 4}), 9)}, *backend_);
}

TEST_F(LayerGradients, BatchNorm3dTraining) {
  auto layer = make_layer("batchnorm", {{"epsilon", {"1e-3"}}});
  check_layer_gradients(*layer, {random_tensor(Shape::image(2, 3, {2, 3, 2}), 10)}, *backend_);
}

TEST_F(LayerGradients, BatchNormFeatures) {
  auto layer = make_layer("batchnorm", {{"global", {"true"}}});  // no sample comm: local statistics
  check_layer_gradients(*layer, {random_tensor(Shape::flat(6, 4), 11)}, *backend_);
}

TEST_F(LayerGradients, LeakyRelu2d) {
  auto layer = make_layer("leaky_relu", {{"slope", {"0.2"}}});
  check_layer_gradients(*layer, {away_from_zero(Shape::image(2, 3, {4, 4}), 12)}, *backend_);
}

TEST_F(LayerGradients, Relu3d) {
  auto layer = make_layer("relu", {});
  check_layer_gradients(*layer, {away_from_zero(Shape::image(2, 2, {2, 3, 3}), 13)}, *backend_);
}

TEST_F(LayerGradients, LinearWithBias) {
  auto layer = make_layer("linear", {{"out", {"5"}}});
  check_layer_gradients(*layer, {random_tensor(Shape::flat(3, 7), 14)}, *backend_);
}

TEST_F(LayerGradients, LinearWithoutBias) {
  auto layer = make_layer("linear", {{"out", {"4"}}, {"bias", {"false"}}});
  check_layer_gradients(*layer, {random_tensor(Shape::flat(4, 6), 15)}, *backend_);
}

TEST_F(LayerGradients, AddThreeInputs) {
  auto layer = make_layer("add", {});
  const Shape shape = Shape::image(2, 3, {3, 3});
  check_layer_gradients(*layer, {random_tensor(shape, 16), random_tensor(shape, 17), random_tensor(shape, 18)},
                        *backend_);
}

TEST_F(LayerGradients, Concat2d) {
  auto layer = make_layer("concat", {});
  check_layer_gradients(*layer, {random_tensor(Shape::image(2, 2, {3, 3}), 19), random_tensor(Shape::image(2, 3, {3, 3}), 20)},
                        *backend_);
}

TEST_F(LayerGradients, Concat3d) {
  auto layer = make_layer("concat", {});
  check_layer_gradients(*layer, {random_tensor(Shape::image(2, 1, {2, 2, 3}), 21), random_tensor(Shape::image(2, 2, {2, 2, 3}), 22),
                                 random_tensor(Shape::image(2, 1, {2, 2, 3}), 23)},
                        *backend_);
}

TEST_F(LayerGradients, DropoutWithFixedMask) {
  // The mask depends only on (seed, layer id, step, element), all fixed here.
  auto layer = make_layer("dropout", {{"rate", {"0.3"}}});
  check_layer_gradients(*layer, {random_tensor(Shape::image(2, 3, {4, 4}), 24)}, *backend_);
}

TEST_F(LayerGradients, Flatten) {
  auto layer = make_layer("flatten", {});
  check_layer_gradients(*layer, {random_tensor(Shape::image(2, 3, {2, 2, 2}), 25)}, *backend_);
}

/// The loss's gradient against finite differences of (sum of local losses) / global batch.
void check_loss(Loss& loss, Tensor prediction, const Tensor& target, std::int64_t global_batch) {
  LayerContext context;
  context.global_batch = global_batch;
  Tensor grad;
  const double value = loss.forward_backward(prediction, target, grad, context);
  EXPECT_NEAR(value, loss.forward(prediction, target), 1e-9 * std::fabs(value));
  const double step = 1e-2;
  for (std::int64_t i = 0; i < prediction.numel(); ++i) {
    float& p = prediction.data()[i];
    const float saved = p;
    p = static_cast<float>(saved + step);
    const double plus = loss.forward(prediction, target) / static_cast<double>(global_batch);
    p = static_cast<float>(saved - step);
    const double minus = loss.forward(prediction, target) / static_cast<double>(global_batch);
    p = saved;
    const double numeric = (plus - minus) / (2 * step), exact = grad.data()[i];
    EXPECT_LT(std::fabs(numeric - exact) / std::max({std::fabs(numeric), std::fabs(exact), 1e-3}), 1e-2)
        << loss.type() << " element " << i << ": analytic " << exact << ", finite difference " << numeric;
  }
}

TEST(LossGradients, SoftmaxCrossEntropy) {
  LayerOptions options;
  auto loss = create_loss("softmax_cross_entropy", options);
  Tensor prediction = random_tensor(Shape::flat(4, 5), 30);
  Tensor target(Shape{4});
  for (int n = 0; n < 4; ++n) target.data()[n] = static_cast<float>((n * 3) % 5);
  check_loss(*loss, prediction, target, 10);  // part of a larger global batch
  EXPECT_EQ(loss->target_shape(Shape{5}).rank(), 0);
}

TEST(LossGradients, SoftmaxCrossEntropyValueAndAccuracy) {
  LayerOptions options;
  auto loss = create_loss("softmax_cross_entropy", options);
  Tensor prediction(Shape::flat(2, 3));
  const float scores[] = {0.f, 1.f, 2.f, 5.f, 0.f, 0.f};
  std::copy(scores, scores + 6, prediction.data());
  Tensor target(Shape{2});
  target.data()[0] = 2;
  target.data()[1] = 1;
  const double expected = (std::log(1 + std::exp(-1.0) + std::exp(-2.0))) + (std::log(std::exp(5.0) + 2) - 0.0);
  EXPECT_NEAR(loss->forward(prediction, target), expected, 1e-6);
  EXPECT_EQ(loss->correct(prediction, target), 1);
  target.data()[1] = 3;  // out of range
  EXPECT_THROW(loss->forward(prediction, target), InputError);
}

TEST(LossGradients, MeanSquaredError) {
  LayerOptions options;
  auto loss = create_loss("mse", options);
  Tensor prediction = random_tensor(Shape::flat(3, 4), 31);
  Tensor target = random_tensor(Shape::flat(3, 4), 32);
  check_loss(*loss, prediction, target, 3);
  EXPECT_EQ(loss->correct(prediction, target), -1);
}

}  // namespace
}  // namespace tessera::testing
