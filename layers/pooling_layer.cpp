// "maxpool" and "avgpool" (average over the window's part inside the input), 2-D or 3-D.
#include <cstddef>

#include "layers/layer_common.hpp"

namespace tessera {
namespace {

class PoolingLayer final : public Layer {
 public:
  PoolingLayer(const std::string& name, int id, LayerOptions& options, PoolingMode mode)
      : Layer(name, id),
        mode_(mode),
        kernel_(options.get_int_list("kernel", {})),
        stride_(options.get_int_list("stride", kernel_)),
        padding_(options.get_int_list("padding", {0})) {
    for (auto k : kernel_) if (k < 1) fail_layer(*this, "parameter 'kernel' must be at least 1, got {}", k);
    for (auto s : stride_) if (s < 1) fail_layer(*this, "parameter 'stride' must be at least 1, got {}", s);
    for (auto p : padding_) if (p < 0) fail_layer(*this, "parameter 'padding' must not be negative, got {}", p);
  }

  std::string_view type() const override { return mode_ == PoolingMode::Max ? "maxpool" : "avgpool"; }
  bool spatially_splittable() const override { return true; }
  bool filter_splittable() const override { return true; }
  // Backward reads the maxima's positions (max) or nothing (average) and, through a leaky ReLU,
  // the output: never the input's values.
  LayerTraits traits() const override {
    LayerTraits t;
    t.backward_reads_inputs = false;
    t.fuses_leaky_relu_backward = windows_apart();
    t.writes_into_window = true;
    t.pools_in_pairs = pools_in_pairs();
    return t;
  }
  // Max pooling whose windows do not overlap (after setup: per dimension): each input takes one
  // output's gradient at most, so the product is the two passes' to the bit.
  /// Max pooling of windows 2 wide and high (1 or 2 deep) at their own stride, without padding.
  bool pools_in_pairs() const {
    if (mode_ != PoolingMode::Max || geometry_.kernel.empty()) return false;
    const std::size_t dims = geometry_.kernel.size();
    for (std::size_t d = 0; d < dims; ++d) {
      const bool pair = geometry_.kernel[d] == 2 || (dims == 3 && d == 0 && geometry_.kernel[d] == 1);
      if (!pair || geometry_.stride[d] != geometry_.kernel[d] || geometry_.padding[d] != 0) return false;
    }
    return true;
  }

  /// Forward's geometry (call_) for an input of `input` (on a tile: the local window), its output
  /// sized (or, given LayerContext::output_offset, checked as the reader's window that holds it)
  /// and its workspace; false where there are no samples.
  bool prepare(const Shape& input, Device device, Tensor& output, LayerContext& ctx) {
    check_same_sample_shape(*this, input_shape_, input, ctx);
    call_ = geometry_;
    call_.batch = input[0];
    if (ctx.tile) {
      // On a tile: windows in global coordinates, clipped to the global input, read from the
      // local window that starts at tile->window_begin.
      call_.input_size = spatial_extents(input);
      call_.output_size = ctx.tile->output_extent;
      call_.input_origin = ctx.tile->window_begin;
      call_.global_input_size = ctx.tile->input_global;
      call_.output_origin = ctx.tile->output_begin;
    }
    const Shape shape = Shape::image(call_.batch, call_.channels, call_.output_size);
    if (ctx.output_offset.empty()) {
      output.resize(shape, device);
    } else {
      // Into the reader's window, which holds the output from output_offset.
      TESSERA_CHECK(output.rank() == shape.rank() && output.dim(0) == shape[0] && output.dim(1) == shape[1] &&
                        output.device() == device,
                    "{}: a window of {} to pool {} into (executor bug)", describe(*this), output.shape().to_string(),
                    shape.to_string());
      call_.output_within = spatial_extents(output.shape());
      call_.output_offset = ctx.output_offset;
    }
    if (call_.batch == 0) return false;
    const std::size_t bytes = backend_of(*this, ctx).pooling().workspace_bytes(call_);
    workspace_.resize(Shape({static_cast<std::int64_t>((bytes + sizeof(float) - 1) / sizeof(float))}), device);
    return true;
  }

  bool windows_apart() const {
    if (mode_ != PoolingMode::Max || geometry_.kernel.empty()) return false;
    for (std::size_t d = 0; d < geometry_.kernel.size(); ++d)
      if (geometry_.stride[d] < geometry_.kernel[d]) return false;
    return true;
  }

  void set_model_split(const ModelSplit& split) override {
    if (split == model_split_) return;
    Layer::set_model_split(split);
    // Per channel: this rank pools its block of the channels.
    geometry_.channels = filter_block(*this, split, input_shape_[1]).extent[0];
    input_shape_ = input_shape_.with(1, geometry_.channels);
  }

