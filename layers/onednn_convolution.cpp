// Convolution forward / backward-data / backward-weights with oneDNN. Primitives for a geometry
// are built on its first use and kept: building one costs far more than running it on the
// small tiles of a distributed layer.
#include <map>

#include "layers/onednn_common.hpp"

namespace tessera::onednn {
namespace {

using dnnl::algorithm;
using dnnl::prop_kind;

/// Everything built for one geometry. The backward primitives need the forward descriptor as
/// a hint and are built on the first backward call (evaluation never needs them).
struct ConvolutionPlan {
  bool blocked = false;
  dnnl::memory::dims strides, dilations, padding_left, padding_right;
  dnnl::memory::desc user_input, user_weights, user_bias, user_output;

  dnnl::convolution_forward::primitive_desc forward_descriptor;
  dnnl::convolution_forward forward;
  Operand input, weights, output;
  dnnl::memory bias;

  bool has_backward = false;
  dnnl::convolution_backward_data backward_data;
  Operand data_grad_output, data_weights, data_grad_input;
  dnnl::convolution_backward_weights backward_weights;
  Operand weights_input, weights_grad_output, weights_grad_weights;
  dnnl::memory grad_bias;
  bool shared_grad_output = false;
};

class OneDnnConvolution final : public ConvolutionKernels {
 public:
  OneDnnConvolution(Context& context, HostConvolutionLayout layout) : context_(context), layout_(layout) {}

  void forward(const ConvolutionGeometry& geometry, const float* input, const float* weights, const float* bias,
               float* output) override {
    ConvolutionPlan& plan = plan_for(geometry);
    auto& stream = context_.stream;
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, plan.input.bind_input(input, stream)},
        {DNNL_ARG_WEIGHTS, plan.weights.bind_input(weights, stream)},
        {DNNL_ARG_DST, plan.output.bind_output(output)}};
    if (geometry.bias) {
      plan.bias.set_data_handle(const_cast<float*>(bias));
      args.emplace(DNNL_ARG_BIAS, plan.bias);
    }
    plan.forward.execute(stream, args);
    plan.output.finish_output(stream);
    stream.wait();
  }

  void backward_data(const ConvolutionGeometry& geometry, const float* grad_output, const float* weights,
                     float* grad_input) override {
    ConvolutionPlan& plan = backward_plan_for(geometry);
    auto& stream = context_.stream;
    plan.backward_data.execute(stream, {{DNNL_ARG_DIFF_DST, plan.data_grad_output.bind_input(grad_output, stream)},
                                        {DNNL_ARG_WEIGHTS, plan.data_weights.bind_input(weights, stream)},
                                        {DNNL_ARG_DIFF_SRC, plan.data_grad_input.bind_output(grad_input)}});
    plan.data_grad_input.finish_output(stream);
    stream.wait();
  }

