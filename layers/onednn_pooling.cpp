// Max and average pooling with oneDNN on plain layouts (its jit pooling handles N x C x spatial
// by transposing internally, so converting layouts here would only add passes over memory).
#include <map>

#include "layers/onednn_common.hpp"

namespace tessera::onednn {
namespace {

struct PoolingPlan {
  dnnl::pooling_forward::primitive_desc forward_descriptor;
  dnnl::pooling_forward forward;
  dnnl::memory input, output, workspace;
  bool has_backward = false;
  dnnl::pooling_backward backward;
  dnnl::memory grad_output, grad_input;
};

class OneDnnPooling final : public PoolingKernels {
 public:
  explicit OneDnnPooling(Context& context) : context_(context) {}

  std::size_t workspace_bytes(const PoolingGeometry& geometry) override {
    return plan_for(geometry).forward_descriptor.workspace_desc().get_size();
  }

  void forward(const PoolingGeometry& geometry, const float* input, float* output, void* workspace) override {
    PoolingPlan& plan = plan_for(geometry);
    plan.input.set_data_handle(const_cast<float*>(input));
    plan.output.set_data_handle(output);
    std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, plan.input}, {DNNL_ARG_DST, plan.output}};
    if (plan.workspace) {
      plan.workspace.set_data_handle(workspace);
      args.emplace(DNNL_ARG_WORKSPACE, plan.workspace);
    }
    plan.forward.execute(context_.stream, args);
    context_.stream.wait();
  }

  void backward(const PoolingGeometry& geometry, const float* grad_output, const void* workspace,
                float* grad_input) override {
    PoolingPlan& plan = backward_plan_for(geometry);
    plan.grad_output.set_data_handle(const_cast<float*>(grad_output));
    plan.grad_input.set_data_handle(grad_input);
    std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_DIFF_DST, plan.grad_output},
                                               {DNNL_ARG_DIFF_SRC, plan.grad_input}};
    if (plan.workspace) {
      plan.workspace.set_data_handle(const_cast<void*>(workspace));
      args.emplace(DNNL_ARG_WORKSPACE, plan.workspace);
    }
    plan.backward.execute(context_.stream, args);
    context_.stream.wait();
  }

 private:
  static dnnl::algorithm algorithm_for(PoolingMode mode) {
    return mode == PoolingMode::Max ? dnnl::algorithm::pooling_max : dnnl::algorithm::pooling_avg_exclude_padding;
  }

  struct Windows {
    Dims strides, kernel, padding_left, padding_right;
  };
  static Windows windows_of(const PoolingGeometry& g) {
    Windows w;
    for (std::size_t i = 0; i < g.input_size.size(); ++i) {
      w.strides.push_back(g.stride[i]);
      w.kernel.push_back(g.kernel[i]);
      w.padding_left.push_back(g.padding[i]);
      // Right padding that makes oneDNN's size rule give our (floor) output size.
      w.padding_right.push_back((g.output_size[i] - 1) * g.stride[i] + g.kernel[i] - g.input_size[i] - g.padding[i]);
    }
    return w;
  }

  PoolingPlan& plan_for(const PoolingGeometry& geometry) {
    auto found = plans_.find(geometry);
    if (found != plans_.end()) return *found->second;
    const auto& g = geometry;
    const Windows w = windows_of(g);
    auto plan = std::make_unique<PoolingPlan>();
    const auto input_desc = activation_desc(g.batch, g.channels, g.input_size, false);
    const auto output_desc = activation_desc(g.batch, g.channels, g.output_size, false);
    dnnl::pooling_forward::desc descriptor(dnnl::prop_kind::forward_training, algorithm_for(g.mode), input_desc,
                                           output_desc, w.strides, w.kernel, w.padding_left, w.padding_right);
    plan->forward_descriptor = dnnl::pooling_forward::primitive_desc(descriptor, context_.engine);
    plan->forward = dnnl::pooling_forward(plan->forward_descriptor);
    plan->input = dnnl::memory(input_desc, context_.engine, DNNL_MEMORY_NONE);
    plan->output = dnnl::memory(output_desc, context_.engine, DNNL_MEMORY_NONE);
    const auto workspace_desc = plan->forward_descriptor.workspace_desc();
    if (workspace_desc.get_size() > 0) plan->workspace = dnnl::memory(workspace_desc, context_.engine, DNNL_MEMORY_NONE);
    context_.record("pooling forward " + g.to_string(), plan->forward_descriptor);
    return *plans_.emplace(geometry, std::move(plan)).first->second;
  }

  PoolingPlan& backward_plan_for(const PoolingGeometry& geometry) {
    PoolingPlan& plan = plan_for(geometry);
    if (plan.has_backward) return plan;
    const auto& g = geometry;
    const Windows w = windows_of(g);
    const auto input_desc = activation_desc(g.batch, g.channels, g.input_size, false);
    const auto output_desc = activation_desc(g.batch, g.channels, g.output_size, false);
    dnnl::pooling_backward::desc descriptor(algorithm_for(g.mode), input_desc, output_desc, w.strides, w.kernel,
                                            w.padding_left, w.padding_right);
    dnnl::pooling_backward::primitive_desc pd(descriptor, context_.engine, plan.forward_descriptor);
    plan.backward = dnnl::pooling_backward(pd);
    plan.grad_output = dnnl::memory(output_desc, context_.engine, DNNL_MEMORY_NONE);
    plan.grad_input = dnnl::memory(input_desc, context_.engine, DNNL_MEMORY_NONE);
    context_.record("pooling backward " + g.to_string(), pd);
    plan.has_backward = true;
    return plan;
  }

  Context& context_;
  std::map<PoolingGeometry, std::unique_ptr<PoolingPlan>> plans_;
};

}  // namespace

std::unique_ptr<PoolingKernels> make_pooling_kernels(Context& context) {
  return std::make_unique<OneDnnPooling>(context);
}

}  // namespace tessera::onednn