  Shape setup(const std::vector<Shape>& inputs) override {
    check_input_count(*this, inputs, 1);
    const Shape& input = inputs[0];
    if (input.rank() != 4 && input.rank() != 5)
      fail_layer(*this, "needs an N x C x H x W or N x C x D x H x W input, got {}", input.to_string());
    const int dims = input.rank() - 2;
    geometry_.mode = mode_;
    geometry_.channels = input[1];
    geometry_.input_size = spatial_extents(input);
    geometry_.kernel = expand_per_dimension(*this, "kernel", kernel_, dims);
    geometry_.stride = expand_per_dimension(*this, "stride", stride_, dims);
    geometry_.padding = expand_per_dimension(*this, "padding", padding_, dims);
    geometry_.output_size.clear();
    for (int i = 0; i < dims; ++i) {
      const auto u = static_cast<std::size_t>(i);
      // Padding smaller than the kernel keeps every window overlapping the input, so no
      // average divides by zero and no maximum is taken over padding alone.
      if (geometry_.padding[u] >= geometry_.kernel[u])
        fail_layer(*this, "padding {} must be smaller than the kernel {}", geometry_.padding[u], geometry_.kernel[u]);
      const std::int64_t padded = geometry_.input_size[u] + 2 * geometry_.padding[u];
      if (geometry_.kernel[u] > padded)
        fail_layer(*this, "kernel {} is larger than the padded input ({}) in spatial dimension {} of input {}",
                   geometry_.kernel[u], padded, i, input.to_string());
      geometry_.output_size.push_back((padded - geometry_.kernel[u]) / geometry_.stride[u] + 1);
    }
    input_shape_ = input;
    return Shape::image(input[0], input[1], geometry_.output_size);
  }

  SpatialWindow spatial_window(int dim) const override {
    const auto u = static_cast<std::size_t>(dim);
    return {geometry_.kernel[u], geometry_.stride[u], geometry_.padding[u]};
  }

  void forward(std::span<const Tensor* const> inputs, Tensor& output, LayerContext& ctx) override {
    const Tensor& input = *inputs[0];
    if (!prepare(input.shape(), input.device(), output, ctx)) return;
    backend_of(*this, ctx)
        .pooling()
        .forward(call_, input.data(), output.data(), workspace_.empty() ? nullptr : workspace_.data());
  }

  std::optional<PooledOutput> pooled_output(const Shape& input, Device device, Tensor& output,
                                            LayerContext& ctx) override {
    if (!pools_in_pairs()) return std::nullopt;
    if (!prepare(input, device, output, ctx)) return PooledOutput{&call_, nullptr, nullptr};
    return PooledOutput{&call_, output.data(), reinterpret_cast<std::int32_t*>(workspace_.data())};
  }

  std::int64_t workspace_bytes() const override { return workspace_.allocated_bytes(); }

  std::optional<PooledGradient> pooled_gradient(const Tensor& output, const Tensor& grad_output,
                                                std::optional<float> leaky_relu) const override {
    if (!pools_in_pairs() || call_.batch == 0 || workspace_.empty()) return std::nullopt;
    TESSERA_CHECK(!leaky_relu || output.shape() == grad_output.shape(),
                  "{}: a pooled gradient through a leaky ReLU needs the output (executor bug)", describe(*this));
    PooledGradient pooled;
    pooled.geometry = &call_;
    pooled.grad_output = grad_output.data();
    pooled.workspace = workspace_.data();
    pooled.output = leaky_relu ? output.data() : nullptr;
    pooled.slope = leaky_relu.value_or(0.0f);
    return pooled;
  }

  void backward(std::span<const Tensor* const> inputs, const Tensor& output, const Tensor& grad_output,
                std::span<Tensor* const> grad_inputs, LayerContext& ctx) override {
    if (!grad_inputs[0]) return;
    const Tensor& input = *inputs[0];
    grad_inputs[0]->resize(input.shape(), input.device());
    if (call_.batch == 0) return;
    if (ctx.leaky_relu_before) {
      TESSERA_CHECK(windows_apart(), "{}: a leaky ReLU's backward fused into pooling whose windows "
                    "overlap (executor bug)", describe(*this));
      TESSERA_CHECK(output.shape() == grad_output.shape(), "{}: backward through a leaky ReLU needs the output "
                    "(executor bug)", describe(*this));
      backend_of(*this, ctx).pooling().max_backward_through_leaky_relu(call_, grad_output.data(), workspace_.data(),
                                                                       output.data(), *ctx.leaky_relu_before,
                                                                       grad_inputs[0]->data());
      return;
    }
    backend_of(*this, ctx).pooling().backward(call_, grad_output.data(),
                                              workspace_.empty() ? nullptr : workspace_.data(),
                                              grad_inputs[0]->data());
  }

 private:
  PoolingMode mode_;
  std::vector<std::int64_t> kernel_, stride_, padding_;
  Shape input_shape_;
  PoolingGeometry geometry_;
  /// The geometry of the last forward call (whole samples or a tile); backward reuses it.
  PoolingGeometry call_;
  /// Where forward's maxima were, for backward (opaque; sized by the backend; on the input's device).
  Tensor workspace_;
};

}  // namespace

std::unique_ptr<Layer> make_max_pool_layer(const std::string& name, int id, LayerOptions& options) {
  return std::make_unique<PoolingLayer>(name, id, options, PoolingMode::Max);
}

std::unique_ptr<Layer> make_avg_pool_layer(const std::string& name, int id, LayerOptions& options) {
  return std::make_unique<PoolingLayer>(name, id, options, PoolingMode::AverageExcludePadding);
}

}  // namespace tessera
