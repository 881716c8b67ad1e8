// "flatten": N x anything -> N x features (a copy: the output must not alias the input, which
// the executor may reuse).
#include "layers/layer_common.hpp"

namespace tessera {
namespace {

class FlattenLayer final : public Layer {
 public:
  FlattenLayer(const std::string& name, int id) : Layer(name, id) {}

  std::string_view type() const override { return "flatten"; }
  // Backward reads the shape only.
  LayerTraits traits() const override {
    LayerTraits t;
    t.backward_reads_inputs = false;
    return t;
  }

  Shape setup(const std::vector<Shape>& inputs) override {
    check_input_count(*this, inputs, 1);
    input_shape_ = inputs[0];
    return Shape::flat(input_shape_[0], input_shape_.sample_numel());
  }

  void forward(std::span<const Tensor* const> inputs, Tensor& output, LayerContext& ctx) override {
    const Tensor& input = *inputs[0];
    check_same_sample_shape(*this, input_shape_, input.shape(), ctx);
    output.resize(Shape::flat(input.dim(0), input.shape().sample_numel()), input.device());
    output.copy_from(input.reshape(output.shape()));
  }

  void backward(std::span<const Tensor* const> inputs, const Tensor&, const Tensor& grad_output,
                std::span<Tensor* const> grad_inputs, LayerContext&) override {
    if (!grad_inputs[0]) return;
    grad_inputs[0]->resize(inputs[0]->shape(), inputs[0]->device());
    grad_inputs[0]->copy_from(grad_output.reshape(inputs[0]->shape()));
  }

 private:
  Shape input_shape_;
};

}  // namespace

std::unique_ptr<Layer> make_flatten_layer(const std::string& name, int id, LayerOptions&) {
  return std::make_unique<FlattenLayer>(name, id);
}

}  // namespace tessera
