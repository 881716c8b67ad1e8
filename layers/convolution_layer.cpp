// "conv": 2-D or 3-D convolution (the spatial rank comes from the input), weights F x C x k...
#include <algorithm>

#include "layers/host_direct_convolution.hpp"
#include "layers/layer_common.hpp"

namespace tessera {
namespace {

class ConvolutionLayer final : public Layer {
 public:
  ConvolutionLayer(const std::string& name, int id, LayerOptions& options)
      : Layer(name, id),
        filters_(options.get_int("filters")),
        kernel_(options.get_int_list("kernel", {})),
        stride_(options.get_int_list("stride", {1})),
        padding_(options.get_int_list("padding", {0})),
        dilation_(options.get_int_list("dilation", {1})),
        bias_(options.get_bool("bias", true)) {
    geometry_.precision = parse_precision(options.get_string("precision", "fp32"), options.context());
    if (filters_ < 1) fail_layer(*this, "parameter 'filters' must be at least 1, got {}", filters_);
    for (auto k : kernel_) if (k < 1) fail_layer(*this, "parameter 'kernel' must be at least 1, got {}", k);
    for (auto s : stride_) if (s < 1) fail_layer(*this, "parameter 'stride' must be at least 1, got {}", s);
    for (auto p : padding_) if (p < 0) fail_layer(*this, "parameter 'padding' must not be negative, got {}", p);
    for (auto d : dilation_) if (d < 1) fail_layer(*this, "parameter 'dilation' must be at least 1 (1 = none), got {}", d);
  }

  std::string_view type() const override { return "conv"; }
  bool spatially_splittable() const override { return true; }

  Shape setup(const std::vector<Shape>& inputs) override {
    check_input_count(*this, inputs, 1);
    const Shape& input = inputs[0];
    if (input.rank() != 4 && input.rank() != 5)
      fail_layer(*this, "needs an N x C x H x W or N x C x D x H x W input, got {}", input.to_string());
    const int dims = input.rank() - 2;
    geometry_.in_channels = input[1];
    geometry_.out_channels = filters_;
    geometry_.input_size = spatial_extents(input);
    geometry_.kernel = expand_per_dimension(*this, "kernel", kernel_, dims);
    geometry_.stride = expand_per_dimension(*this, "stride", stride_, dims);
    geometry_.padding = expand_per_dimension(*this, "padding", padding_, dims);
    geometry_.dilation = expand_per_dimension(*this, "dilation", dilation_, dims);
    geometry_.bias = bias_;
    geometry_.output_size.clear();
    for (int i = 0; i < dims; ++i) {
      const auto u = static_cast<std::size_t>(i);
      const std::int64_t reach = (geometry_.kernel[u] - 1) * geometry_.dilation[u] + 1;
      const std::int64_t padded = geometry_.input_size[u] + 2 * geometry_.padding[u];
      if (reach > padded)
        fail_layer(*this, "kernel {} (dilated extent {}) is larger than the padded input ({} with padding {}) "
                   "in spatial dimension {} of input {}", geometry_.kernel[u], reach, padded, geometry_.padding[u], i,
                   input.to_string());
      geometry_.output_size.push_back((padded - reach) / geometry_.stride[u] + 1);
    }
    input_shape_ = input;

    std::vector<std::int64_t> weight_dims{filters_, geometry_.in_channels};
    weight_dims.insert(weight_dims.end(), geometry_.kernel.begin(), geometry_.kernel.end());
    weights_ = whole_parameter(*this, "weight", weight_dims, true);
    if (bias_) bias_parameter_ = whole_parameter(*this, "bias", {filters_}, false);
    return Shape::image(input[0], filters_, geometry_.output_size);
  }

  SpatialWindow spatial_window(int dim) const override {
    // Output o reads inputs o*stride - padding ... + (kernel-1)*dilation.
    const auto u = static_cast<std::size_t>(dim);
    return {(geometry_.kernel[u] - 1) * geometry_.dilation[u] + 1, geometry_.stride[u], geometry_.padding[u]};
  }

  bool model_splittable() const override { return true; }
  Precision precision() const override { return geometry_.precision; }
  LayerTraits traits() const override {
    LayerTraits t;
    t.backward_reads_fp32 = geometry_.precision == Precision::F32;
    t.fuses_leaky_relu = true;
    t.computes_output_regions = true;
    t.splits_backward = true;
    t.reads_pooled_gradient = geometry_.precision == Precision::F32 && host::direct_convolution_applies(geometry_);
    return t;
  }

