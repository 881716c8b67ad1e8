#include "tessera/train/model.hpp"

#include <yaml-cpp/yaml.h>

#include <map>
#include <set>

#include "tessera/core/error.hpp"
#include "tessera/parallel/yaml_file.hpp"

namespace tessera {
namespace {

std::string describe(const YAML::Node& node) {
  if (node.IsScalar()) return "'" + node.Scalar() + "'";
  if (node.IsSequence()) return "a list";
  if (node.IsMap()) return "a mapping";
  return "nothing";
}

LayerOptions to_options(const YAML::Node& entry, const std::string& context) {
  LayerOptions options(context);
  for (const auto& item : entry) {
    const auto key = item.first.as<std::string>();
    if (key == "name" || key == "type" || key == "inputs") continue;
    const YAML::Node& value = item.second;
    if (value.IsScalar()) {
      options.set(key, value.Scalar());
    } else if (value.IsSequence()) {
      std::vector<std::string> items;
      for (const auto& v : value) {
        if (!v.IsScalar()) fail_input("{}: parameter '{}' must be a list of numbers", context, key);
        items.push_back(v.Scalar());
      }
      options.set_list(key, std::move(items));
    } else {
      fail_input("{}: parameter '{}' must be a number, a word or a list, not {}", context, key, describe(value));
    }
  }
  return options;
}

Shape parse_input_shape(const YAML::Node& input, const std::string& source) {
  const YAML::Node shape = input.IsMap() ? input["shape"] : input;
  if (!shape || !shape.IsSequence() || shape.size() == 0 || shape.size() > 4)
    fail_input("model file '{}': 'input' needs 'shape: [C, H, W]', '[C, D, H, W]' or '[features]'", source);
  std::vector<std::int64_t> dims;
  // At most 2^31 - 1 elements per sample, so that no shape arithmetic downstream overflows (fuzzing
  // found "shape: [9223372036854775807, 9223372036854775807]").
  constexpr std::int64_t kLargestSample = 2147483647;
  std::int64_t elements = 1;
  for (const auto& d : shape) {
    std::int64_t v = 0;
    try {
      v = d.as<std::int64_t>();
    } catch (const YAML::Exception&) {
      fail_input("model file '{}': input shape entries must be positive integers, got {}", source, describe(d));
    }
    if (v < 1) fail_input("model file '{}': input shape entries must be positive integers, got {}", source, v);
    if (__builtin_mul_overflow(elements, v, &elements) || elements > kLargestSample)
      fail_input("model file '{}': an input sample of more than {} elements is beyond what Tessera accepts", source,
                 kLargestSample);
    dims.push_back(v);
  }
  if (input.IsMap())
    for (const auto& item : input)
      if (item.first.as<std::string>() != "shape")
        fail_input("model file '{}': unknown key 'input.{}' (known: shape)", source, item.first.as<std::string>());
  if (dims.size() == 1) return Shape({dims[0]}, {DimKind::Feature});
  std::vector<DimKind> kinds{DimKind::Channel};
  for (std::size_t i = 1; i < dims.size(); ++i) kinds.push_back(DimKind::Spatial);
  return Shape(dims, kinds);
}

Shape with_batch(const Shape& sample, std::int64_t batch) {
  std::vector<std::int64_t> dims{batch};
  std::vector<DimKind> kinds{DimKind::Sample};
  dims.insert(dims.end(), sample.dims().begin(), sample.dims().end());
  kinds.insert(kinds.end(), sample.kinds().begin(), sample.kinds().end());
  return Shape(dims, kinds);
}

}  // namespace

Model Model::load(const std::string& path, const ModelOptions& options) {
  return parse(read_input_file(path, "model file"), path, options);
}

Model Model::parse(const std::string& yaml_text, const std::string& source, const ModelOptions& options) {
  // yaml-cpp throws its own exceptions for shapes the checks below do not expect (a key that is a
  // list, a name that is a mapping...): still the file's fault, so still an InputError.
  try {
    return parse_unchecked(yaml_text, source, options);
  } catch (const YAML::Exception& e) {
    fail_input("model file '{}': unexpected YAML: {}", source, e.what());
  }
}

Model Model::parse_unchecked(const std::string& yaml_text, const std::string& source, const ModelOptions& model_options) {
  YAML::Node root = parse_yaml_mapping(yaml_text, fmt::format("model file '{}'", source),
                                       "a mapping with 'input', 'layers' and 'loss'");
  static const std::set<std::string> known{"name", "input", "layers", "loss", "output", "precision", "activations"};
  for (const auto& item : root) {
    const auto key = item.first.as<std::string>();
    if (!known.count(key))
      fail_input("model file '{}': unknown key '{}' (known: name, input, layers, loss, output, precision, "
                 "activations)", source, key);
  }
  Model model;
  model.source_ = source;
  double weights = 0;  // whole parameter elements of the layers so far
  // `precision` and `activations`: fp32 or bf16 (`context` names the key in parse_precision's error).
  const auto precision_key = [&](const char* key, const std::string& context) {
    if (!root[key].IsScalar())
      fail_input("model file '{}': '{}' must be fp32 or bf16, not {}", source, key, describe(root[key]));
    return parse_precision(root[key].Scalar(), context);
  };
  if (root["precision"]) model.precision_ = precision_key("precision", fmt::format("model file '{}'", source));
  if (model_options.precision) model.precision_ = *model_options.precision;
  model.activations_ = model.precision_;
  if (root["activations"]) {
    model.activations_ = precision_key("activations", fmt::format("model file '{}' ('activations')", source));
    if (model.activations_ == Precision::BF16 && model.precision_ != Precision::BF16)
      fail_input("model file '{}': 'activations: bf16' needs precision bf16, and the model's is fp32{} (bf16 copies "
                 "of what backward reads are exact only where it computes with bf16 operands)", source,
                 model_options.precision ? " (--precision fp32 replaces the file's)" : "");
  }
  model.name_ = root["name"] ? root["name"].as<std::string>() : std::string("model");
  if (!root["input"]) fail_input("model file '{}': missing 'input' (e.g. input: {{shape: [1, 28, 28]}})", source);
  model.sample_shape_ = parse_input_shape(root["input"], source);
  const YAML::Node layers = root["layers"];
  if (!layers || !layers.IsSequence() || layers.size() == 0)
    fail_input("model file '{}': 'layers' must be a non-empty list", source);

  std::map<std::string, int> index_of;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const YAML::Node entry = layers[i];
    const std::string where = fmt::format("model file '{}', layer #{}", source, i + 1);
    if (!entry.IsMap()) fail_input("{}: expected a mapping like {{name: conv1, type: conv, ...}}", where);
    if (!entry["name"] || !entry["name"].IsScalar()) fail_input("{}: missing 'name'", where);
    const auto name = entry["name"].as<std::string>();
    if (!entry["type"] || !entry["type"].IsScalar()) fail_input("{} ('{}'): missing 'type'", where, name);
    const auto type = entry["type"].as<std::string>();
    if (name == "input") fail_input("{}: 'input' is reserved for the model's input", where);
    if (index_of.count(name)) fail_input("{}: a layer named '{}' already exists", where, name);

    ModelNode node;
    if (entry["inputs"]) {
      const YAML::Node inputs = entry["inputs"];
      std::vector<std::string> names;
      if (inputs.IsScalar()) names.push_back(inputs.Scalar());
      else if (inputs.IsSequence())
        for (const auto& n : inputs) names.push_back(n.as<std::string>());
      else fail_input("{} ('{}'): 'inputs' must be a layer name or a list of them", where, name);
      for (const auto& n : names) {
        if (n == "input") node.inputs.push_back(kModelInput);
        else if (index_of.count(n)) node.inputs.push_back(index_of[n]);
        else fail_input("{} ('{}'): input '{}' is not a layer defined above it (layers must be listed inputs first)",
                        where, name, n);
      }
    } else {
      node.inputs.push_back(i == 0 ? kModelInput : static_cast<int>(i) - 1);
    }
    LayerOptions options = to_options(entry, fmt::format("layer '{}' ({})", name, type));
    // The model-wide precision goes to the layers that compute in one (conv, linear) unless they
    // name their own.
    if (model.precision_ != Precision::F32 && (type == "conv" || type == "linear") && !options.has("precision"))
      options.set("precision", std::string(precision_name(model.precision_)));
    model.layer_specs_.emplace_back(type, options);  // before create_layer marks options as used
    node.layer = create_layer(type, name, static_cast<int>(i), options);
    const int arity = node.layer->arity();
    const int given = static_cast<int>(node.inputs.size());
    if ((arity >= 0 && given != arity) || (arity < 0 && given < 2))
      fail_input("layer '{}' ({}) takes {} input{}, got {}", name, type, arity < 0 ? "two or more" : std::to_string(arity),
                 arity == 1 ? "" : "s", given);
    std::vector<Shape> shapes;
    for (int in : node.inputs)
      shapes.push_back(in == kModelInput ? with_batch(model.sample_shape_, 1) : model.nodes_[static_cast<std::size_t>(in)].output);
    node.layer->defer_parameters(!model_options.allocate_parameters);
    node.output = node.layer->setup(shapes);
    for (const Parameter* p : node.layer->parameters()) {
      double elements = 1;  // exact far beyond any limit, and no overflow
      for (auto d : p->whole_shape()) elements *= static_cast<double>(d);
      weights += elements;
    }
    if (model_options.allocate_parameters && weights > static_cast<double>(model_options.largest_weights))
      fail_input("model file '{}': its layers up to '{}' have {:.0f} weight elements, more than the {} ({} MiB of fp32) "
                 "a model built whole may have (tessera train builds only each rank's blocks, and checks the plan "
                 "against the rank's memory)",
                 source, name, weights, model_options.largest_weights, (model_options.largest_weights * 4) >> 20);
    if (weights > 0x1p62)
      fail_input("model file '{}': its layers up to '{}' have {:.4g} weight elements, more than Tessera can count",
                 source, name, weights);
    for (int in : node.inputs)
      if (in != kModelInput) model.nodes_[static_cast<std::size_t>(in)].consumers.push_back(static_cast<int>(i));
    index_of[name] = static_cast<int>(i);
    model.nodes_.push_back(std::move(node));
  }

