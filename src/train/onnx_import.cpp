// ONNX graph -> Tessera model file and weights. See include/tessera/train/onnx.hpp and docs/onnx.md.
#include <onnx/onnx_pb.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <map>
#include <optional>
#include <set>

#include "tessera/core/error.hpp"
#include "tessera/train/model.hpp"
#include "tessera/train/onnx.hpp"

namespace tessera {

const char* const kOnnxImportedOperators =
    "Conv (groups 1, symmetric pads), MaxPool and AveragePool (floor rounding), BatchNormalization, Relu, "
    "LeakyRelu, Gemm, MatMul (+ Add of a bias), Flatten and Reshape to N x features, Add, Concat on channels, "
    "Dropout, Identity, Pad of nothing; Constant, Unsqueeze, Squeeze, Concat and Cast of constants";

namespace {

/// A constant of the graph: an initializer, a Constant node's value, or folded from those.
struct Constant {
  std::vector<std::int64_t> dims;
  std::vector<double> values;  ///< every element type read as double (floats exactly)
  bool is_float = false;
};

/// Elements of a shape of non-negative dimensions (InputError when the count overflows).
std::int64_t product(const std::vector<std::int64_t>& dims) {
  std::int64_t n = 1;
  for (auto d : dims)
    if (__builtin_mul_overflow(n, d, &n))
      fail_input("a tensor of shape [{}] has more elements than Tessera imports", fmt::join(dims, ", "));
  return n;
}

template <typename T>
std::vector<T> raw_values(const std::string& raw, std::int64_t count, const std::string& what) {
  if (static_cast<std::int64_t>(raw.size()) != count * static_cast<std::int64_t>(sizeof(T)))
    fail_input("tensor '{}' holds {} bytes of data for {} elements", what, raw.size(), count);
  std::vector<T> out(static_cast<std::size_t>(count));
  if (count > 0) std::memcpy(out.data(), raw.data(), raw.size());
  return out;
}

/// A TensorProto's elements as float (FLOAT) or as double (integers, DOUBLE).
Constant read_tensor(const onnx::TensorProto& t, const std::string& source) {
  const std::string what = t.name().empty() ? std::string("(unnamed)") : t.name();
  if (t.has_data_location() && t.data_location() == onnx::TensorProto::EXTERNAL)
    fail_input("{}: tensor '{}' keeps its data in an external file; export with the weights inside the .onnx file",
               source, what);
  Constant c;
  for (auto d : t.dims()) {
    if (d < 0) fail_input("{}: tensor '{}' has a negative dimension {}", source, what, d);
    c.dims.push_back(d);
  }
  const std::int64_t n = product(c.dims);
  if (n > (std::int64_t{1} << 31)) fail_input("{}: tensor '{}' has {} elements, more than Tessera imports", source, what, n);
  const bool raw = t.has_raw_data();
  const auto take = [&](auto&& values) {
    if (static_cast<std::int64_t>(values.size()) != n)
      fail_input("{}: tensor '{}' has {} values for its shape [{}]", source, what, values.size(), fmt::join(c.dims, ", "));
    c.values.assign(values.begin(), values.end());
  };
  switch (t.data_type()) {
      case onnx::TensorProto::FLOAT:
        c.is_float = true;
        if (raw) take(raw_values<float>(t.raw_data(), n, what));
        else take(t.float_data());
        break;
      case onnx::TensorProto::DOUBLE:
        if (raw) take(raw_values<double>(t.raw_data(), n, what));
        else take(t.double_data());
        break;
      case onnx::TensorProto::INT64:
        if (raw) take(raw_values<std::int64_t>(t.raw_data(), n, what));
        else take(t.int64_data());
        break;
      case onnx::TensorProto::INT32:
        if (raw) take(raw_values<std::int32_t>(t.raw_data(), n, what));
        else take(t.int32_data());
        break;
      case onnx::TensorProto::BOOL:
        if (raw) take(raw_values<std::uint8_t>(t.raw_data(), n, what));
        else take(t.int32_data());
        break;
      default:
        fail_input("{}: tensor '{}' has ONNX element type {}; Tessera imports float32 weights (and integer or "
                   "boolean constants)", source, what, static_cast<int>(t.data_type()));
  }
  return c;
}

/// A float constant as a Tensor of its shape (`dims` when given, e.g. a bias of shape [1, out]).
Tensor float_tensor(const Constant& c, std::vector<std::int64_t> dims = {}) {
  if (dims.empty()) dims = c.dims;
  Tensor t{Shape(dims)};
  for (std::size_t i = 0; i < c.values.size(); ++i) t.data()[i] = static_cast<float>(c.values[i]);
  return t;
}

/// The layer name a node gives: PyTorch's "/conv1/Conv" -> "conv1", "/layer1/0/relu/Relu" ->
/// "layer1_0_relu", "/Relu_1" -> "relu_1"; only letters, digits and '_'.
std::string name_from_node(const onnx::NodeProto& node) {
  std::vector<std::string> parts;
  std::string part;
  for (char ch : node.name() + "/") {
    if (ch == '/') {
      if (!part.empty()) parts.push_back(part);
      part.clear();
    } else {
      part += ch;
    }
  }
  if (parts.size() > 1 && parts.back().rfind(node.op_type(), 0) == 0) parts.pop_back();
  else if (parts.size() == 1 && parts[0].rfind(node.op_type(), 0) == 0)  // "/Relu_1" -> "relu_1"
    for (char& ch : parts[0]) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : "_") + p;
  for (char& ch : out)
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '_') ch = '_';
  return out;
}

