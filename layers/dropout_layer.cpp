// "dropout": inverted dropout (kept elements scaled by 1 / (1 - rate) in training, identity in
// evaluation). Each element's keep/drop draw is keyed by its global index in the batch, so a
// batch split over ranks drops exactly what one rank would. The draws are made where the tensor
// is (ElementwiseKernels::dropout_scales, one formula for host and GPU: tessera/layers/dropout_mask.hpp),
// so a GPU run drops exactly what a host run does.
#include <cstdint>

#include "layers/layer_common.hpp"
#include "tessera/core/rng.hpp"

namespace tessera {
namespace {

class DropoutLayer final : public Layer {
 public:
  DropoutLayer(const std::string& name, int id, LayerOptions& options)
      : Layer(name, id), rate_(options.get_float("rate", 0.5)) {
    if (!(rate_ >= 0 && rate_ < 1)) fail_layer(*this, "parameter 'rate' must be in [0, 1), got {}", rate_);
  }

  std::string_view type() const override { return "dropout"; }
  // Backward reads its scales, not its input.
  LayerTraits traits() const override {
    LayerTraits t;
    t.backward_reads_inputs = false;
    return t;
  }
  bool spatially_splittable() const override { return true; }
  bool filter_splittable() const override { return true; }

  void set_model_split(const ModelSplit& split) override {
    if (split == model_split_) return;
    Layer::set_model_split(split);
    // This rank's block of the channels (features); the masks stay keyed by global index.
    global_channels_ = input_shape_[1];
    const Box block = filter_block(*this, split, global_channels_);
    channel_offset_ = block.begin[0];
    input_shape_ = input_shape_.with(1, block.extent[0]);
  }

  Shape setup(const std::vector<Shape>& inputs) override {
    check_input_count(*this, inputs, 1);
    if (inputs[0].rank() > 5)
      fail_layer(*this, "takes N x features or N x C x (D) x H x W inputs, got {}", inputs[0].to_string());
    input_shape_ = inputs[0];
    return input_shape_;
  }

  void forward(std::span<const Tensor* const> inputs, Tensor& output, LayerContext& ctx) override {
    const Tensor& input = *inputs[0];
    check_same_sample_shape(*this, input_shape_, input.shape(), ctx);
    ElementwiseKernels& kernels = elementwise_of(ctx, input);
    output.resize(input.shape(), input.device());
    applied_ = ctx.training && rate_ > 0;
    if (!applied_) {
      output.copy_from(input);
      return;
    }
    // The scales (0 or 1 / (1 - rate)) drawn where the tensor is; backward multiplies by them too.
    // Local element -> global index: the tile's position in the global N x C x (D) x H x W tensor
    // (2-D tiles as depth 1, features as 0-D samples), the channel block's in the channels.
    DropoutMask mask;
    mask.seed = ctx.seed;
    mask.stream = rng_substream(RngStream::Dropout, static_cast<std::uint64_t>(id()), static_cast<std::uint64_t>(ctx.step));
    mask.rate = static_cast<float>(rate_);
    mask.keep_scale = static_cast<float>(1.0 / (1.0 - rate_));
    const std::size_t dims = static_cast<std::size_t>(input.rank() - 2), shift = 3 - dims;
    for (std::size_t i = 0; i < dims; ++i) {
      mask.local[i + shift] = input.dim(static_cast<int>(i) + 2);
      mask.global[i + shift] = ctx.tile ? ctx.tile->output_global[i] : mask.local[i + shift];
      mask.origin[i + shift] = ctx.tile ? ctx.tile->output_begin[i] : 0;
    }
    mask.channels = input.dim(1);
    mask.sample_offset = ctx.sample_offset;
    mask.global_channels = model_split_.none() ? mask.channels : global_channels_;
    mask.channel_offset = model_split_.none() ? 0 : channel_offset_;
    mask.whole = !ctx.tile && model_split_.none();  // the same index as the general form, without divisions
    mask.first = ctx.sample_offset * input.shape().sample_numel();
    scales_.resize(Shape({input.numel()}), input.device());
    kernels.dropout_scales(mask, scales_.data(), input.numel());
    kernels.multiply(input.data(), scales_.data(), output.data(), input.numel());
  }

  std::int64_t workspace_bytes() const override { return scales_.allocated_bytes(); }

  void backward(std::span<const Tensor* const> inputs, const Tensor&, const Tensor& grad_output,
                std::span<Tensor* const> grad_inputs, LayerContext& ctx) override {
    if (!grad_inputs[0]) return;
    grad_inputs[0]->resize(inputs[0]->shape(), grad_output.device());
    if (!applied_) {
      grad_inputs[0]->copy_from(grad_output);
      return;
    }
    elementwise_of(ctx, grad_output).multiply(grad_output.data(), scales_.data(), grad_inputs[0]->data(),
                                              grad_output.numel());
  }

 private:
  double rate_;
  Shape input_shape_;
  std::int64_t global_channels_ = 0, channel_offset_ = 0;
  bool applied_ = false;
  Tensor scales_;  ///< per element: 0 or 1 / (1 - rate), on the input's device
};

}  // namespace

std::unique_ptr<Layer> make_dropout_layer(const std::string& name, int id, LayerOptions& options) {
  return std::make_unique<DropoutLayer>(name, id, options);
}

}  // namespace tessera