  model.output_ = static_cast<int>(model.nodes_.size()) - 1;
  if (root["output"]) {
    const auto out = root["output"].as<std::string>();
    if (!index_of.count(out)) fail_input("model file '{}': 'output' names unknown layer '{}'", source, out);
    model.output_ = index_of[out];
  }
  const YAML::Node loss = root["loss"];
  if (!loss) fail_input("model file '{}': missing 'loss' (softmax_cross_entropy or mse)", source);
  std::string loss_type;
  LayerOptions loss_options(fmt::format("model file '{}', loss", source));
  if (loss.IsScalar()) {
    loss_type = loss.Scalar();
  } else if (loss.IsMap() && loss["type"]) {
    loss_type = loss["type"].as<std::string>();
    loss_options = to_options(loss, loss_options.context());
  } else {
    fail_input("model file '{}': 'loss' must be a loss type or {{type: ...}}", source);
  }
  model.loss_ = create_loss(loss_type, loss_options);
  const Shape& out = model.nodes_[static_cast<std::size_t>(model.output_)].output;
  std::vector<std::int64_t> out_sample(out.dims().begin() + 1, out.dims().end());
  std::vector<DimKind> out_kinds(out.kinds().begin() + 1, out.kinds().end());
  model.target_shape_ = model.loss_->target_shape(Shape(out_sample, out_kinds));