std::string list_text(const std::vector<std::int64_t>& values) {
  if (!values.empty() && std::all_of(values.begin(), values.end(), [&](auto v) { return v == values[0]; }))
    return fmt::format("{}", values[0]);
  return fmt::format("[{}]", fmt::join(values, ", "));
}

/// Six significant digits: the decimal a producer's double became as a float attribute (1e-05,
/// not 9.99999975e-06).
std::string real_text(double value) { return fmt::format("{:.6g}", value); }

class Importer {
 public:
  Importer(const onnx::ModelProto& model, const std::string& source, const OnnxImportOptions& options)
      : model_(model), graph_(model.graph()), source_(source), options_(options) {}

  ImportedModel run() {
    read_opset();
    for (const auto& init : graph_.initializer()) constants_[init.name()] = read_tensor(init, source_);
    read_input();
    count_consumers();
    for (int i = 0; i < graph_.node_size(); ++i) visit(i);
    return finish();
  }

 private:
  struct Layer {
    std::string name, type;
    std::vector<std::pair<std::string, std::string>> options;
    std::vector<std::string> inputs;
    std::string node;  ///< "node '<name>' (<op>)" for messages
  };

  [[noreturn]] void refuse(const onnx::NodeProto& node, const std::string& why) const {
    fail_input("{}: {}: {}", source_, describe(node), why);
  }
  std::string describe(const onnx::NodeProto& node) const {
    return fmt::format("node '{}' ({})", node.name().empty() ? node.output_size() ? node.output(0) : "" : node.name(),
                       node.op_type());
  }

  void read_opset() {
    if (!model_.has_graph()) fail_input("{}: not an ONNX model (no graph); is it a truncated or other file?", source_);
    for (const auto& op : model_.opset_import())
      if (op.domain().empty() || op.domain() == "ai.onnx") opset_ = op.version();
    if (opset_ <= 0) fail_input("{}: the model names no version of ONNX's default operator set", source_);
  }

  void read_input() {
    std::vector<const onnx::ValueInfoProto*> inputs;
    for (const auto& in : graph_.input())
      if (!constants_.count(in.name())) inputs.push_back(&in);
    if (inputs.size() != 1)
      fail_input("{}: the graph has {} inputs besides its weights; Tessera's models have one (the batch)", source_,
                 inputs.size());
    const auto& in = *inputs[0];
    if (!in.type().has_tensor_type() || !in.type().tensor_type().has_shape())
      fail_input("{}: graph input '{}' has no tensor shape", source_, in.name());
    const auto& type = in.type().tensor_type();
    if (type.elem_type() != onnx::TensorProto::FLOAT)
      fail_input("{}: graph input '{}' has element type {}; Tessera's inputs are float32", source_, in.name(),
                 static_cast<int>(type.elem_type()));
    const auto& dims = type.shape().dim();
    if (dims.size() != 2 && dims.size() != 4 && dims.size() != 5)
      fail_input("{}: graph input '{}' has {} dimensions; Tessera reads N x features, N x C x H x W or "
                 "N x C x D x H x W", source_, in.name(), dims.size());
    for (int d = 1; d < dims.size(); ++d) {
      if (!dims[d].has_dim_value() || dims[d].dim_value() <= 0)
        fail_input("{}: graph input '{}' has no fixed size in dimension {}; only the batch may vary", source_,
                   in.name(), d);
      sample_.push_back(dims[d].dim_value());
    }
    producer_[in.name()] = "input";
  }

