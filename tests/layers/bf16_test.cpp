// bf16 operands on the host (Precision::BF16, layers/bf16_operands.hpp): the rounding itself, and
// convolution and linear layers that compute exactly what their fp32 kernels compute on
// bf16-rounded operands (results not rounded); their results stay within bf16's accuracy of the
// fp32 layers' and are not the fp32 layers'.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "layer_test_utils.hpp"

namespace tessera {
namespace {

using testing::make_layer;
using testing::OptionList;
using testing::random_tensor;

std::uint32_t bits_of(float value) {
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}
float from_bits(std::uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

Tensor rounded(const Tensor& tensor) {
  Tensor copy = tensor.clone();
  host_elementwise().round_to_bf16(copy.data(), copy.data(), copy.numel());
  return copy;
}

void expect_bit_equal(const Tensor& a, const Tensor& b, const char* what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  std::int64_t differ = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) differ += bits_of(a.data()[i]) != bits_of(b.data()[i]);
  EXPECT_EQ(differ, 0) << what << ": " << differ << " of " << a.numel() << " elements differ";
}

/// max |a - b| / max |b|.
double scaled_difference(const Tensor& a, const Tensor& b) {
  double diff = 0, scale = 1e-30;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a.data()[i]) - b.data()[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b.data()[i])));
  }
  return diff / scale;
}

TEST(Bf16Rounding, RoundsToNearestEvenOnTheBits) {
  const float one = 1.0f;
  const float half_ulp = std::ldexp(1.0f, -8);  // half of bf16's step (2^-7) at 1
  const std::vector<std::pair<float, float>> cases = {
      {one, one},
      {one + half_ulp, one},                                           // a tie: to the even neighbour, 1
      {one + 3 * half_ulp, one + 4 * half_ulp},                        // a tie: to the even neighbour, 1 + 2^-6
      {one + half_ulp + std::ldexp(1.0f, -20), one + 2 * half_ulp},    // just above the tie: up
      {-(one + half_ulp + std::ldexp(1.0f, -20)), -(one + 2 * half_ulp)},
      {one + half_ulp - std::ldexp(1.0f, -20), one},                   // just below: down
      {0.0f, 0.0f},
      {-0.0f, -0.0f},
      {std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity()},  // beyond bf16's largest finite
      {3.0e38f, from_bits(0x7f620000u)},                               // below it: finite
      {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::infinity()},
      {-std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()},
      {from_bits(0x00012345u), from_bits(0x00010000u)},                // subnormal: kept subnormal
  };
  std::vector<float> x, y(cases.size() + 2);
  for (const auto& c : cases) x.push_back(c.first);
  x.push_back(std::numeric_limits<float>::quiet_NaN());
  x.push_back(from_bits(0x7f800001u));  // a signalling NaN whose payload is only in the low bits
  host_elementwise().round_to_bf16(x.data(), y.data(), static_cast<std::int64_t>(x.size()));
  for (std::size_t i = 0; i < cases.size(); ++i)
    EXPECT_EQ(bits_of(y[i]), bits_of(cases[i].second)) << "case " << i << ": " << x[i];
  EXPECT_TRUE(std::isnan(y[cases.size()]));
  EXPECT_TRUE(std::isnan(y[cases.size() + 1])) << "a NaN must not become an infinity";
  // In place.
  host_elementwise().round_to_bf16(x.data(), x.data(), 2);
  EXPECT_EQ(x[1], one);
}

TEST(Bf16Rounding, StoredAsBf16AndWidenedIsTheRoundedValue) {
  // The executor's bf16 activations (Model::activation_precision): to_bf16 keeps the upper 16
  // bits of round_to_bf16's value, from_bf16 gives that value back exactly.
  std::vector<float> x;
  for (int e = -140; e <= 127; e += 7)
    for (float m : {1.0f, 1.00390625f, 1.01171875f, -1.3f, 1.99999f}) x.push_back(std::ldexp(m, e));
  x.push_back(std::numeric_limits<float>::infinity());
  x.push_back(-0.0f);
  x.push_back(std::numeric_limits<float>::max());
  x.push_back(std::numeric_limits<float>::quiet_NaN());
  const auto n = static_cast<std::int64_t>(x.size());
  std::vector<float> rounded(x.size()), widened(x.size());
  std::vector<std::uint16_t> stored(x.size());
  host_elementwise().round_to_bf16(x.data(), rounded.data(), n);
  host_elementwise().to_bf16(x.data(), stored.data(), n);
  host_elementwise().from_bf16(stored.data(), widened.data(), n);
  for (std::size_t i = 0; i + 1 < x.size(); ++i) {
    EXPECT_EQ(static_cast<std::uint32_t>(stored[i]) << 16, bits_of(rounded[i])) << x[i];
    EXPECT_EQ(bits_of(widened[i]), bits_of(rounded[i])) << x[i];
  }
  EXPECT_TRUE(std::isnan(widened.back()));
}

struct LayerCase {
  const char* type;
  OptionList options;
  Shape input;
};

/// The layer's parameters (weights, then bias) copied.
std::vector<Tensor> parameter_values(Layer& layer) {
  std::vector<Tensor> values;
  for (auto* p : layer.parameters()) values.push_back(p->value.clone());
  return values;
}

