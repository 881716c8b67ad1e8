// "add" (element-wise sum of same-shaped inputs) and "concat" (along the channel dimension 1).
#include "layers/layer_common.hpp"

namespace tessera {
namespace {

class AddLayer final : public Layer {
 public:
  AddLayer(const std::string& name, int id) : Layer(name, id) {}

  std::string_view type() const override { return "add"; }
  // Backward reads the shapes only.
  LayerTraits traits() const override {
    LayerTraits t;
    t.backward_reads_inputs = false;
    return t;
  }
  bool spatially_splittable() const override { return true; }
  int arity() const override { return -1; }

  Shape setup(const std::vector<Shape>& inputs) override {
    check_input_count(*this, inputs, -1);
    for (const auto& shape : inputs)
      if (shape != inputs[0]) fail_layer(*this, "inputs must have the same shape, got {}", shapes_to_string(inputs));
    input_shape_ = inputs[0];
    return inputs[0];
  }

  void forward(std::span<const Tensor* const> inputs, Tensor& output, LayerContext& ctx) override {
    for (const Tensor* input : inputs) {
      check_same_sample_shape(*this, input_shape_, input->shape(), ctx);
      check_same_device(*this, *inputs[0], *input);
      if (input->dim(0) != inputs[0]->dim(0))
        fail_layer(*this, "inputs have different batch extents: {} and {}", inputs[0]->shape().to_string(),
                   input->shape().to_string());
    }
    output.resize(inputs[0]->shape(), inputs[0]->device());
    output.copy_from(*inputs[0]);
    auto& kernels = elementwise_of(ctx, output);
    for (std::size_t k = 1; k < inputs.size(); ++k) kernels.accumulate(inputs[k]->data(), output.data(), output.numel());
  }

  void backward(std::span<const Tensor* const> inputs, const Tensor&, const Tensor& grad_output,
                std::span<Tensor* const> grad_inputs, LayerContext&) override {
    for (Tensor* grad : grad_inputs) {
      if (!grad) continue;
      grad->resize(grad_output.shape(), grad_output.device());
      grad->copy_from(grad_output);
    }
  }

 private:
  Shape input_shape_;
};

class ConcatLayer final : public Layer {
 public:
  ConcatLayer(const std::string& name, int id) : Layer(name, id) {}

  std::string_view type() const override { return "concat"; }
  // Backward reads the shapes only.
  LayerTraits traits() const override {
    LayerTraits t;
    t.backward_reads_inputs = false;
    return t;
  }
  bool spatially_splittable() const override { return true; }
  int arity() const override { return -1; }

  Shape setup(const std::vector<Shape>& inputs) override {
    check_input_count(*this, inputs, -1);
    std::int64_t channels = 0;
    for (const auto& shape : inputs) {
      if (shape.rank() != inputs[0].rank() || shape.with(1, 0) != inputs[0].with(1, 0))
        fail_layer(*this, "inputs must agree in every dimension but the channels (1), got {}",
                   shapes_to_string(inputs));
      channels += shape[1];
    }
    input_shapes_ = inputs;
    return inputs[0].with(1, channels);
  }

  void forward(std::span<const Tensor* const> inputs, Tensor& output, LayerContext& ctx) override {
    const std::int64_t batch = inputs[0]->dim(0);
    for (std::size_t k = 0; k < inputs.size(); ++k) {
      check_same_sample_shape(*this, input_shapes_[k], inputs[k]->shape(), ctx);
      check_same_device(*this, *inputs[0], *inputs[k]);
      if (inputs[k]->dim(0) != batch)
        fail_layer(*this, "inputs have different batch extents: {} and {}", inputs[0]->shape().to_string(),
                   inputs[k]->shape().to_string());
    }
    Shape shape = inputs[0]->shape();
    shape[1] = 0;
    for (const Tensor* input : inputs) shape[1] += input->dim(1);
    output.resize(shape, inputs[0]->device());
    // Per sample, each input contributes one contiguous block of (its channels x spatial).
    const std::int64_t output_block = output.shape().sample_numel();
    auto& kernels = elementwise_of(ctx, output);
    std::int64_t offset = 0;
    for (const Tensor* input : inputs) {
      const std::int64_t block = input->shape().sample_numel();
      kernels.copy_rows(input->data(), block, output.data() + offset, output_block, batch, block);
      offset += block;
    }
  }

  void backward(std::span<const Tensor* const> inputs, const Tensor&, const Tensor& grad_output,
                std::span<Tensor* const> grad_inputs, LayerContext& ctx) override {
    const std::int64_t batch = grad_output.dim(0), output_block = grad_output.shape().sample_numel();
    auto& kernels = elementwise_of(ctx, grad_output);
    std::int64_t offset = 0;
    for (std::size_t k = 0; k < inputs.size(); ++k) {
      const std::int64_t block = inputs[k]->shape().sample_numel();
      if (Tensor* grad = grad_inputs[k]) {
        grad->resize(inputs[k]->shape(), grad_output.device());
        kernels.copy_rows(grad_output.data() + offset, output_block, grad->data(), block, batch, block);
      }
      offset += block;
    }
  }

 private:
  std::vector<Shape> input_shapes_;
};

}  // namespace

std::unique_ptr<Layer> make_add_layer(const std::string& name, int id, LayerOptions&) {
  return std::make_unique<AddLayer>(name, id);
}

std::unique_ptr<Layer> make_concat_layer(const std::string& name, int id, LayerOptions&) {
  return std::make_unique<ConcatLayer>(name, id);
}

}  // namespace tessera
