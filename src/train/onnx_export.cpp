// Tessera model and weights -> ONNX inference graph. See include/tessera/train/onnx.hpp and docs/onnx.md.
#include <onnx/onnx_pb.h>

#include <map>

#include "tessera/core/error.hpp"
#include "tessera/layers/options.hpp"
#include "tessera/train/model.hpp"
#include "tessera/train/onnx.hpp"

namespace tessera {
namespace {

constexpr int kOpset = 13;
constexpr int kIrVersion = 7;  // the IR version of opset 13

class Exporter {
 public:
  Exporter(const std::string& model_text, const std::string& source, const std::vector<NamedTensor>& tensors)
      : source_(source) {
    ModelOptions options;
    options.allocate_parameters = false;
    model_ = std::make_unique<Model>(Model::parse(model_text, source, options));
    for (const auto& t : tensors) tensors_[t.name] = &t.value;
  }

  std::string run() {
    onnx::ModelProto proto;
    proto.set_ir_version(kIrVersion);
    proto.set_producer_name("tessera");
    proto.set_model_version(1);
    auto* opset = proto.add_opset_import();
    opset->set_domain("");
    opset->set_version(kOpset);
    add_metadata(proto, "tessera.name", model_->name());
    add_metadata(proto, "tessera.loss", std::string(model_->loss().type()));
    graph_ = proto.mutable_graph();
    graph_->set_name(model_->name());
    value_info(graph_->add_input(), "input", model_->sample_shape().dims());
    auto& nodes = model_->nodes();
    for (std::size_t k = 0; k < nodes.size(); ++k) layer(k);
    const auto& out = nodes[static_cast<std::size_t>(model_->output_node())];
    const auto& dims = out.output.dims();
    value_info(graph_->add_output(), out.layer->name(), std::vector<std::int64_t>(dims.begin() + 1, dims.end()));
    std::string bytes;
    if (!proto.SerializeToString(&bytes)) fail("{}: the ONNX graph does not serialize", source_);
    return bytes;
  }

 private:
  static void add_metadata(onnx::ModelProto& proto, const std::string& key, const std::string& value) {
    auto* p = proto.add_metadata_props();
    p->set_key(key);
    p->set_value(value);
  }

  /// A float tensor's type and shape: the batch dimension (symbolic) and `dims`.
  static void value_info(onnx::ValueInfoProto* info, const std::string& name, const std::vector<std::int64_t>& dims) {
    info->set_name(name);
    auto* type = info->mutable_type()->mutable_tensor_type();
    type->set_elem_type(onnx::TensorProto::FLOAT);
    auto* shape = type->mutable_shape();
    shape->add_dim()->set_dim_param("batch");
    for (auto d : dims) shape->add_dim()->set_dim_value(d);
  }

  const Tensor* find(const std::string& name) const {
    const auto found = tensors_.find(name);
    return found == tensors_.end() ? nullptr : found->second;
  }
  const Tensor& need(const std::string& name) const {
    const Tensor* t = find(name);
    if (!t) fail_input("{}: the weights hold no tensor '{}'", source_, name);
    return *t;
  }

  void initializer(const std::string& name, const Tensor& value) {
    auto* t = graph_->add_initializer();
    t->set_name(name);
    t->set_data_type(onnx::TensorProto::FLOAT);
    for (auto d : value.shape().dims()) t->add_dims(d);
    const Tensor host = value.is_contiguous() ? value : value.clone();
    t->set_raw_data(std::string(reinterpret_cast<const char*>(host.data()),
                                static_cast<std::size_t>(host.numel()) * sizeof(float)));
  }

  onnx::NodeProto* node(const std::string& op, const std::string& name, const std::vector<std::string>& inputs,
                        const std::string& output) {
    auto* n = graph_->add_node();
    n->set_op_type(op);
    n->set_name(name);
    for (const auto& in : inputs) n->add_input(in);
    n->add_output(output);
    return n;
  }
  static void ints(onnx::NodeProto* n, const std::string& name, const std::vector<std::int64_t>& values) {
    auto* a = n->add_attribute();
    a->set_name(name);
    a->set_type(onnx::AttributeProto::INTS);
    for (auto v : values) a->add_ints(v);
  }
  static void integer(onnx::NodeProto* n, const std::string& name, std::int64_t value) {
    auto* a = n->add_attribute();
    a->set_name(name);
    a->set_type(onnx::AttributeProto::INT);
    a->set_i(value);
  }
  static void real(onnx::NodeProto* n, const std::string& name, double value) {
    auto* a = n->add_attribute();
    a->set_name(name);
    a->set_type(onnx::AttributeProto::FLOAT);
    a->set_f(static_cast<float>(value));
  }

  /// A per-dimension option expanded to `dims` values (a single value applies to every dimension).
  static std::vector<std::int64_t> per_dimension(const LayerOptions& options, const std::string& key,
                                                 std::vector<std::int64_t> fallback, std::size_t dims) {
    auto values = options.get_int_list(key, std::move(fallback));
    if (values.size() == 1) values.assign(dims, values[0]);
    return values;
  }