class Bf16Layer : public ::testing::TestWithParam<int> {};

const std::vector<LayerCase>& layer_cases() {
  static const std::vector<LayerCase> cases = {
      {"conv", {{"filters", {"5"}}, {"kernel", {"3"}}, {"padding", {"1"}}}, Shape::image(3, 4, {9, 10})},
      {"conv", {{"filters", {"4"}}, {"kernel", {"3"}}, {"stride", {"2"}}, {"bias", {"false"}}}, Shape::image(2, 3, {7, 8, 9})},
      {"conv", {{"filters", {"6"}}, {"kernel", {"3"}}, {"padding", {"2"}}, {"dilation", {"2"}}}, Shape::image(2, 2, {6, 7, 8})},
      {"linear", {{"out", {"7"}}}, Shape::flat(5, 40)},
  };
  return cases;
}

TEST_P(Bf16Layer, IsItsFp32KernelOnRoundedOperandsWithRoundedOutputs) {
  const LayerCase& c = layer_cases()[static_cast<std::size_t>(GetParam())];
  SCOPED_TRACE(std::string(c.type) + " " + c.input.to_string());
  auto backend = make_host_backend();
  OptionList bf16_options = c.options;
  bf16_options.push_back({"precision", {"bf16"}});
  auto bf16 = make_layer(c.type, bf16_options);
  auto fp32 = make_layer(c.type, c.options);
  auto reference = make_layer(c.type, c.options);  // fp32, fed the rounded operands by hand
  const Shape out_shape = bf16->setup({c.input});
  ASSERT_EQ(fp32->setup({c.input}), out_shape);
  reference->setup({c.input});
  for (Layer* layer : {bf16.get(), fp32.get(), reference.get()}) layer->init_parameters(5);
  for (auto* p : reference->parameters())
    if (p->name.ends_with(".weight")) p->value = rounded(p->value);

  const Tensor input = random_tensor(c.input, 1);
  const Tensor grad_output = random_tensor(out_shape, 2);
  const Tensor rounded_input = rounded(input), rounded_grad_output = rounded(grad_output);
  LayerContext context;
  context.backend = backend.get();

  struct Result {
    Tensor output, grad_input;
    std::vector<Tensor> grads;
  };
  auto run = [&](Layer& layer, const Tensor& x, const Tensor& dy) {
    Result r;
    const Tensor* inputs[] = {&x};
    layer.forward(inputs, r.output, context);
    Tensor* grads[] = {&r.grad_input};
    layer.backward(inputs, r.output, dy, grads, context);
    for (auto* p : layer.parameters()) r.grads.push_back(p->grad.clone());
    return r;
  };
  const Result b = run(*bf16, input, grad_output);
  const Result f = run(*fp32, input, grad_output);
  const Result r = run(*reference, rounded_input, rounded_grad_output);

  // Exactly the fp32 kernels on rounded operands; the results are fp32.
  expect_bit_equal(b.output, r.output, "output");
  expect_bit_equal(b.grad_input, r.grad_input, "input gradient");
  for (std::size_t i = 0; i < b.grads.size(); ++i) expect_bit_equal(b.grads[i], r.grads[i], "parameter gradient");
  EXPECT_GT(scaled_difference(b.output, rounded(b.output)), 0.0) << "the outputs are not rounded to bf16";

  // Within bf16's accuracy of fp32, and not fp32 itself.
  EXPECT_LT(scaled_difference(b.output, f.output), 1e-2);
  EXPECT_GT(scaled_difference(b.output, f.output), 1e-5);
  EXPECT_LT(scaled_difference(b.grad_input, f.grad_input), 1e-2);
  for (std::size_t i = 0; i < b.grads.size(); ++i) EXPECT_LT(scaled_difference(b.grads[i], f.grads[i]), 1e-2) << i;
  // The master weights are untouched fp32 values (not bf16 ones).
  EXPECT_GT(scaled_difference(parameter_values(*bf16)[0], rounded(parameter_values(*bf16)[0])), 0.0);
  EXPECT_EQ(scaled_difference(parameter_values(*bf16)[0], parameter_values(*fp32)[0]), 0.0);
}

INSTANTIATE_TEST_SUITE_P(ConvolutionsAndLinear, Bf16Layer, ::testing::Range(0, 4));

TEST(Bf16Layer, PrecisionMustBeFp32OrBf16) {
  try {
    (void)make_layer("conv", {{"filters", {"2"}}, {"kernel", {"3"}}, {"precision", {"fp16"}}});
    ADD_FAILURE() << "accepted fp16";
  } catch (const InputError& e) {
    EXPECT_NE(e.message().find("precision must be fp32 or bf16, got 'fp16'"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("layer 'test' (conv)"), std::string::npos) << e.message();
  }
  // Layers without kernels of their own take no precision.
  try {
    auto relu = make_layer("relu", {{"precision", {"bf16"}}});
    relu->setup({Shape::flat(2, 3)});
    ADD_FAILURE() << "relu accepted a precision";
  } catch (const InputError& e) {
    EXPECT_NE(e.message().find("precision"), std::string::npos) << e.message();
  }
}

}  // namespace
}  // namespace tessera
