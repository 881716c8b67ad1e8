#pragma once
// Helpers for the layer tests: building layers from option lists, filling tensors, and checking
// backward passes against central finite differences of a smooth scalar objective
//   J = sum(output * probe)
// with a fixed random probe. A wrong gradient (a missing term, a wrong sign or scale) moves the
// relative error to order 1, far above the fp32 tolerance used here.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/layers/dnn_backend.hpp"
#include "tessera/layers/layer.hpp"

namespace tessera::testing {

using OptionList = std::vector<std::pair<std::string, std::vector<std::string>>>;

inline std::unique_ptr<Layer> make_layer(const std::string& type, const OptionList& options, int id = 3) {
  LayerOptions layer_options("layer 'test' (" + type + ")");
  for (const auto& [key, values] : options) {
    if (values.size() == 1) layer_options.set(key, values[0]);
    else layer_options.set_list(key, values);
  }
  return create_layer(type, "test", id, layer_options);
}

/// Uniform in [-1, 1), keyed by `stream` so each tensor differs.
inline Tensor random_tensor(const Shape& shape, std::uint64_t stream) {
  Tensor tensor(shape);
  for (std::int64_t i = 0; i < tensor.numel(); ++i)
    tensor.data()[i] = 2.0f * random_uniform(99, stream, static_cast<std::uint64_t>(i)) - 1.0f;
  return tensor;
}

/// Values whose magnitudes are at least 0.1 (so +-1e-2 perturbations never cross a ReLU kink).
inline Tensor away_from_zero(const Shape& shape, std::uint64_t stream) {
  Tensor tensor = random_tensor(shape, stream);
  for (std::int64_t i = 0; i < tensor.numel(); ++i) {
    float& value = tensor.data()[i];
    value = (value >= 0 ? 1.0f : -1.0f) * (0.1f + 0.9f * std::fabs(value));
  }
  return tensor;
}

/// Distinct values 0.05 apart in a random order (so perturbations never change a maximum).
inline Tensor distinct_values(const Shape& shape, std::uint64_t stream) {
  Tensor tensor(shape);
  const std::int64_t count = tensor.numel();
  std::vector<std::int64_t> order(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) order[static_cast<std::size_t>(i)] = i;
  for (std::int64_t i = count - 1; i > 0; --i) {
    const auto j = static_cast<std::int64_t>(random_u64(7, stream, static_cast<std::uint64_t>(i)) % static_cast<std::uint64_t>(i + 1));
    std::swap(order[static_cast<std::size_t>(i)], order[static_cast<std::size_t>(j)]);
  }
  for (std::int64_t i = 0; i < count; ++i)
    tensor.data()[i] = 0.05f * static_cast<float>(order[static_cast<std::size_t>(i)] - count / 2);
  return tensor;
}

struct GradientCheckOptions {
  double step = 1e-2;
  double tolerance = 2e-2;
  /// At most this many elements per tensor are perturbed (spread over the tensor).
  std::int64_t max_checks = 48;
};

class GradientChecker {
 public:
  GradientChecker(Layer& layer, std::vector<Tensor> inputs, LayerContext context)
      : layer_(layer), inputs_(std::move(inputs)), context_(context) {}

  double objective() {
    forward();
    double total = 0.0;
    for (std::int64_t i = 0; i < output_.numel(); ++i) total += static_cast<double>(output_.data()[i]) * probe_.data()[i];
    return total;
  }

  /// Checks every input's and every parameter's gradient.
  void check(const GradientCheckOptions& options = {}) {
    forward();
    probe_ = random_tensor(output_.shape(), 4242);
    ASSERT_GT(output_.numel(), 0);
    std::vector<Tensor> grad_inputs(inputs_.size());
    std::vector<Tensor*> grad_pointers;
    for (auto& g : grad_inputs) grad_pointers.push_back(&g);
    std::vector<const Tensor*> input_pointers = pointers();
    layer_.backward(input_pointers, output_, probe_, grad_pointers, context_);

    for (std::size_t k = 0; k < inputs_.size(); ++k)
      compare("input " + std::to_string(k), inputs_[k], grad_inputs[k], options);
    for (Parameter* parameter : layer_.parameters())
      compare("parameter " + parameter->name, parameter->value, parameter->grad.clone(), options);
  }

 private:
  std::vector<const Tensor*> pointers() const {
    std::vector<const Tensor*> result;
    for (const auto& t : inputs_) result.push_back(&t);
    return result;
  }
  void forward() { layer_.forward(pointers(), output_, context_); }

  void compare(const std::string& what, Tensor& variable, const Tensor& analytic, const GradientCheckOptions& options) {
    ASSERT_EQ(variable.shape().dims(), analytic.shape().dims()) << what;
    const std::int64_t count = variable.numel();
    double largest = 0.0;
    for (std::int64_t i = 0; i < count; ++i) largest = std::max(largest, std::fabs(static_cast<double>(analytic.data()[i])));
    // Gradients far below the tensor's largest one are compared absolutely: their finite
    // differences are dominated by fp32 rounding of the objective.
    const double floor = std::max(1e-2 * largest, 1e-4);
    const std::int64_t stride = std::max<std::int64_t>(1, count / options.max_checks);
    double worst = 0.0;
    for (std::int64_t i = 0; i < count; i += stride) {
      float& value = variable.data()[i];
      const float saved = value;
      value = static_cast<float>(saved + options.step);
      const double plus = objective();
      value = static_cast<float>(saved - options.step);
      const double minus = objective();
      value = saved;
      const double numeric = (plus - minus) / (2 * options.step);
      const double exact = analytic.data()[i];
      const double error = std::fabs(numeric - exact) / std::max({std::fabs(numeric), std::fabs(exact), floor});
      worst = std::max(worst, error);
      EXPECT_LT(error, options.tolerance) << layer_.type() << " " << what << " element " << i << ": analytic " << exact
                                          << ", finite difference " << numeric;
    }
    forward();  // leave the layer's saved state matching the unperturbed inputs
    ::testing::Test::RecordProperty(what, std::to_string(worst));
  }

  Layer& layer_;
  std::vector<Tensor> inputs_;
  LayerContext context_;
  Tensor output_;
  Tensor probe_;
};

/// Sets up a layer for these inputs, initializes its parameters (non-zero biases so their
/// gradients matter too) and runs the gradient check.
inline void check_layer_gradients(Layer& layer, std::vector<Tensor> inputs, DnnBackend& backend,
                                  const GradientCheckOptions& options = {}) {
  std::vector<Shape> shapes;
  for (const auto& t : inputs) shapes.push_back(t.shape());
  layer.setup(shapes);
  layer.init_parameters(11);
  std::uint64_t stream = 500;
  for (Parameter* parameter : layer.parameters())
    if (parameter->value.rank() == 1) parameter->value.copy_from(random_tensor(parameter->value.shape(), stream++));
  LayerContext context;
  context.backend = &backend;
  context.global_batch = inputs[0].dim(0);
  context.seed = 5;
  context.step = 2;
  GradientChecker(layer, std::move(inputs), context).check(options);
}

}  // namespace tessera::testing