  void count_consumers() {
    for (const auto& node : graph_.node())
      for (const auto& name : node.input())
        if (!name.empty()) ++consumers_[name];
    for (const auto& out : graph_.output()) ++consumers_[out.name()];
  }

  // --- attributes and inputs --------------------------------------------------------------------

  const onnx::AttributeProto* attribute(const onnx::NodeProto& node, const std::string& name) const {
    for (const auto& a : node.attribute())
      if (a.name() == name) return &a;
    return nullptr;
  }
  std::int64_t int_attribute(const onnx::NodeProto& node, const std::string& name, std::int64_t fallback) const {
    const auto* a = attribute(node, name);
    return a ? a->i() : fallback;
  }
  double float_attribute(const onnx::NodeProto& node, const std::string& name, double fallback) const {
    const auto* a = attribute(node, name);
    return a ? a->f() : fallback;
  }
  std::vector<std::int64_t> ints_attribute(const onnx::NodeProto& node, const std::string& name,
                                           std::vector<std::int64_t> fallback) const {
    const auto* a = attribute(node, name);
    return a ? std::vector<std::int64_t>(a->ints().begin(), a->ints().end()) : fallback;
  }
  std::string string_attribute(const onnx::NodeProto& node, const std::string& name, const std::string& fallback) const {
    const auto* a = attribute(node, name);
    return a ? a->s() : fallback;
  }

  bool has_input(const onnx::NodeProto& node, int i) const { return node.input_size() > i && !node.input(i).empty(); }

  /// The layer that produces the tensor a node reads as data.
  std::string data(const onnx::NodeProto& node, int i) const {
    if (!has_input(node, i)) refuse(node, fmt::format("input {} is missing", i));
    const auto found = producer_.find(node.input(i));
    if (found != producer_.end()) return found->second;
    if (constants_.count(node.input(i)))
      refuse(node, fmt::format("input '{}' is a constant where Tessera needs an activation ({} works on the data "
                               "flowing from the graph's input)", node.input(i), node.op_type()));
    refuse(node, fmt::format("input '{}' comes from no node Tessera imports (what produces it is not supported, "
                             "or the graph is not sorted)", node.input(i)));
  }

  const Constant& constant(const onnx::NodeProto& node, int i, const std::string& what) const {
    if (!has_input(node, i)) refuse(node, fmt::format("its {} (input {}) is missing", what, i));
    const auto found = constants_.find(node.input(i));
    if (found == constants_.end())
      refuse(node, fmt::format("its {} ('{}') must be a constant (an initializer), as exported with the weights",
                               what, node.input(i)));
    return found->second;
  }

  const Constant& weight(const onnx::NodeProto& node, int i, const std::string& what) const {
    const Constant& c = constant(node, i, what);
    if (!c.is_float) refuse(node, fmt::format("its {} '{}' is not float32", what, node.input(i)));
    return c;
  }

  /// Only the first output may be read by other nodes or the graph.
  void only_first_output_used(const onnx::NodeProto& node) const {
    for (int i = 1; i < node.output_size(); ++i)
      if (!node.output(i).empty() && consumers_.count(node.output(i)))
        refuse(node, fmt::format("its output {} ('{}') is used; Tessera computes only the first", i, node.output(i)));
  }

  // --- layers -----------------------------------------------------------------------------------