  /// kernel_shape, strides, pads (and dilations) from the layer's options, checked against the
  /// output shape Tessera computed for it.
  void window(onnx::NodeProto* n, const ModelNode& m, const Shape& input, std::vector<std::int64_t> kernel,
              std::vector<std::int64_t> stride, std::vector<std::int64_t> padding, std::vector<std::int64_t> dilation) {
    const std::size_t dims = kernel.size();
    for (std::size_t d = 0; d < dims; ++d) {
      const std::int64_t reach = (kernel[d] - 1) * (dilation.empty() ? 1 : dilation[d]) + 1;
      const std::int64_t size = (input[static_cast<int>(d) + 2] + 2 * padding[d] - reach) / stride[d] + 1;
      if (size != m.output[static_cast<int>(d) + 2])
        fail("{}: layer '{}': the ONNX window gives size {} in dimension {}, Tessera {} (exporter bug)", source_,
             m.layer->name(), size, d, m.output[static_cast<int>(d) + 2]);
    }
    ints(n, "kernel_shape", kernel);
    ints(n, "strides", stride);
    std::vector<std::int64_t> pads = padding;
    pads.insert(pads.end(), padding.begin(), padding.end());
    ints(n, "pads", pads);
    if (!dilation.empty()) ints(n, "dilations", dilation);
  }

  Shape input_shape(const ModelNode& m, std::size_t i) const {
    const int from = m.inputs[i];
    return from == Model::kModelInput ? model_->input_shape(1)
                                      : model_->nodes()[static_cast<std::size_t>(from)].output;
  }
  std::string input_name(const ModelNode& m, std::size_t i) const {
    const int from = m.inputs[i];
    return from == Model::kModelInput ? "input" : model_->nodes()[static_cast<std::size_t>(from)].layer->name();
  }

  void layer(std::size_t k) {
    const ModelNode& m = model_->nodes()[k];
    const std::string name = m.layer->name(), type(m.layer->type());
    const LayerOptions& options = model_->layer_options(k);
    const Shape input = input_shape(m, 0);
    const std::string in = input_name(m, 0);
    const auto dims = static_cast<std::size_t>(std::max(input.rank() - 2, 0));
    if (type == "conv") {
      const Tensor& w = need("param/" + name + ".weight");
      std::vector<std::string> inputs{in, name + ".weight"};
      initializer(name + ".weight", w);
      if (const Tensor* b = find("param/" + name + ".bias")) {
        initializer(name + ".bias", *b);
        inputs.push_back(name + ".bias");
      }
      auto* n = node("Conv", name, inputs, name);
      const auto& wd = w.shape().dims();
      window(n, m, input, std::vector<std::int64_t>(wd.begin() + 2, wd.end()), per_dimension(options, "stride", {1}, dims),
             per_dimension(options, "padding", {0}, dims), per_dimension(options, "dilation", {1}, dims));
      integer(n, "group", 1);
    } else if (type == "maxpool" || type == "avgpool") {
      const auto kernel = per_dimension(options, "kernel", {}, dims);
      auto* n = node(type == "maxpool" ? "MaxPool" : "AveragePool", name, {in}, name);
      window(n, m, input, kernel, per_dimension(options, "stride", kernel, dims),
             per_dimension(options, "padding", {0}, dims), {});
      if (type == "avgpool") integer(n, "count_include_pad", 0);
    } else if (type == "batchnorm") {
      initializer(name + ".weight", need("param/" + name + ".gamma"));
      initializer(name + ".bias", need("param/" + name + ".beta"));
      initializer(name + ".running_mean", need("buffer/" + name + ".0"));
      initializer(name + ".running_var", need("buffer/" + name + ".1"));
      auto* n = node("BatchNormalization", name,
                     {in, name + ".weight", name + ".bias", name + ".running_mean", name + ".running_var"}, name);
      real(n, "epsilon", options.get_float("epsilon", 1e-5));
      real(n, "momentum", 1.0 - options.get_float("momentum", 0.1));  // ONNX's momentum is the old value's share
    } else if (type == "relu") {
      node("Relu", name, {in}, name);
    } else if (type == "leaky_relu") {
      real(node("LeakyRelu", name, {in}, name), "alpha", options.get_float("slope", 0.01));
    } else if (type == "linear") {
      std::vector<std::string> inputs{in, name + ".weight"};
      initializer(name + ".weight", need("param/" + name + ".weight"));
      if (const Tensor* b = find("param/" + name + ".bias")) {
        initializer(name + ".bias", *b);
        inputs.push_back(name + ".bias");
      }
      integer(node("Gemm", name, inputs, name), "transB", 1);
    } else if (type == "flatten") {
      integer(node("Flatten", name, {in}, name), "axis", 1);
    } else if (type == "dropout") {
      auto* ratio = graph_->add_initializer();  // a scalar
      ratio->set_name(name + ".ratio");
      ratio->set_data_type(onnx::TensorProto::FLOAT);
      ratio->add_float_data(static_cast<float>(options.get_float("rate", 0.5)));
      node("Dropout", name, {in, name + ".ratio"}, name);
    } else if (type == "add") {
      // ONNX's Add takes two inputs: more are added in a chain.
      std::string sum = in;
      for (std::size_t i = 1; i < m.inputs.size(); ++i) {
        const std::string out = i + 1 == m.inputs.size() ? name : fmt::format("{}.sum{}", name, i);
        node("Add", i + 1 == m.inputs.size() ? name : out, {sum, input_name(m, i)}, out);
        sum = out;
      }
    } else if (type == "concat") {
      std::vector<std::string> inputs;
      for (std::size_t i = 0; i < m.inputs.size(); ++i) inputs.push_back(input_name(m, i));
      integer(node("Concat", name, inputs, name), "axis", 1);
    } else {
      fail_input("{}: layer '{}' ({}) has no ONNX export", source_, name, type);
    }
  }

  std::string source_;
  std::unique_ptr<Model> model_;
  std::map<std::string, const Tensor*> tensors_;
  onnx::GraphProto* graph_ = nullptr;
};

}  // namespace

std::string export_onnx(const std::string& model_text, const std::string& source, const std::vector<NamedTensor>& tensors) {
  return Exporter(model_text, source, tensors).run();
}

}  // namespace tessera