  bool reads_pooled_gradient(std::span<const Tensor* const> inputs, const PooledGradient& pooled,
                             LayerContext& ctx) override {
    return pooled.geometry &&
           backend_of(*this, ctx).convolution().reads_pooled_gradient(geometry_for(*inputs[0], ctx), *pooled.geometry);
  }

  void set_model_split(const ModelSplit& split) override {
    if (split == model_split_) return;  // a second executor on the same model
    TESSERA_CHECK(model_split_.none(), "{}: split twice, differently", describe(*this));
    const std::int64_t channels = geometry_.in_channels;
    if (split.filter_parts > filters_ || split.channel_parts > channels)
      fail_layer(*this, "cannot cut {} filters into {} filter parts and {} input channels into {} channel parts",
                 filters_, split.filter_parts, channels, split.channel_parts);
    model_split_ = split;
    if (split.none()) return;
    const std::int64_t fb = block_begin(filters_, split.filter_parts, split.filter_coord);
    const std::int64_t fe = block_extent(filters_, split.filter_parts, split.filter_coord);
    const std::int64_t cb = block_begin(channels, split.channel_parts, split.channel_coord);
    const std::int64_t ce = block_extent(channels, split.channel_parts, split.channel_coord);
    Box box{{fb, cb}, {fe, ce}};
    for (auto k : geometry_.kernel) {
      box.begin.push_back(0);
      box.extent.push_back(k);
    }
    shard_parameter(weights_, box);
    if (bias_) {
      shard_parameter(bias_parameter_, Box{{fb}, {fe}});
      bias_parameter_.replicated_over_channels = split.channel_parts > 1;
    }
    geometry_.in_channels = ce;
    geometry_.out_channels = fe;
    geometry_.bias = adds_bias();
    input_shape_ = input_shape_.with(1, ce);
  }

  std::vector<Parameter*> parameters() override {
    if (bias_) return {&weights_, &bias_parameter_};
    return {&weights_};
  }

  std::int64_t workspace_bytes() const override {
    return region_input_.allocated_bytes() + region_output_.allocated_bytes();
  }

  void init_parameters(std::uint64_t seed) override {
    // fan_in: the whole layer's input channels times the kernel, whatever block this rank holds.
    std::int64_t fan_in = 1;
    for (auto d : weights_.whole_shape()) fan_in *= d;
    fan_in /= filters_;
    he_uniform_init(weights_, seed, id(), 0, fan_in);
    if (bias_) bias_parameter_.value.zero();
  }

  void forward(std::span<const Tensor* const> inputs, Tensor& output, LayerContext& ctx) override {
    const Tensor& input = *inputs[0];
    check_same_sample_shape(*this, input_shape_, input.shape(), ctx);
    const ConvolutionGeometry& g = with_activation(geometry_for(input, ctx), ctx);
    if (ctx.pooled_output) {
      // Its reader's max pooling of the output, written in the same pass (no output of its own).
      if (g.batch == 0) return;
      TESSERA_CHECK(model_split_.channel_parts == 1, "{}: a pooled partial sum (executor bug)", describe(*this));
      backend_of(*this, ctx)
          .convolution()
          .forward_pooled(g, input.data(), weights_.value.data(), bias_ ? bias_parameter_.value.data() : nullptr,
                          *ctx.pooled_output);
      return;
    }
    output.resize(Shape::image(g.batch, geometry_.out_channels, g.output_size), input.device());
    if (g.batch == 0) return;
    backend_of(*this, ctx).convolution().forward(g, input.data(), weights_.value.data(),
                                                  bias_ ? bias_parameter_.value.data() : nullptr, output.data());
  }

