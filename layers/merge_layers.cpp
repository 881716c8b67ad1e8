// "add" (element-wise sum of same-shaped inputs) and "concat" (along the channel dimension 1).
#include <cstring>

#include "layers/host_loops.hpp"
#include "layers/layer_common.hpp"

namespace tessera {
namespace {

class AddLayer final : public Layer {
 public:
  AddLayer(const std::string& name, int id) : Layer(name, id) {}

  std::string_view type() const override { return "add"; }
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
      check_on_host(*this, *input);
      if (input->dim(0) != inputs[0]->dim(0))
        fail_layer(*this, "inputs have different batch extents: {} and {}", inputs[0]->shape().to_string(),
                   input->shape().to_string());
    }
    output.resize(inputs[0]->shape());
    float* y = output.data();
    const float* first = inputs[0]->data();
    host_for("add copy", output.numel(), [=](std::int64_t i) { y[i] = first[i]; });
    for (std::size_t k = 1; k < inputs.size(); ++k) {
      const float* x = inputs[k]->data();
      host_for("add accumulate", output.numel(), [=](std::int64_t i) { y[i] += x[i]; });
    }
  }

  void backward(std::span<const Tensor* const> inputs, const Tensor&, const Tensor& grad_output,
                std::span<Tensor* const> grad_inputs, LayerContext&) override {
    for (Tensor* grad : grad_inputs) {
      if (!grad) continue;
      grad->resize(grad_output.shape());
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
      check_on_host(*this, *inputs[k]);
      if (inputs[k]->dim(0) != batch)
        fail_layer(*this, "inputs have different batch extents: {} and {}", inputs[0]->shape().to_string(),
                   inputs[k]->shape().to_string());
    }
    Shape shape = inputs[0]->shape();
    shape[1] = 0;
    for (const Tensor* input : inputs) shape[1] += input->dim(1);
    output.resize(shape);
    // Per sample, each input contributes one contiguous block of (its channels x spatial).
    const std::int64_t output_block = output.shape().sample_numel();
    std::int64_t offset = 0;
    for (const Tensor* input : inputs) {
      const std::int64_t block = input->shape().sample_numel();
      const float* x = input->data();
      float* y = output.data() + offset;
      host_for("concat forward", batch, [=](std::int64_t n) {
        std::memcpy(y + n * output_block, x + n * block, static_cast<std::size_t>(block) * sizeof(float));
      });
      offset += block;
    }
  }

  void backward(std::span<const Tensor* const> inputs, const Tensor&, const Tensor& grad_output,
                std::span<Tensor* const> grad_inputs, LayerContext&) override {
    const std::int64_t batch = grad_output.dim(0), output_block = grad_output.shape().sample_numel();
    std::int64_t offset = 0;
    for (std::size_t k = 0; k < inputs.size(); ++k) {
      const std::int64_t block = inputs[k]->shape().sample_numel();
      if (Tensor* grad = grad_inputs[k]) {
        grad->resize(inputs[k]->shape());
        const float* dy = grad_output.data() + offset;
        float* dx = grad->data();
        host_for("concat backward", batch, [=](std::int64_t n) {
          std::memcpy(dx + n * block, dy + n * output_block, static_cast<std::size_t>(block) * sizeof(float));
        });
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