  void backward_weights(const ConvolutionGeometry& geometry, const float* input, const float* grad_output,
                        float* grad_weights, float* grad_bias) override {
    ConvolutionPlan& plan = backward_plan_for(geometry);
    auto& stream = context_.stream;
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, plan.weights_input.bind_input(input, stream)},
        {DNNL_ARG_DIFF_DST, plan.weights_grad_output.bind_input(grad_output, stream)},
        {DNNL_ARG_DIFF_WEIGHTS, plan.weights_grad_weights.bind_output(grad_weights)}};
    if (geometry.bias) {
      plan.grad_bias.set_data_handle(grad_bias);
      args.emplace(DNNL_ARG_DIFF_BIAS, plan.grad_bias);
    }
    plan.backward_weights.execute(stream, args);
    plan.weights_grad_weights.finish_output(stream);
    stream.wait();
  }

  void backward(const ConvolutionGeometry& geometry, const float* input, const float* grad_output,
                const float* weights, float* grad_input, float* grad_weights, float* grad_bias) override {
    ConvolutionPlan& plan = backward_plan_for(geometry);
    if (!grad_input || !plan.shared_grad_output) {
      ConvolutionKernels::backward(geometry, input, grad_output, weights, grad_input, grad_weights, grad_bias);
      return;
    }
    // Both passes read grad_output in the same layout: convert it once.
    auto& stream = context_.stream;
    dnnl::memory& converted = plan.data_grad_output.bind_input(grad_output, stream);
    plan.backward_data.execute(stream, {{DNNL_ARG_DIFF_DST, converted},
                                        {DNNL_ARG_WEIGHTS, plan.data_weights.bind_input(weights, stream)},
                                        {DNNL_ARG_DIFF_SRC, plan.data_grad_input.bind_output(grad_input)}});
    plan.data_grad_input.finish_output(stream);
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, plan.weights_input.bind_input(input, stream)},
        {DNNL_ARG_DIFF_DST, converted},
        {DNNL_ARG_DIFF_WEIGHTS, plan.weights_grad_weights.bind_output(grad_weights)}};
    if (geometry.bias) {
      plan.grad_bias.set_data_handle(grad_bias);
      args.emplace(DNNL_ARG_DIFF_BIAS, plan.grad_bias);
    }
    plan.backward_weights.execute(stream, args);
    plan.weights_grad_weights.finish_output(stream);
    stream.wait();
  }

 private:
  bool blocked_for(const ConvolutionGeometry& geometry) const {
    return layout_ == HostConvolutionLayout::Blocked ||
           (layout_ == HostConvolutionLayout::Automatic && geometry.in_channels >= 8);
  }

  dnnl::memory::desc chosen_or_any(const dnnl::memory::desc& plain, bool blocked) const {
    return blocked ? dnnl::memory::desc(plain.dims(), dnnl::memory::data_type::f32, Tag::any) : plain;
  }

  ConvolutionPlan& plan_for(const ConvolutionGeometry& geometry) {
    auto found = plans_.find(geometry);
    if (found != plans_.end()) return *found->second;

    auto plan = std::make_unique<ConvolutionPlan>();
    const auto& g = geometry;
    const bool three_d = g.input_size.size() == 3;
    Dims weight_dims{g.out_channels, g.in_channels};
    weight_dims.insert(weight_dims.end(), g.kernel.begin(), g.kernel.end());
    plan->user_input = activation_desc(g.batch, g.in_channels, g.input_size, false);
    plan->user_output = activation_desc(g.batch, g.out_channels, g.output_size, false);
    plan->user_weights = dnnl::memory::desc(weight_dims, dnnl::memory::data_type::f32, three_d ? Tag::oidhw : Tag::oihw);
    plan->user_bias = dnnl::memory::desc({g.out_channels}, dnnl::memory::data_type::f32, Tag::x);
    for (std::size_t i = 0; i < g.input_size.size(); ++i) {
      plan->strides.push_back(g.stride[i]);
      plan->dilations.push_back(g.dilation[i] - 1);  // oneDNN counts the gaps: 0 = dense
      plan->padding_left.push_back(g.padding[i]);
      // What the right side must be for oneDNN's output-size rule to give our output size;
      // negative when the last input rows are not reached by any window.
      const std::int64_t reach = (g.output_size[i] - 1) * g.stride[i] + (g.kernel[i] - 1) * g.dilation[i] + 1;
      plan->padding_right.push_back(reach - g.input_size[i] - g.padding[i]);
    }

    plan->blocked = blocked_for(g);
    const auto input_desc = chosen_or_any(plan->user_input, plan->blocked);
    const auto weights_desc = chosen_or_any(plan->user_weights, plan->blocked);
    const auto output_desc = chosen_or_any(plan->user_output, plan->blocked);
    auto descriptor = g.bias
        ? dnnl::convolution_forward::desc(prop_kind::forward_training, algorithm::convolution_direct, input_desc,
                                          weights_desc, plan->user_bias, output_desc, plan->strides, plan->dilations,
                                          plan->padding_left, plan->padding_right)
        : dnnl::convolution_forward::desc(prop_kind::forward_training, algorithm::convolution_direct, input_desc,
                                          weights_desc, output_desc, plan->strides, plan->dilations,
                                          plan->padding_left, plan->padding_right);
    plan->forward_descriptor = dnnl::convolution_forward::primitive_desc(descriptor, context_.engine);
    const auto& pd = plan->forward_descriptor;
    plan->forward = dnnl::convolution_forward(pd);
    plan->input = Operand(plan->user_input, pd.src_desc(), context_.engine, true);
    plan->weights = Operand(plan->user_weights, pd.weights_desc(), context_.engine, true);
    plan->output = Operand(plan->user_output, pd.dst_desc(), context_.engine, false);
    plan->bias = dnnl::memory(plan->user_bias, context_.engine, DNNL_MEMORY_NONE);
    context_.record("convolution forward " + g.to_string(), pd);

    return *plans_.emplace(geometry, std::move(plan)).first->second;
  }

  ConvolutionPlan& backward_plan_for(const ConvolutionGeometry& geometry) {
    ConvolutionPlan& plan = plan_for(geometry);
    if (plan.has_backward) return plan;
    const auto& engine = context_.engine;

    dnnl::convolution_backward_data::desc data_descriptor(
        algorithm::convolution_direct, chosen_or_any(plan.user_input, plan.blocked), chosen_or_any(plan.user_weights, plan.blocked),
        chosen_or_any(plan.user_output, plan.blocked), plan.strides, plan.dilations, plan.padding_left, plan.padding_right);
    dnnl::convolution_backward_data::primitive_desc data_pd(data_descriptor, engine, plan.forward_descriptor);
    plan.backward_data = dnnl::convolution_backward_data(data_pd);
    plan.data_grad_output = Operand(plan.user_output, data_pd.diff_dst_desc(), engine, true);
    plan.data_weights = Operand(plan.user_weights, data_pd.weights_desc(), engine, true);
    plan.data_grad_input = Operand(plan.user_input, data_pd.diff_src_desc(), engine, false);
    context_.record("convolution backward data " + geometry.to_string(), data_pd);

    const bool bias = geometry.bias;
    auto weights_descriptor = bias
        ? dnnl::convolution_backward_weights::desc(algorithm::convolution_direct, chosen_or_any(plan.user_input, plan.blocked),
                                                   chosen_or_any(plan.user_weights, plan.blocked), plan.user_bias,
                                                   chosen_or_any(plan.user_output, plan.blocked), plan.strides, plan.dilations,
                                                   plan.padding_left, plan.padding_right)
        : dnnl::convolution_backward_weights::desc(algorithm::convolution_direct, chosen_or_any(plan.user_input, plan.blocked),
                                                   chosen_or_any(plan.user_weights, plan.blocked), chosen_or_any(plan.user_output, plan.blocked),
                                                   plan.strides, plan.dilations, plan.padding_left,
                                                   plan.padding_right);
    dnnl::convolution_backward_weights::primitive_desc weights_pd(weights_descriptor, engine, plan.forward_descriptor);
    plan.backward_weights = dnnl::convolution_backward_weights(weights_pd);
    plan.weights_input = Operand(plan.user_input, weights_pd.src_desc(), engine, true);
    plan.weights_grad_output = Operand(plan.user_output, weights_pd.diff_dst_desc(), engine, true);
    plan.weights_grad_weights = Operand(plan.user_weights, weights_pd.diff_weights_desc(), engine, false);
    plan.grad_bias = dnnl::memory(plan.user_bias, engine, DNNL_MEMORY_NONE);
    plan.shared_grad_output = data_pd.diff_dst_desc() == weights_pd.diff_dst_desc();
    context_.record("convolution backward weights " + geometry.to_string(), weights_pd);

    plan.has_backward = true;
    return plan;
  }

  Context& context_;
  HostConvolutionLayout layout_;
  std::map<ConvolutionGeometry, std::unique_ptr<ConvolutionPlan>> plans_;
};

}  // namespace

std::unique_ptr<ConvolutionKernels> make_convolution_kernels(Context& context, HostConvolutionLayout layout) {
  return std::make_unique<OneDnnConvolution>(context, layout);
}

}  // namespace tessera::onednn