  void backward(std::span<const Tensor* const> inputs, const Tensor& output, const Tensor& grad_output,
                std::span<Tensor* const> grad_inputs, LayerContext& ctx) override {
    const Tensor& input = *inputs[0];
    const ConvolutionGeometry& g = geometry_for(input, ctx);
    if (grad_inputs[0]) grad_inputs[0]->resize(input.shape(), input.device());
    if (g.batch == 0) {
      // No samples here: this rank's share of the parameter gradients is zero.
      weights_.grad.zero();
      if (bias_) bias_parameter_.grad.zero();
      return;
    }
    if (ctx.pooled_gradient) {
      TESSERA_CHECK(!grad_inputs[0] && model_split_.channel_parts == 1,
                    "{}: weight gradients from a pooling's with an input gradient or partial sums (executor bug)",
                    describe(*this));
      backend_of(*this, ctx)
          .convolution()
          .backward_weights_from_pooling(g, input.data(), *ctx.pooled_gradient, weights_.grad.data(),
                                         bias_ ? bias_parameter_.grad.data() : nullptr);
      return;
    }
    backend_of(*this, ctx).convolution().backward(g, input.data(), grad_output.data(), weights_.value.data(),
                                                   grad_inputs[0] ? grad_inputs[0]->data() : nullptr,
                                                   weights_.grad.data(), adds_bias() ? bias_parameter_.grad.data() : nullptr);
    if (bias_ && !adds_bias()) bias_parameter_.grad.zero();  // the bias is channel block 0's
  }

  void forward_region(std::span<const Tensor* const> inputs, Tensor& output, LayerContext& ctx,
                      const std::vector<std::int64_t>& begin, const std::vector<std::int64_t>& extent) override {
    const Tensor& input = *inputs[0];
    if (!ctx.tile) fail("{}: forward_region outside a spatial tile (executor bug)", describe(*this));
    const ConvolutionGeometry& g = geometry_for(input, ctx);
    TESSERA_CHECK(begin.size() == g.output_size.size() && extent.size() == g.output_size.size(),
                  "{}: forward_region over {} spatial dimensions, the layer has {}", describe(*this), begin.size(),
                  g.output_size.size());
    if (g.batch == 0) return;
    // The region is a convolution of its own (no padding: the window holds it) over the part of
    // the window its outputs read, copied out; its outputs are copied into place.
    region_geometry_ = with_activation(g, ctx);  // a copy: its sizes change below
    region_geometry_.data_begin.clear();
    region_geometry_.data_extent.clear();
    std::vector<std::int64_t> input_begin(begin.size());
    for (std::size_t i = 0; i < begin.size(); ++i) {
      TESSERA_CHECK(extent[i] > 0 && begin[i] >= 0 && begin[i] + extent[i] <= g.output_size[i],
                    "{}: output region [{}, {}) outside the tile's {} outputs in dimension {}", describe(*this),
                    begin[i], begin[i] + extent[i], g.output_size[i], i);
      const std::int64_t reach = (g.kernel[i] - 1) * g.dilation[i] + 1;
      input_begin[i] = begin[i] * g.stride[i];
      region_geometry_.input_size[i] = (extent[i] - 1) * g.stride[i] + reach;
      region_geometry_.output_size[i] = extent[i];
    }
    region_input_.resize(Shape::image(g.batch, g.in_channels, region_geometry_.input_size), input.device());
    region_output_.resize(Shape::image(g.batch, g.out_channels, extent), input.device());
    copy_spatial_box(input, input_begin, region_input_, std::vector<std::int64_t>(begin.size(), 0),
                     region_geometry_.input_size);
    backend_of(*this, ctx).convolution().forward(region_geometry_, region_input_.data(), weights_.value.data(),
                                                  bias_ ? bias_parameter_.value.data() : nullptr, region_output_.data());
    copy_spatial_box(region_output_, std::vector<std::int64_t>(begin.size(), 0), output, begin, extent);
  }

  void backward_inputs(std::span<const Tensor* const> inputs, const Tensor& grad_output,
                       std::span<Tensor* const> grad_inputs, LayerContext& ctx) override {
    const Tensor& input = *inputs[0];
    if (!grad_inputs[0]) return;
    const ConvolutionGeometry& g = geometry_for(input, ctx);
    grad_inputs[0]->resize(input.shape(), input.device());
    if (g.batch == 0) return;
    backend_of(*this, ctx).convolution().backward_data(g, grad_output.data(), weights_.value.data(),
                                                        grad_inputs[0]->data());
  }

