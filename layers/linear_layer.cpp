// "linear": N x in -> N x out, weights out x in (PyTorch's layout), through the backend's matmuls.
#include "layers/layer_common.hpp"

namespace tessera {
namespace {

class LinearLayer final : public Layer {
 public:
  LinearLayer(const std::string& name, int id, LayerOptions& options)
      : Layer(name, id),
        out_features_(options.get_int("out")),
        bias_(options.get_bool("bias", true)) {
    geometry_.precision = parse_precision(options.get_string("precision", "fp32"), options.context());
    if (out_features_ < 1) fail_layer(*this, "parameter 'out' must be at least 1, got {}", out_features_);
  }

  std::string_view type() const override { return "linear"; }

  Shape setup(const std::vector<Shape>& inputs) override {
    check_input_count(*this, inputs, 1);
    const Shape& input = inputs[0];
    if (input.rank() != 2)
      fail_layer(*this, "needs an N x features input, got {} (put a flatten layer before it)", input.to_string());
    input_shape_ = input;
    geometry_.in_features = input[1];
    geometry_.out_features = out_features_;
    geometry_.bias = bias_;
    weights_ = whole_parameter(*this, "weight", {out_features_, geometry_.in_features}, true);
    if (bias_) bias_parameter_ = whole_parameter(*this, "bias", {out_features_}, false);
    return Shape::flat(input[0], out_features_);
  }

  bool model_splittable() const override { return true; }
  Precision precision() const override { return geometry_.precision; }
  LayerTraits traits() const override {
    LayerTraits t;
    t.backward_reads_fp32 = geometry_.precision == Precision::F32;
    return t;
  }

  void set_model_split(const ModelSplit& split) override {
    if (split == model_split_) return;  // a second executor on the same model
    TESSERA_CHECK(model_split_.none(), "{}: split twice, differently", describe(*this));
    const std::int64_t in = geometry_.in_features;
    if (split.filter_parts > out_features_ || split.channel_parts > in)
      fail_layer(*this, "cannot cut {} output features into {} filter parts and {} input features into {} channel parts",
                 out_features_, split.filter_parts, in, split.channel_parts);
    model_split_ = split;
    if (split.none()) return;
    const std::int64_t fb = block_begin(out_features_, split.filter_parts, split.filter_coord);
    const std::int64_t fe = block_extent(out_features_, split.filter_parts, split.filter_coord);
    const std::int64_t cb = block_begin(in, split.channel_parts, split.channel_coord);
    const std::int64_t ce = block_extent(in, split.channel_parts, split.channel_coord);
    shard_parameter(weights_, Box{{fb, cb}, {fe, ce}});
    if (bias_) {
      shard_parameter(bias_parameter_, Box{{fb}, {fe}});
      bias_parameter_.replicated_over_channels = split.channel_parts > 1;
    }
    geometry_.in_features = ce;
    geometry_.out_features = fe;
    geometry_.bias = adds_bias();
    input_shape_ = Shape::flat(input_shape_[0], ce);
  }

  std::vector<Parameter*> parameters() override {
    if (bias_) return {&weights_, &bias_parameter_};
    return {&weights_};
  }

  void init_parameters(std::uint64_t seed) override {
    // fan_in: the whole layer's input features, whatever block this rank holds.
    const std::int64_t fan_in = weights_.sharded() ? weights_.global_shape[1] : geometry_.in_features;
    he_uniform_init(weights_, seed, id(), 0, fan_in);
    if (bias_) bias_parameter_.value.zero();
  }

  void forward(std::span<const Tensor* const> inputs, Tensor& output, LayerContext& ctx) override {
    const Tensor& input = *inputs[0];
    check_same_sample_shape(*this, input_shape_, input.shape(), ctx);
    geometry_.batch = input.dim(0);
    output.resize(Shape::flat(geometry_.batch, geometry_.out_features), input.device());
    if (geometry_.batch == 0) return;
    backend_of(*this, ctx).linear().forward(geometry_, input.data(), weights_.value.data(),
                                             adds_bias() ? bias_parameter_.value.data() : nullptr, output.data());
  }

  void backward(std::span<const Tensor* const> inputs, const Tensor&, const Tensor& grad_output,
                std::span<Tensor* const> grad_inputs, LayerContext& ctx) override {
    const Tensor& input = *inputs[0];
    geometry_.batch = input.dim(0);
    if (grad_inputs[0]) grad_inputs[0]->resize(input.shape(), input.device());
    if (geometry_.batch == 0) {
      weights_.grad.zero();
      if (bias_) bias_parameter_.grad.zero();
      return;
    }
    auto& kernels = backend_of(*this, ctx).linear();
    if (grad_inputs[0]) kernels.backward_data(geometry_, grad_output.data(), weights_.value.data(), grad_inputs[0]->data());
    kernels.backward_weights(geometry_, input.data(), grad_output.data(), weights_.grad.data(),
                             adds_bias() ? bias_parameter_.grad.data() : nullptr);
    if (bias_ && !adds_bias()) bias_parameter_.grad.zero();  // the bias is channel block 0's
  }

 private:
  /// Of a channel-split layer's partial sums only channel block 0's adds the bias.
  bool adds_bias() const { return bias_ && model_split_.channel_coord == 0; }

  std::int64_t out_features_;
  bool bias_;
  Shape input_shape_;
  LinearGeometry geometry_;
  Parameter weights_, bias_parameter_;
};

}  // namespace

std::unique_ptr<Layer> make_linear_layer(const std::string& name, int id, LayerOptions& options) {
  return std::make_unique<LinearLayer>(name, id, options);
}

}  // namespace tessera
