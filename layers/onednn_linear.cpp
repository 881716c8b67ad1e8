// Linear layers as three oneDNN matmuls on plain row-major buffers. Transposes are expressed by
// strides in the memory descriptors, so no data is copied or reordered:
//   forward          Y[N,O]  = X[N,I] * W^T[I,O] + b
//   backward data    dX[N,I] = dY[N,O] * W[O,I]
//   backward weights dW[O,I] = dY^T[O,N] * X[N,I];  db = column sums of dY
#include <map>

#include "layers/onednn_common.hpp"

namespace tessera::onednn {
namespace {

using dnnl::memory;

memory::desc row_major(std::int64_t rows, std::int64_t columns) {
  return memory::desc({rows, columns}, memory::data_type::f32, Tag::ab);
}
/// The transpose of a row-major `columns x rows` buffer, seen as rows x columns.
memory::desc transposed(std::int64_t rows, std::int64_t columns) {
  return memory::desc({rows, columns}, memory::data_type::f32, Tag::ba);
}

/// One matmul primitive with a memory object per argument, bound to the caller's pointers per call.
struct Matmul {
  dnnl::matmul primitive;
  memory a, b, bias, c;

  Matmul() = default;
  Matmul(Context& context, const std::string& what, const memory::desc& a_desc, const memory::desc& b_desc,
         const memory::desc* bias_desc, const memory::desc& c_desc) {
    const auto descriptor = bias_desc ? dnnl::matmul::desc(a_desc, b_desc, *bias_desc, c_desc)
                                      : dnnl::matmul::desc(a_desc, b_desc, c_desc);
    const dnnl::matmul::primitive_desc pd(descriptor, context.engine);
    primitive = dnnl::matmul(pd);
    a = memory(a_desc, context.engine, DNNL_MEMORY_NONE);
    b = memory(b_desc, context.engine, DNNL_MEMORY_NONE);
    c = memory(c_desc, context.engine, DNNL_MEMORY_NONE);
    if (bias_desc) bias = memory(*bias_desc, context.engine, DNNL_MEMORY_NONE);
    context.record(what, pd);
  }

  void run(dnnl::stream& stream, const float* a_data, const float* b_data, const float* bias_data, float* c_data) {
    a.set_data_handle(const_cast<float*>(a_data));
    b.set_data_handle(const_cast<float*>(b_data));
    c.set_data_handle(c_data);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}};
    if (bias) {
      bias.set_data_handle(const_cast<float*>(bias_data));
      args.emplace(DNNL_ARG_BIAS, bias);
    }
    primitive.execute(stream, args);
    stream.wait();
  }
};

struct LinearPlan {
  Matmul forward;
  bool has_backward = false;
  Matmul backward_data, backward_weights;
};

class OneDnnLinear final : public LinearKernels {
 public:
  explicit OneDnnLinear(Context& context) : context_(context) {}

  void forward(const LinearGeometry& geometry, const float* input, const float* weights, const float* bias,
               float* output) override {
    plan_for(geometry).forward.run(context_.stream, input, weights, geometry.bias ? bias : nullptr, output);
  }

  void backward_data(const LinearGeometry& geometry, const float* grad_output, const float* weights,
                     float* grad_input) override {
    backward_plan_for(geometry).backward_data.run(context_.stream, grad_output, weights, nullptr, grad_input);
  }

  void backward_weights(const LinearGeometry& geometry, const float* input, const float* grad_output,
                        float* grad_weights, float* grad_bias) override {
    backward_plan_for(geometry).backward_weights.run(context_.stream, grad_output, input, nullptr, grad_weights);
    if (!geometry.bias) return;
    // Column sums in double: the batch can be large and the result feeds the optimizer directly.
    const std::int64_t outputs = geometry.out_features;
    std::vector<double> sums(static_cast<std::size_t>(outputs), 0.0);
    for (std::int64_t n = 0; n < geometry.batch; ++n) {
      const float* row = grad_output + n * outputs;
      for (std::int64_t o = 0; o < outputs; ++o) sums[static_cast<std::size_t>(o)] += row[o];
    }
    for (std::int64_t o = 0; o < outputs; ++o) grad_bias[o] = static_cast<float>(sums[static_cast<std::size_t>(o)]);
  }

 private:
  LinearPlan& plan_for(const LinearGeometry& geometry) {
    auto found = plans_.find(geometry);
    if (found != plans_.end()) return *found->second;
    const auto n = geometry.batch, in = geometry.in_features, out = geometry.out_features;
    auto plan = std::make_unique<LinearPlan>();
    const memory::desc bias_desc = row_major(1, out);
    plan->forward = Matmul(context_, "linear forward " + geometry.to_string(), row_major(n, in), transposed(in, out),
                           geometry.bias ? &bias_desc : nullptr, row_major(n, out));
    return *plans_.emplace(geometry, std::move(plan)).first->second;
  }

  LinearPlan& backward_plan_for(const LinearGeometry& geometry) {
    LinearPlan& plan = plan_for(geometry);
    if (plan.has_backward) return plan;
    const auto n = geometry.batch, in = geometry.in_features, out = geometry.out_features;
    plan.backward_data = Matmul(context_, "linear backward data " + geometry.to_string(), row_major(n, out),
                                row_major(out, in), nullptr, row_major(n, in));
    plan.backward_weights = Matmul(context_, "linear backward weights " + geometry.to_string(), transposed(out, n),
                                   row_major(n, in), nullptr, row_major(out, in));
    plan.has_backward = true;
    return plan;
  }

  Context& context_;
  std::map<LinearGeometry, std::unique_ptr<LinearPlan>> plans_;
};

}  // namespace

std::unique_ptr<LinearKernels> make_linear_kernels(Context& context) { return std::make_unique<OneDnnLinear>(context); }

}  // namespace tessera::onednn
