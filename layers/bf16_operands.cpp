#include "layers/bf16_operands.hpp"

#include <array>

#include "tessera/tensor/tensor.hpp"

namespace tessera {
namespace {

/// Grow-only buffers for the rounded operands, one per operand kind.
class RoundedOperands {
 public:
  enum Slot { kInput, kWeights, kGradOutput };

  RoundedOperands(ElementwiseKernels& kernels, Device device) : kernels_(kernels), device_(device) {}

  /// `values` rounded to bf16, in slot `slot`'s buffer (valid until the slot is used again).
  const float* operator()(Slot slot, const float* values, std::int64_t count) {
    Tensor& buffer = buffers_[static_cast<std::size_t>(slot)];
    buffer.resize(Shape{count}, device_);
    kernels_.round_to_bf16(values, buffer.data(), count);
    return buffer.data();
  }

  void release() {
    for (Tensor& buffer : buffers_) buffer = Tensor();
  }

  std::int64_t bytes() const {
    std::int64_t total = 0;
    for (const Tensor& buffer : buffers_) total += buffer.allocated_bytes();
    return total;
  }

 private:
  ElementwiseKernels& kernels_;
  Device device_;
  std::array<Tensor, 3> buffers_;
};

class Bf16OperandConvolution final : public ConvolutionKernels {
 public:
  Bf16OperandConvolution(std::unique_ptr<ConvolutionKernels> inner, ElementwiseKernels& kernels, Device device)
      : inner_(std::move(inner)), round_(kernels, device) {}

  bool fuses_leaky_relu(float slope) const override { return inner_->fuses_leaky_relu(slope); }

  void forward(const ConvolutionGeometry& g, const float* input, const float* weights, const float* bias,
               float* output) override {
    if (g.precision == Precision::F32) return inner_->forward(g, input, weights, bias, output);
    inner_->forward(g, round_(RoundedOperands::kInput, input, g.input_elements()),
                    round_(RoundedOperands::kWeights, weights, g.weight_elements()), bias, output);
  }

  void backward_data(const ConvolutionGeometry& g, const float* grad_output, const float* weights,
                     float* grad_input) override {
    if (g.precision == Precision::F32) return inner_->backward_data(g, grad_output, weights, grad_input);
    inner_->backward_data(g, round_(RoundedOperands::kGradOutput, grad_output, g.output_elements()),
                          round_(RoundedOperands::kWeights, weights, g.weight_elements()), grad_input);
  }

  void backward_weights(const ConvolutionGeometry& g, const float* input, const float* grad_output,
                        float* grad_weights, float* grad_bias) override {
    if (g.precision == Precision::F32) return inner_->backward_weights(g, input, grad_output, grad_weights, grad_bias);
    inner_->backward_weights(g, round_(RoundedOperands::kInput, input, g.input_elements()),
                             round_(RoundedOperands::kGradOutput, grad_output, g.output_elements()), grad_weights,
                             grad_bias);
  }

  void backward(const ConvolutionGeometry& g, const float* input, const float* grad_output, const float* weights,
                float* grad_input, float* grad_weights, float* grad_bias) override {
    if (g.precision == Precision::F32)
      return inner_->backward(g, input, grad_output, weights, grad_input, grad_weights, grad_bias);
    // Without grad_input the weights are not read.
    inner_->backward(g, round_(RoundedOperands::kInput, input, g.input_elements()),
                     round_(RoundedOperands::kGradOutput, grad_output, g.output_elements()),
                     grad_input ? round_(RoundedOperands::kWeights, weights, g.weight_elements()) : weights, grad_input,
                     grad_weights, grad_bias);
  }

  // In bf16 the output gradient is rounded as a whole: none is made from a pooling's.
  bool reads_pooled_gradient(const ConvolutionGeometry& g, const PoolingGeometry& pooling) override {
    return g.precision == Precision::F32 && inner_->reads_pooled_gradient(g, pooling);
  }
  void backward_weights_from_pooling(const ConvolutionGeometry& g, const float* input, const PooledGradient& pooled,
                                     float* grad_weights, float* grad_bias) override {
    if (g.precision != Precision::F32)
      return ConvolutionKernels::backward_weights_from_pooling(g, input, pooled, grad_weights, grad_bias);
    inner_->backward_weights_from_pooling(g, input, pooled, grad_weights, grad_bias);
  }
  void forward_pooled(const ConvolutionGeometry& g, const float* input, const float* weights, const float* bias,
                      const PooledOutput& pooled) override {
    if (g.precision != Precision::F32) return ConvolutionKernels::forward_pooled(g, input, weights, bias, pooled);
    inner_->forward_pooled(g, input, weights, bias, pooled);
  }

  std::int64_t scratch_bytes() const override { return round_.bytes() + inner_->scratch_bytes(); }
  void release_scratch() override {
    round_.release();
    inner_->release_scratch();
  }

 private:
  std::unique_ptr<ConvolutionKernels> inner_;
  RoundedOperands round_;
};

class Bf16OperandLinear final : public LinearKernels {
 public:
  Bf16OperandLinear(std::unique_ptr<LinearKernels> inner, ElementwiseKernels& kernels, Device device)
      : inner_(std::move(inner)), round_(kernels, device) {}

  void forward(const LinearGeometry& g, const float* input, const float* weights, const float* bias,
               float* output) override {
    if (g.precision == Precision::F32) return inner_->forward(g, input, weights, bias, output);
    inner_->forward(g, round_(RoundedOperands::kInput, input, g.batch * g.in_features),
                    round_(RoundedOperands::kWeights, weights, g.out_features * g.in_features), bias, output);
  }

  void backward_data(const LinearGeometry& g, const float* grad_output, const float* weights,
                     float* grad_input) override {
    if (g.precision == Precision::F32) return inner_->backward_data(g, grad_output, weights, grad_input);
    inner_->backward_data(g, round_(RoundedOperands::kGradOutput, grad_output, g.batch * g.out_features),
                          round_(RoundedOperands::kWeights, weights, g.out_features * g.in_features), grad_input);
  }

  void backward_weights(const LinearGeometry& g, const float* input, const float* grad_output, float* grad_weights,
                        float* grad_bias) override {
    if (g.precision == Precision::F32) return inner_->backward_weights(g, input, grad_output, grad_weights, grad_bias);
    inner_->backward_weights(g, round_(RoundedOperands::kInput, input, g.batch * g.in_features),
                             round_(RoundedOperands::kGradOutput, grad_output, g.batch * g.out_features),
                             grad_weights, grad_bias);
  }

  std::int64_t scratch_bytes() const override { return round_.bytes() + inner_->scratch_bytes(); }
  void release_scratch() override {
    round_.release();
    inner_->release_scratch();
  }

 private:
  std::unique_ptr<LinearKernels> inner_;
  RoundedOperands round_;
};

}  // namespace

std::unique_ptr<ConvolutionKernels> with_bf16_operands(std::unique_ptr<ConvolutionKernels> convolution,
                                                       ElementwiseKernels& kernels, Device device) {
  return std::make_unique<Bf16OperandConvolution>(std::move(convolution), kernels, device);
}

std::unique_ptr<LinearKernels> with_bf16_operands(std::unique_ptr<LinearKernels> linear, ElementwiseKernels& kernels,
                                                  Device device) {
  return std::make_unique<Bf16OperandLinear>(std::move(linear), kernels, device);
}

}  // namespace tessera