  // Every layer but the output must feed something: a dangling layer is almost always a typo.
  for (std::size_t i = 0; i < model.nodes_.size(); ++i)
    if (static_cast<int>(i) != model.output_ && model.nodes_[i].consumers.empty())
      fail_input("model file '{}': the output of layer '{}' is never used (the model's output is '{}')", source,
                 model.nodes_[i].layer->name(), model.nodes_[static_cast<std::size_t>(model.output_)].layer->name());
  return model;
}

void Model::init_parameters(std::uint64_t seed) {
  allocate_parameters();
  for (auto& n : nodes_) n.layer->init_parameters(seed);
}

void Model::allocate_parameters() {
  for (auto* p : parameters()) p->allocate();
}

std::vector<Parameter*> Model::parameters() {
  std::vector<Parameter*> all;
  for (auto& n : nodes_)
    for (auto* p : n.layer->parameters()) all.push_back(p);
  return all;
}

std::int64_t Model::parameter_count() {
  std::int64_t count = 0;
  for (auto* p : parameters()) {
    std::int64_t n = 1;  // the whole tensor, also when this rank holds a block of it
    for (auto d : p->whole_shape()) n *= d;
    count += n;
  }
  return count;
}

std::unique_ptr<Layer> Model::make_layer(std::size_t node) const {
  TESSERA_CHECK(node < nodes_.size() && node < layer_specs_.size(), "Model::make_layer: no node {}", node);
  const auto& [type, parsed] = layer_specs_[node];
  LayerOptions options = parsed;
  return create_layer(type, nodes_[node].layer->name(), static_cast<int>(node), options);
}

const LayerOptions& Model::layer_options(std::size_t node) const {
  TESSERA_CHECK(node < layer_specs_.size(), "Model::layer_options: no node {}", node);
  return layer_specs_[node].second;
}

Shape Model::input_shape(std::int64_t batch) const { return with_batch(sample_shape_, batch); }

std::vector<PlanLayerInfo> Model::plan_info(std::int64_t global_batch) const {
  std::vector<PlanLayerInfo> info;
  for (const auto& n : nodes_) {
    const int first = n.inputs.front();
    const Shape input = first == kModelInput ? with_batch(sample_shape_, global_batch)
                                             : nodes_[static_cast<std::size_t>(first)].output.with(0, global_batch);
    info.push_back({n.layer->name(), std::string(n.layer->type()), n.output.with(0, global_batch), input,
                    n.layer->spatially_splittable(), n.layer->model_splittable(),
                    n.layer->filter_splittable()});
  }
  return info;
}

}  // namespace tessera