  void backward_parameters(std::span<const Tensor* const> inputs, const Tensor& grad_output,
                           LayerContext& ctx) override {
    const Tensor& input = *inputs[0];
    const ConvolutionGeometry& g = geometry_for(input, ctx);
    if (g.batch == 0) {
      weights_.grad.zero();
      if (bias_) bias_parameter_.grad.zero();
      return;
    }
    backend_of(*this, ctx).convolution().backward_weights(g, input.data(), grad_output.data(), weights_.grad.data(),
                                                           adds_bias() ? bias_parameter_.grad.data() : nullptr);
    if (bias_ && !adds_bias()) bias_parameter_.grad.zero();
  }

 private:
  /// The geometry of this call: the layer's own, or on a spatial tile a convolution without
  /// padding over the local window (which already holds the padding as zeros) that yields
  /// exactly the tile's outputs, naming the part of the window that holds data.
  const ConvolutionGeometry& geometry_for(const Tensor& input, const LayerContext& ctx) {
    if (!ctx.tile) {
      geometry_.batch = input.dim(0);
      return geometry_;
    }
    tile_geometry_ = geometry_;
    tile_geometry_.batch = input.dim(0);
    tile_geometry_.input_size = spatial_extents(input.shape());
    tile_geometry_.padding.assign(geometry_.padding.size(), 0);
    tile_geometry_.output_size = ctx.tile->output_extent;
    TESSERA_CHECK(ctx.tile->window_begin.size() == geometry_.input_size.size() &&
                      ctx.tile->input_global.size() == geometry_.input_size.size(),
                  "{}: a spatial tile without its window's position or the global extents (executor bug)",
                  describe(*this));
    // The data region, written in place (no allocation once the vectors have grown).
    auto& data_begin = tile_geometry_.data_begin;
    auto& data_extent = tile_geometry_.data_extent;
    bool padded = false, empty = false;
    for (std::size_t i = 0; i < tile_geometry_.input_size.size(); ++i) {
      const std::int64_t reach = (geometry_.kernel[i] - 1) * geometry_.dilation[i] + 1;
      const std::int64_t out = tile_geometry_.output_size[i], window = tile_geometry_.input_size[i];
      if (out > 0 && window != (out - 1) * geometry_.stride[i] + reach)
        fail_layer(*this, "spatial tile with {} outputs in dimension {} got an input window of {} (executor bug)",
                   out, i, window);
      const std::int64_t first = std::max<std::int64_t>(0, -ctx.tile->window_begin[i]);
      const std::int64_t end = std::min(window, ctx.tile->input_global[i] - ctx.tile->window_begin[i]);
      data_begin.push_back(first);
      data_extent.push_back(end - first);
      padded = padded || first > 0 || end < window;
      empty = empty || end <= first;
    }
    if (!padded || empty) {  // all of the window holds data, or none of it
      data_begin.clear();
      data_extent.clear();
    }
    return tile_geometry_;
  }

  /// `g` with the leaky ReLU the executor fused into this forward (LayerContext::leaky_relu_after):
  /// `g` itself when there is none, else fused_geometry_ (kept, so that no call allocates).
  const ConvolutionGeometry& with_activation(const ConvolutionGeometry& g, const LayerContext& ctx) {
    if (!ctx.leaky_relu_after) return g;
    TESSERA_CHECK(model_split_.channel_parts == 1, "{}: a leaky ReLU fused into a partial sum (executor bug)",
                  describe(*this));
    fused_geometry_ = g;
    fused_geometry_.leaky_relu = true;
    fused_geometry_.leaky_slope = *ctx.leaky_relu_after;
    return fused_geometry_;
  }
  /// Of a channel-split layer's partial sums only channel block 0's adds the bias.
  bool adds_bias() const { return bias_ && model_split_.channel_coord == 0; }

  std::int64_t filters_;
  std::vector<std::int64_t> kernel_, stride_, padding_, dilation_;
  bool bias_;
  Shape input_shape_;
  ConvolutionGeometry geometry_, tile_geometry_, region_geometry_, fused_geometry_;
  Tensor region_input_, region_output_;  ///< forward_region's copies, kept between calls
  Parameter weights_, bias_parameter_;
};

}  // namespace

std::unique_ptr<Layer> make_convolution_layer(const std::string& name, int id, LayerOptions& options) {
  return std::make_unique<ConvolutionLayer>(name, id, options);
}

}  // namespace tessera