  std::string layer_name(const onnx::NodeProto& node, const std::string& weight_name) {
    std::string base = name_from_node(node);
    if (base.empty() && !weight_name.empty()) {
      base = weight_name;
      if (base.size() > 7 && base.ends_with(".weight")) base.resize(base.size() - 7);
      for (char& ch : base)
        if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '_') ch = '_';
    }
    if (base.empty()) {
      base = node.op_type();
      for (char& ch : base) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    }
    if (base == "input") base = "input_layer";
    std::string name = base;
    for (int k = 2; names_.count(name); ++k) name = fmt::format("{}_{}", base, k);
    names_.insert(name);
    return name;
  }

  Layer& add_layer(const onnx::NodeProto& node, const std::string& type, std::vector<std::string> inputs,
                   const std::string& weight_name = "") {
    Layer layer;
    layer.name = layer_name(node, weight_name);
    layer.type = type;
    layer.inputs = std::move(inputs);
    layer.node = describe(node);
    producer_[node.output(0)] = layer.name;
    layers_.push_back(std::move(layer));
    return layers_.back();
  }

  void add_tensor(const std::string& name, Tensor value) { tensors_.push_back({name, std::move(value)}); }

  /// kernel/stride/padding (and dilation) of a convolution or pool, with ONNX's rules checked.
  void window_options(const onnx::NodeProto& node, Layer& layer, const std::vector<std::int64_t>& kernel,
                      bool conv) {
    const std::size_t dims = kernel.size();
    const auto strides = ints_attribute(node, "strides", std::vector<std::int64_t>(dims, 1));
    const auto pads = ints_attribute(node, "pads", std::vector<std::int64_t>(2 * dims, 0));
    const auto dilations = ints_attribute(node, "dilations", std::vector<std::int64_t>(dims, 1));
    const std::string auto_pad = string_attribute(node, "auto_pad", "NOTSET");
    if (auto_pad != "NOTSET" && auto_pad != "VALID")
      refuse(node, fmt::format("auto_pad = {} is not supported; export with explicit pads", auto_pad));
    if (strides.size() != dims || pads.size() != 2 * dims || dilations.size() != dims)
      refuse(node, fmt::format("strides, pads or dilations do not match its {}-D kernel", dims));
    std::vector<std::int64_t> padding(dims, 0);
    for (std::size_t d = 0; d < dims; ++d) {
      if (auto_pad == "VALID") break;
      if (pads[d] != pads[d + dims])
        refuse(node, fmt::format("pads [{}] differ at the two ends of a dimension; Tessera pads both ends alike",
                                 fmt::join(pads, ", ")));
      padding[d] = pads[d];
    }
    if (!conv && std::any_of(dilations.begin(), dilations.end(), [](auto v) { return v != 1; }))
      refuse(node, fmt::format("dilations [{}] are not supported for pooling", fmt::join(dilations, ", ")));
    layer.options.push_back({"kernel", list_text(kernel)});
    // Written where it differs from Tessera's default: 1 for conv, the kernel for pools.
    if (strides != (conv ? std::vector<std::int64_t>(dims, 1) : kernel))
      layer.options.push_back({"stride", list_text(strides)});
    if (std::any_of(padding.begin(), padding.end(), [](auto v) { return v != 0; }))
      layer.options.push_back({"padding", list_text(padding)});
    if (conv && std::any_of(dilations.begin(), dilations.end(), [](auto v) { return v != 1; }))
      layer.options.push_back({"dilation", list_text(dilations)});
  }

  void conv(const onnx::NodeProto& node) {
    const std::string in = data(node, 0);
    const Constant& w = weight(node, 1, "weight");
    if (w.dims.size() != 4 && w.dims.size() != 5)
      refuse(node, fmt::format("its weight has shape [{}]; Tessera's convolutions are 2-D or 3-D", fmt::join(w.dims, ", ")));
    if (const auto group = int_attribute(node, "group", 1); group != 1)
      refuse(node, fmt::format("group = {} (a grouped or depthwise convolution) is not supported; Tessera's conv has "
                               "group = 1", group));
    const std::vector<std::int64_t> kernel(w.dims.begin() + 2, w.dims.end());
    if (const auto* a = attribute(node, "kernel_shape"); a && std::vector<std::int64_t>(a->ints().begin(), a->ints().end()) != kernel)
      refuse(node, fmt::format("kernel_shape does not match its weight's shape [{}]", fmt::join(w.dims, ", ")));
    Layer& layer = add_layer(node, "conv", {in}, node.input(1));
    layer.options.push_back({"filters", fmt::format("{}", w.dims[0])});
    window_options(node, layer, kernel, true);
    add_tensor("param/" + layer.name + ".weight", float_tensor(w));
    if (has_input(node, 2)) {
      const Constant& b = weight(node, 2, "bias");
      if (product(b.dims) != w.dims[0]) refuse(node, fmt::format("its bias has shape [{}], not [{}]", fmt::join(b.dims, ", "), w.dims[0]));
      add_tensor("param/" + layer.name + ".bias", float_tensor(b, {w.dims[0]}));
    } else {
      layer.options.push_back({"bias", "false"});
    }
  }

  void pool(const onnx::NodeProto& node, bool max) {
    const std::string in = data(node, 0);
    only_first_output_used(node);
    const auto kernel = ints_attribute(node, "kernel_shape", {});
    if (kernel.size() != 2 && kernel.size() != 3) refuse(node, "kernel_shape must name 2 or 3 spatial dimensions");
    if (int_attribute(node, "ceil_mode", 0) != 0)
      refuse(node, "ceil_mode = 1 is not supported; Tessera's pools round the output size down (ceil_mode = 0)");
    Layer& layer = add_layer(node, max ? "maxpool" : "avgpool", {in});
    window_options(node, layer, kernel, false);
    const bool padded = std::any_of(layer.options.begin(), layer.options.end(), [](auto& o) { return o.first == "padding"; });
    if (!max && padded && int_attribute(node, "count_include_pad", 0) != 0)
      refuse(node, "count_include_pad = 1 with padding is not supported; Tessera averages over the window's part "
                   "inside the input (count_include_pad = 0)");
  }

  void batch_norm(const onnx::NodeProto& node) {
    const std::string in = data(node, 0);
    only_first_output_used(node);
    const Constant& scale = weight(node, 1, "scale");
    const Constant& bias = weight(node, 2, "bias");
    const Constant& mean = weight(node, 3, "running mean");
    const Constant& var = weight(node, 4, "running variance");
    const std::int64_t c = product(scale.dims);
    for (const Constant* t : {&bias, &mean, &var})
      if (product(t->dims) != c) refuse(node, "its scale, bias, mean and variance differ in length");
    Layer& layer = add_layer(node, "batchnorm", {in}, node.input(1));
    layer.options.push_back({"global", "true"});
    const double epsilon = float_attribute(node, "epsilon", 1e-5);
    const double momentum = 1.0 - float_attribute(node, "momentum", 0.9);  // ONNX keeps the old value's share
    if (real_text(epsilon) != "1e-05") layer.options.push_back({"epsilon", real_text(epsilon)});
    if (real_text(momentum) != "0.1") layer.options.push_back({"momentum", real_text(momentum)});
    add_tensor("param/" + layer.name + ".gamma", float_tensor(scale, {c}));
    add_tensor("param/" + layer.name + ".beta", float_tensor(bias, {c}));
    add_tensor("buffer/" + layer.name + ".0", float_tensor(mean, {c}));
    add_tensor("buffer/" + layer.name + ".1", float_tensor(var, {c}));
  }

  void linear(const onnx::NodeProto& node, bool gemm) {
    const std::string in = data(node, 0);
    const Constant& w = weight(node, 1, "weight");
    if (w.dims.size() != 2) refuse(node, fmt::format("its weight has shape [{}]; a linear layer's is 2-D", fmt::join(w.dims, ", ")));
    bool transposed = !gemm;  // MatMul's B is [in, out]; Tessera's weight is [out, in], as Gemm's with transB = 1
    const onnx::NodeProto* bias_add = nullptr;
    const Constant* bias = nullptr;
    if (gemm) {
      if (int_attribute(node, "transA", 0) != 0) refuse(node, "transA = 1 is not supported");
      if (float_attribute(node, "alpha", 1.0) != 1.0 || float_attribute(node, "beta", 1.0) != 1.0)
        refuse(node, "alpha and beta other than 1 are not supported");
      transposed = int_attribute(node, "transB", 0) == 0;
      if (has_input(node, 2)) bias = &weight(node, 2, "bias");
    } else {
      bias_add = bias_of(node);
      if (bias_add) bias = &constants_.at(constants_.count(bias_add->input(0)) ? bias_add->input(0) : bias_add->input(1));
    }
    const std::int64_t out = transposed ? w.dims[1] : w.dims[0], features = transposed ? w.dims[0] : w.dims[1];
    Layer& layer = add_layer(node, "linear", {in}, node.input(1));
    layer.options.push_back({"out", fmt::format("{}", out)});
    Tensor weights{Shape({out, features})};
    for (std::int64_t o = 0; o < out; ++o)
      for (std::int64_t f = 0; f < features; ++f)
        weights.data()[o * features + f] =
            static_cast<float>(w.values[static_cast<std::size_t>(transposed ? f * out + o : o * features + f)]);
    add_tensor("param/" + layer.name + ".weight", std::move(weights));
    if (bias) {
      if (product(bias->dims) != out)
        refuse(node, fmt::format("its bias has shape [{}], not [{}]", fmt::join(bias->dims, ", "), out));
      add_tensor("param/" + layer.name + ".bias", float_tensor(*bias, {out}));
    } else {
      layer.options.push_back({"bias", "false"});
    }
    if (bias_add) {
      producer_[bias_add->output(0)] = layer.name;
      absorbed_.insert(bias_add);
    }
  }

  /// The Add that adds a constant bias to a MatMul's output, when it is its only reader.
  const onnx::NodeProto* bias_of(const onnx::NodeProto& matmul) const {
    const std::string& out = matmul.output(0);
    const auto used = consumers_.find(out);
    if (used == consumers_.end() || used->second != 1) return nullptr;
    for (const auto& node : graph_.node())
      if (node.op_type() == "Add" && node.input_size() == 2 && (node.input(0) == out || node.input(1) == out)) {
        const std::string other = node.input(0) == out ? node.input(1) : node.input(0);
        const auto c = constants_.find(other);
        if (c != constants_.end() && c->second.is_float) return &node;
      }
    return nullptr;
  }

  void to_features(const onnx::NodeProto& node, bool reshape) {
    const std::string in = data(node, 0);
    if (reshape) {
      const Constant& shape = constant(node, 1, "shape");
      const auto& v = shape.values;
      const bool to_2d = v.size() == 2 && (v[0] >= 0 || v[1] >= 0) && v[1] != 0;
      if (!to_2d || int_attribute(node, "allowzero", 0) != 0)
        refuse(node, fmt::format("a reshape to [{}] is not supported; Tessera reshapes only N x ... to N x features "
                                 "(torch.flatten(x, 1), or x.view(x.size(0), -1))", fmt::join(v, ", ")));
    } else if (const auto axis = int_attribute(node, "axis", 1); axis != 1) {
      refuse(node, fmt::format("axis = {} is not supported; Tessera flattens everything but the batch (axis = 1)", axis));
    }
    add_layer(node, "flatten", {in});
  }

  void merge(const onnx::NodeProto& node, bool add) {
    if (add && node.input_size() == 2 && (constants_.count(node.input(0)) || constants_.count(node.input(1))))
      refuse(node, "adding a constant is supported only as a MatMul's bias (the Add right after it)");
    if (!add) {
      const auto axis = int_attribute(node, "axis", 1);
      if (axis != 1) refuse(node, fmt::format("axis = {} is not supported; Tessera concatenates channels (axis = 1)", axis));
    }
    if (node.input_size() < 2) refuse(node, "it needs at least two inputs");
    std::vector<std::string> inputs;
    for (int i = 0; i < node.input_size(); ++i) inputs.push_back(data(node, i));
    add_layer(node, add ? "add" : "concat", inputs);
  }

  void dropout(const onnx::NodeProto& node) {
    const std::string in = data(node, 0);
    only_first_output_used(node);
    double rate = float_attribute(node, "ratio", 0.5);
    if (has_input(node, 1)) {
      const Constant& ratio = constant(node, 1, "ratio");
      if (ratio.values.size() != 1) refuse(node, "its ratio is not a scalar");
      rate = ratio.values[0];
    }
    if (!(rate >= 0 && rate < 1)) refuse(node, fmt::format("ratio {} is not in [0, 1)", rate));
    Layer& layer = add_layer(node, "dropout", {in});
    layer.options.push_back({"rate", real_text(rate)});
  }

  /// A Pad that pads nothing (PyTorch writes one before an AveragePool) passes its input on.
  void pad(const onnx::NodeProto& node) {
    const std::string in = data(node, 0);
    std::vector<double> pads;
    if (has_input(node, 1)) pads = constant(node, 1, "pads").values;
    else for (auto v : ints_attribute(node, "pads", {})) pads.push_back(static_cast<double>(v));
    if (std::any_of(pads.begin(), pads.end(), [](double v) { return v != 0; }))
      refuse(node, fmt::format("pads [{}] are not supported; Tessera pads inside a convolution or pool (their own "
                               "pads; an average pool with count_include_pad = 0)", fmt::join(pads, ", ")));
    producer_[node.output(0)] = in;
  }

  /// Folds a node whose inputs are all constants (shape arithmetic); false when it is not such a node.
  bool fold(const onnx::NodeProto& node) {
    if (node.op_type() == "Constant") {
      Constant c;
      const auto* value = attribute(node, "value");
      const auto* value_float = attribute(node, "value_float");
      const auto* value_int = attribute(node, "value_int");
      const auto* value_ints = attribute(node, "value_ints");
      const auto* value_floats = attribute(node, "value_floats");
      if (value) {
        c = read_tensor(value->t(), source_);
      } else if (value_float) {
        c.values = {value_float->f()};
        c.is_float = true;
      } else if (value_int) {
        c.values = {static_cast<double>(value_int->i())};
      } else if (value_ints) {
        c.values.assign(value_ints->ints().begin(), value_ints->ints().end());
        c.dims = {static_cast<std::int64_t>(c.values.size())};
      } else if (value_floats) {
        c.values.assign(value_floats->floats().begin(), value_floats->floats().end());
        c.dims = {static_cast<std::int64_t>(c.values.size())};
        c.is_float = true;
      } else {
        refuse(node, "a Constant of this kind (sparse or string) is not supported");
      }
      constants_[node.output(0)] = c;
      return true;
    }
    static const std::set<std::string> foldable{"Unsqueeze", "Squeeze", "Concat", "Cast", "Identity"};
    if (!foldable.count(node.op_type()) || node.input_size() == 0) return false;
    for (const auto& name : node.input())
      if (!name.empty() && !constants_.count(name)) return false;
    Constant c = constants_.at(node.input(0));
    if (node.op_type() == "Concat") {
      for (int i = 1; i < node.input_size(); ++i) {
        const Constant& more = constants_.at(node.input(i));
        c.values.insert(c.values.end(), more.values.begin(), more.values.end());
      }
      if (c.dims.size() > 1) refuse(node, "concatenating constants of more than one dimension is not supported");
      c.dims = {static_cast<std::int64_t>(c.values.size())};
    } else if (node.op_type() == "Unsqueeze" || node.op_type() == "Squeeze") {
      // Shape arithmetic: only the element count matters to the reshape that reads it.
      c.dims = c.values.size() == 1 ? std::vector<std::int64_t>{1} : std::vector<std::int64_t>{static_cast<std::int64_t>(c.values.size())};
    } else if (node.op_type() == "Cast") {
      const auto to = int_attribute(node, "to", onnx::TensorProto::FLOAT);
      c.is_float = to == onnx::TensorProto::FLOAT;
    }
    constants_[node.output(0)] = c;
    return true;
  }

  void visit(int index) {
    const onnx::NodeProto& node = graph_.node(index);
    if (absorbed_.count(&node)) return;
    if (!node.domain().empty() && node.domain() != "ai.onnx")
      refuse(node, fmt::format("operators of domain '{}' are not supported; Tessera imports {}", node.domain(),
                               kOnnxImportedOperators));
    if (node.output_size() == 0) refuse(node, "it has no output");
    if (fold(node)) return;
    const std::string& op = node.op_type();
    if (op == "Conv") conv(node);
    else if (op == "MaxPool") pool(node, true);
    else if (op == "AveragePool") pool(node, false);
    else if (op == "BatchNormalization") batch_norm(node);
    else if (op == "Relu") add_layer(node, "relu", {data(node, 0)});
    else if (op == "LeakyRelu") {
      Layer& layer = add_layer(node, "leaky_relu", {data(node, 0)});
      layer.options.push_back({"slope", real_text(float_attribute(node, "alpha", 0.01))});
    } else if (op == "Gemm") linear(node, true);
    else if (op == "MatMul") linear(node, false);
    else if (op == "Flatten") to_features(node, false);
    else if (op == "Reshape") to_features(node, true);
    else if (op == "Add") merge(node, true);
    else if (op == "Concat") merge(node, false);
    else if (op == "Dropout") dropout(node);
    else if (op == "Identity") producer_[node.output(0)] = data(node, 0);
    else if (op == "Pad") pad(node);
    else
      refuse(node, fmt::format("operator {} is not supported; Tessera imports {}", op, kOnnxImportedOperators));
  }

  ImportedModel finish() {
    if (graph_.output_size() != 1)
      fail_input("{}: the graph has {} outputs; Tessera's models have one", source_, graph_.output_size());
    const auto found = producer_.find(graph_.output(0).name());
    if (found == producer_.end() || found->second == "input")
      fail_input("{}: the graph's output '{}' is not computed by any layer Tessera imports", source_,
                 graph_.output(0).name());
    if (layers_.empty()) fail_input("{}: the graph has no layers", source_);

    std::string loss = options_.loss, name = options_.name;
    for (const auto& p : model_.metadata_props()) {
      if (p.key() == "tessera.loss" && loss.empty()) loss = p.value();
      if (p.key() == "tessera.name" && name.empty()) name = p.value();
    }
    if (loss.empty()) loss = "softmax_cross_entropy";
    if (loss != "softmax_cross_entropy" && loss != "mse")
      fail_input("{}: unknown loss '{}'; use softmax_cross_entropy or mse", source_, loss);
    if (name.empty()) name = options_.fallback_name;
    for (char& ch : name)
      if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '_' && ch != '-') ch = '_';

    std::string text = "# Imported from an ONNX graph by `tessera import onnx`; its weights are in weights.h5.\n";
    text += fmt::format("name: {}\ninput: {{shape: [{}]}}\nlayers:\n", name, fmt::join(sample_, ", "));
    std::string previous = "input";
    for (const auto& layer : layers_) {
      std::string entry = fmt::format("  - {{name: {}, type: {}", layer.name, layer.type);
      for (const auto& [key, value] : layer.options) entry += fmt::format(", {}: {}", key, value);
      if (layer.inputs.size() > 1) entry += fmt::format(", inputs: [{}]", fmt::join(layer.inputs, ", "));
      else if (layer.inputs[0] != previous) entry += fmt::format(", inputs: {}", layer.inputs[0]);
      text += entry + "}\n";
      previous = layer.name;
    }
    if (found->second != layers_.back().name) text += fmt::format("output: {}\n", found->second);
    text += fmt::format("loss: {}\n", loss);
    check(text);
    return {text, std::move(tensors_)};
  }

  /// Parses the model as Tessera does and checks every imported tensor against the layer's own.
  void check(const std::string& text) {
    ModelOptions model_options;
    model_options.allocate_parameters = false;
    Model model = [&] {
      try {
        return Model::parse(text, source_, model_options);
      } catch (const InputError& e) {
        fail_input("{}: the graph does not make a Tessera model (its shapes do not chain): {}", source_, e.message());
      }
    }();
    std::map<std::string, std::vector<std::int64_t>> expected;
    std::map<std::string, std::string> node_of;
    for (auto& node : model.nodes()) {
      for (Parameter* p : node.layer->parameters()) expected["param/" + p->name] = p->whole_shape();
      const auto buffers = node.layer->buffers();
      for (std::size_t i = 0; i < buffers.size(); ++i)
        expected[fmt::format("buffer/{}.{}", node.layer->name(), i)] = buffers[i]->shape().dims();
    }
    for (const auto& layer : layers_) node_of[layer.name] = layer.node;
    for (const auto& t : tensors_) {
      const auto want = expected.find(t.name);
      const std::string layer = t.name.substr(t.name.find('/') + 1, t.name.rfind('.') - t.name.find('/') - 1);
      if (want == expected.end()) fail("{}: imported tensor '{}' belongs to no layer of the model", source_, t.name);
      if (want->second != t.value.shape().dims())
        fail_input("{}: {}: its tensor '{}' has shape [{}], but the layer's input makes it [{}]: the graph's shapes "
                   "do not chain", source_, node_of[layer], t.name, fmt::join(t.value.shape().dims(), ", "),
                   fmt::join(want->second, ", "));
      expected.erase(want);
    }
    if (!expected.empty()) fail("{}: no imported value for '{}'", source_, expected.begin()->first);
  }

  const onnx::ModelProto& model_;
  const onnx::GraphProto& graph_;
  std::string source_;
  OnnxImportOptions options_;
  std::int64_t opset_ = 0;
  std::vector<std::int64_t> sample_;
  std::map<std::string, Constant> constants_;
  std::map<std::string, std::string> producer_;  ///< tensor -> the layer computing it ("input": the graph's)
  std::map<std::string, int> consumers_;         ///< tensor -> how many nodes (and graph outputs) read it
  std::set<const onnx::NodeProto*> absorbed_;     ///< bias Adds folded into their MatMul
  std::set<std::string> names_;
  std::vector<Layer> layers_;
  std::vector<NamedTensor> tensors_;
};

}  // namespace

ImportedModel import_onnx(const std::string& bytes, const std::string& source, const OnnxImportOptions& options) {
  onnx::ModelProto model;
  if (bytes.empty()) fail_input("{}: the file is empty", source);
  if (!model.ParseFromString(bytes))
    fail_input("{}: not a valid ONNX model (the protobuf does not parse: a truncated or other file?)", source);
  return Importer(model, source, options).run();
}

}  // namespace tessera
