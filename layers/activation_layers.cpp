// "relu" and "leaky_relu" (slope for negative inputs; relu is slope 0). Both run in place
// (LayerTraits::runs_in_place) when the slope is >= 0: the kernels read and write element by element,
// so the input and output (and the output and input gradients) may be the same tensor.
#include "layers/layer_common.hpp"

namespace tessera {
namespace {

class LeakyReluLayer final : public Layer {
 public:
  LeakyReluLayer(const std::string& name, int id, float slope, std::string_view type)
      : Layer(name, id), slope_(slope), type_(type) {}

  std::string_view type() const override { return type_; }
  bool spatially_splittable() const override { return true; }
  bool filter_splittable() const override { return true; }
  // The output has the input's sign (a slope >= 0), and backward only reads the sign (x > 0).
  LayerTraits traits() const override {
    LayerTraits t;
    t.runs_in_place = slope_ >= 0.0f;
    if (t.runs_in_place) t.leaky_relu_slope = slope_;
    return t;
  }

  void set_model_split(const ModelSplit& split) override {
    if (split == model_split_) return;
    Layer::set_model_split(split);
    // Point-wise: this rank's block of the channels (features) in, the same block out.
    input_shape_ = input_shape_.with(1, filter_block(*this, split, input_shape_[1]).extent[0]);
  }

  Shape setup(const std::vector<Shape>& inputs) override {
    check_input_count(*this, inputs, 1);
    input_shape_ = inputs[0];
    return input_shape_;
  }

  void forward(std::span<const Tensor* const> inputs, Tensor& output, LayerContext& ctx) override {
    const Tensor& input = *inputs[0];
    check_same_sample_shape(*this, input_shape_, input.shape(), ctx);
    output.resize(input.shape(), input.device());
    elementwise_of(ctx, input).leaky_relu_forward(input.data(), output.data(), input.numel(), slope_);
  }

  void backward(std::span<const Tensor* const> inputs, const Tensor&, const Tensor& grad_output,
                std::span<Tensor* const> grad_inputs, LayerContext& ctx) override {
    if (!grad_inputs[0]) return;
    const Tensor& input = *inputs[0];
    grad_inputs[0]->resize(input.shape(), input.device());
    elementwise_of(ctx, input).leaky_relu_backward(input.data(), grad_output.data(), grad_inputs[0]->data(),
                                                   input.numel(), slope_);
  }

 private:
  float slope_;
  std::string_view type_;
  Shape input_shape_;
};

}  // namespace

std::unique_ptr<Layer> make_relu_layer(const std::string& name, int id, LayerOptions&) {
  return std::make_unique<LeakyReluLayer>(name, id, 0.0f, "relu");
}

std::unique_ptr<Layer> make_leaky_relu_layer(const std::string& name, int id, LayerOptions& options) {
  const double slope = options.get_float("slope", 0.01);
  return std::make_unique<LeakyReluLayer>(name, id, static_cast<float>(slope), "leaky_relu");
}

}  // namespace tessera
