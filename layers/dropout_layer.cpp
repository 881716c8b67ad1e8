// "dropout": inverted dropout (kept elements scaled by 1 / (1 - rate) in training, identity in
// evaluation). Each element's keep/drop draw is keyed by its global index in the batch, so a
// batch split over ranks drops exactly what one rank would. The draws are made on the host and
// applied by the backend's element-wise kernels, so a GPU run drops exactly what a host run does.
#include <cstdint>

#include "layers/host_loops.hpp"
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
    const std::int64_t count = input.numel(), sample_numel = input.shape().sample_numel();
    // Scale per element (0 or 1 / (1 - rate)): backward multiplies by the same factors.
    scales_.resize(Shape({count}), Device::host());
    const std::uint64_t seed = ctx.seed;
    const std::uint64_t stream = rng_substream(RngStream::Dropout, static_cast<std::uint64_t>(id()),
                                               static_cast<std::uint64_t>(ctx.step));
    const float rate = static_cast<float>(rate_);
    const float keep_scale = static_cast<float>(1.0 / (1.0 - rate_));
    float* scales = scales_.data();
    // The masks are drawn on the host (the counter-based stream, keyed by global index, the same on
    // every device), then applied where the tensors are.
    const auto apply = [&] {
      const float* factors = scales;
      if (!input.device().is_host()) {
        device_scales_.resize(Shape({count}), input.device());
        device_scales_.copy_from(scales_);
        factors = device_scales_.data();
      }
      kernels.multiply(input.data(), factors, output.data(), count);
    };
    if (!ctx.tile && model_split_.none()) {
      const std::uint64_t first = static_cast<std::uint64_t>(ctx.sample_offset * sample_numel);
      host_for("dropout masks", count, [=](std::int64_t i) {
        const bool keep = random_uniform(seed, stream, first + static_cast<std::uint64_t>(i)) >= rate;
        scales[i] = keep ? keep_scale : 0.0f;
      });
      apply();
      return;
    }
    // On a spatial tile or a block of the channels: the global index of each local element, from
    // the tile's position in the global N x C x (D) x H x W tensor (2-D tiles as depth 1, features
    // as 0-D samples).
    std::int64_t local[3] = {1, 1, 1}, global[3] = {1, 1, 1}, origin[3] = {0, 0, 0};
    const std::size_t dims = static_cast<std::size_t>(input.rank() - 2), shift = 3 - dims;
    for (std::size_t i = 0; i < dims; ++i) {
      local[i + shift] = input.dim(static_cast<int>(i) + 2);
      global[i + shift] = ctx.tile ? ctx.tile->output_global[i] : local[i + shift];
      origin[i + shift] = ctx.tile ? ctx.tile->output_begin[i] : 0;
    }
    const std::int64_t channels = input.dim(1), offset = ctx.sample_offset;
    const std::int64_t global_channels = model_split_.none() ? channels : global_channels_;
    const std::int64_t channel_offset = model_split_.none() ? 0 : channel_offset_;
    host_for("dropout masks (tile)", input.dim(0) * channels, [=](std::int64_t plane) {
      const std::int64_t n = plane / channels, c = plane % channels;
      const std::int64_t global_plane = (offset + n) * global_channels + channel_offset + c;
      std::int64_t i = plane * local[0] * local[1] * local[2];
      for (std::int64_t d = 0; d < local[0]; ++d)
        for (std::int64_t h = 0; h < local[1]; ++h)
          for (std::int64_t w = 0; w < local[2]; ++w, ++i) {
            const std::int64_t g =
                ((global_plane * global[0] + origin[0] + d) * global[1] + origin[1] + h) * global[2] + origin[2] + w;
            const bool keep = random_uniform(seed, stream, static_cast<std::uint64_t>(g)) >= rate;
            scales[i] = keep ? keep_scale : 0.0f;
          }
    });
    apply();
  }

  void backward(std::span<const Tensor* const> inputs, const Tensor&, const Tensor& grad_output,
                std::span<Tensor* const> grad_inputs, LayerContext& ctx) override {
    if (!grad_inputs[0]) return;
    grad_inputs[0]->resize(inputs[0]->shape(), grad_output.device());
    if (!applied_) {
      grad_inputs[0]->copy_from(grad_output);
      return;
    }
    const float* factors = grad_output.device().is_host() ? scales_.data() : device_scales_.data();
    elementwise_of(ctx, grad_output).multiply(grad_output.data(), factors, grad_inputs[0]->data(), grad_output.numel());
  }

 private:
  double rate_;
  Shape input_shape_;
  std::int64_t global_channels_ = 0, channel_offset_ = 0;
  bool applied_ = false;
  Tensor scales_;         ///< per element: 0 or 1 / (1 - rate), on the host
  Tensor device_scales_;  ///< scales_ on the GPU, when the layer runs on one
};

}  // namespace

std::unique_ptr<Layer> make_dropout_layer(const std::string& name, int id, LayerOptions& options) {
  return std::make_unique<DropoutLayer>(name, id, options);
}

}  // namespace tessera
