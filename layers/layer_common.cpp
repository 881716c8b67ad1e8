// create_layer and the helpers every layer shares.
#include <cmath>
#include <functional>
#include <map>

#include <fmt/ranges.h>

#include "layers/layer_common.hpp"
#include "layers/pool_box.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/tensor/box_ops.hpp"

namespace tessera {
namespace {

using Factory = std::unique_ptr<Layer> (*)(const std::string&, int, LayerOptions&);

const std::map<std::string, Factory>& factories() {
  static const std::map<std::string, Factory> table{
      {"conv", make_convolution_layer},   {"maxpool", make_max_pool_layer}, {"avgpool", make_avg_pool_layer},
      {"batchnorm", make_batch_norm_layer}, {"relu", make_relu_layer},      {"leaky_relu", make_leaky_relu_layer},
      {"flatten", make_flatten_layer},    {"dropout", make_dropout_layer},  {"add", make_add_layer},
      {"concat", make_concat_layer},      {"linear", make_linear_layer},
  };
  return table;
}

}  // namespace

std::vector<std::string> layer_types() {
  std::vector<std::string> names;
  for (const auto& [name, factory] : factories()) names.push_back(name);
  return names;
}

std::unique_ptr<Layer> create_layer(const std::string& type, const std::string& name, int id, LayerOptions& options) {
  const auto found = factories().find(type);
  if (found == factories().end())
    fail_input("layer '{}': unknown type '{}'; known types: {}", name, type, fmt::join(layer_types(), ", "));
  try {
    auto layer = found->second(name, id, options);
    options.check_all_used();
    return layer;
  } catch (const InputError& error) {
    // Option errors name the layer through the options' context; when the caller gave none,
    // name it here so the user still learns which layer is wrong.
    if (!options.context().empty() || error.message().rfind("layer '", 0) == 0) throw;
    fail_input("layer '{}' ({}): {}", name, type, error.message());
  }
}

std::string shapes_to_string(const std::vector<Shape>& shapes) {
  std::string text;
  for (std::size_t i = 0; i < shapes.size(); ++i) text += (i ? (i + 1 == shapes.size() ? " and " : ", ") : "") + shapes[i].to_string();
  return text;
}

void check_input_count(const Layer& layer, const std::vector<Shape>& inputs, int arity) {
  if (arity >= 0 && static_cast<int>(inputs.size()) != arity)
    fail_layer(layer, "takes {} input{}, got {}", arity, arity == 1 ? "" : "s", inputs.size());
  if (arity < 0 && inputs.size() < 2) fail_layer(layer, "takes two or more inputs, got {}", inputs.size());
  for (const auto& shape : inputs)
    if (shape.rank() < 2) fail_layer(layer, "input shape {} has no dimension besides the batch", shape.to_string());
}

void check_same_sample_shape(const Layer& layer, const Shape& expected, const Shape& input,
                             const LayerContext& ctx) {
  if (ctx.tile) {
    if (input.rank() != expected.rank() || input.rank() < 3 || input[1] != expected[1] ||
        ctx.tile->window_begin.size() != static_cast<std::size_t>(input.rank() - 2))
      fail_layer(layer, "was set up for input {} but got the tile {}", expected.to_string(), input.to_string());
    return;
  }
  if (input.rank() != expected.rank() || input.with(0, 0) != expected.with(0, 0))
    fail_layer(layer, "was set up for input {} (any batch) but got {}", expected.to_string(), input.to_string());
}

std::vector<std::int64_t> expand_per_dimension(const Layer& layer, const char* option,
                                               const std::vector<std::int64_t>& values, int spatial_dims) {
  if (values.size() == 1) return std::vector<std::int64_t>(static_cast<std::size_t>(spatial_dims), values[0]);
  if (static_cast<int>(values.size()) != spatial_dims)
    fail_layer(layer, "parameter '{}' has {} values but the input has {} spatial dimensions", option, values.size(),
               spatial_dims);
  return values;
}

DnnBackend& backend_of(const Layer& layer, const LayerContext& context) {
  if (!context.backend) fail("{}: the layer context has no DNN backend (executor bug)", describe(layer));
  return *context.backend;
}

ElementwiseKernels& elementwise_of(const LayerContext& context, const Tensor& tensor) {
  if (context.backend) return context.backend->elementwise();
  return elementwise_kernels(tensor.device());
}

void check_same_device(const Layer& layer, const Tensor& first, const Tensor& other) {
  if (first.device() != other.device())
    fail_layer(layer, "inputs on different devices ({} and {})", first.device().to_string(), other.device().to_string());
}

void he_uniform_init(Tensor& tensor, std::uint64_t seed, int layer_id, int parameter_index, std::int64_t fan_in) {
  const float bound = static_cast<float>(std::sqrt(6.0 / static_cast<double>(std::max<std::int64_t>(fan_in, 1))));
  const std::uint64_t stream = rng_substream(RngStream::WeightInit, static_cast<std::uint64_t>(layer_id),
                                             static_cast<std::uint64_t>(parameter_index));
  float* values = tensor.data();
  for (std::int64_t i = 0; i < tensor.numel(); ++i)
    values[i] = (2.0f * random_uniform(seed, stream, static_cast<std::uint64_t>(i)) - 1.0f) * bound;
}

std::int64_t global_index(const std::vector<std::int64_t>& global, const Box& box, std::int64_t local) {
  std::int64_t index = 0, stride = 1;
  for (std::size_t d = global.size(); d-- > 0;) {
    const std::int64_t i = local % box.extent[d];
    local /= box.extent[d];
    index += (box.begin[d] + i) * stride;
    stride *= global[d];
  }
  return index;
}

void he_uniform_init(Parameter& parameter, std::uint64_t seed, int layer_id, int parameter_index, std::int64_t fan_in) {
  if (!parameter.sharded()) {
    he_uniform_init(parameter.value, seed, layer_id, parameter_index, fan_in);
    return;
  }
  const float bound = static_cast<float>(std::sqrt(6.0 / static_cast<double>(std::max<std::int64_t>(fan_in, 1))));
  const std::uint64_t stream = rng_substream(RngStream::WeightInit, static_cast<std::uint64_t>(layer_id),
                                             static_cast<std::uint64_t>(parameter_index));
  float* values = parameter.value.data();
  for (std::int64_t i = 0; i < parameter.value.numel(); ++i) {
    const auto g = static_cast<std::uint64_t>(global_index(parameter.global_shape, parameter.box, i));
    values[i] = (2.0f * random_uniform(seed, stream, g) - 1.0f) * bound;
  }
}

Parameter whole_parameter(const Layer& layer, const std::string& what, const std::vector<std::int64_t>& dims,
                          bool decay) {
  Parameter p{layer.name() + "." + what, Tensor(), Tensor(), decay};
  if (layer.defers_parameters()) {
    p.deferred_shape = dims;
    return p;
  }
  double wanted = 1;  // exact far beyond the limit, and no overflow
  for (auto d : dims) wanted *= static_cast<double>(d);
  if (wanted > static_cast<double>(kLargestLayerWeights))
    fail_layer(layer, "its {} would have {:.4g} elements, more than the {} ({} MiB of fp32) a layer built whole may "
               "have (tessera train builds only each rank's block, and checks the plan against the rank's memory)",
               what, wanted, kLargestLayerWeights, (kLargestLayerWeights * 4) >> 20);
  p.value = Tensor(Shape(dims));
  p.grad = Tensor(Shape(dims));
  return p;
}

void Parameter::allocate() {
  if (allocated()) return;
  value = Tensor(Shape(deferred_shape));
  grad = Tensor(Shape(deferred_shape));
  deferred_shape.clear();
}

void shard_parameter(Parameter& parameter, const Box& box) {
  TESSERA_CHECK(!parameter.sharded(), "parameter '{}' is sharded twice", parameter.name);
  const std::vector<std::int64_t> global = parameter.whole_shape();
  TESSERA_CHECK(box.begin.size() == global.size() && box.extent.size() == global.size(),
                "parameter '{}': block of rank {} for a tensor of rank {}", parameter.name, box.begin.size(),
                global.size());
  Tensor block{Shape(box.extent)};
  if (parameter.allocated()) {
    const Tensor whole = parameter.value.is_contiguous() ? parameter.value : parameter.value.clone();
    for (std::int64_t i = 0; i < block.numel(); ++i) block.data()[i] = whole.data()[global_index(global, box, i)];
  }
  parameter.value = std::move(block);
  parameter.grad = Tensor(Shape(box.extent));
  parameter.global_shape = global;
  parameter.box = box;
  parameter.deferred_shape.clear();
}

Box Parameter::whole_box() const {
  if (sharded()) return box;
  Box b;
  b.extent = whole_shape();
  b.begin.assign(b.extent.size(), 0);
  return b;
}

Box Layer::buffer_box(std::size_t index, std::vector<std::int64_t>& global_shape) {
  const Tensor& buffer = *buffers().at(index);
  global_shape = buffer.shape().dims();
  Box box;
  box.extent = global_shape;
  box.begin.assign(global_shape.size(), 0);
  return box;
}

void Layer::move_to(Device device) {
  for (Parameter* parameter : parameters()) {
    parameter->value = parameter->value.to(device);
    parameter->grad = parameter->grad.to(device);
  }
  for (Tensor* buffer : buffers()) *buffer = buffer->to(device);
}

void Layer::set_model_split(const ModelSplit& split) {
  if (split.channel_parts > 1 || (split.filter_parts > 1 && !filter_splittable()))
    fail_layer(*this, "cannot be split by filter or channel (only conv and linear layers can, and point-wise layers "
               "by filter); got {} filter and {} channel parts", split.filter_parts, split.channel_parts);
  model_split_ = split;
}

std::vector<SpatialWindow> Layer::spatial_windows(int dims) const {
  std::vector<SpatialWindow> windows;
  for (int j = 0; j < dims; ++j) windows.push_back(spatial_window(j));
  return windows;
}

void Layer::forward_region(std::span<const Tensor* const>, Tensor&, LayerContext&, const std::vector<std::int64_t>&,
                           const std::vector<std::int64_t>&) {
  fail("{} cannot compute part of its output tile (executor bug: its traits do not compute output regions)", describe(*this));
}

void Layer::backward_inputs(std::span<const Tensor* const>, const Tensor&, std::span<Tensor* const>, LayerContext&) {
  fail("{} has no separate input-gradient pass (executor bug: its traits do not split backward)", describe(*this));
}

void Layer::backward_parameters(std::span<const Tensor* const>, const Tensor&, LayerContext&) {
  fail("{} has no separate parameter-gradient pass (executor bug: its traits do not split backward)", describe(*this));
}

std::optional<PooledGradient> Layer::pooled_gradient(const Tensor&, const Tensor&, std::optional<float>) const {
  return std::nullopt;
}

bool Layer::reads_pooled_gradient(std::span<const Tensor* const>, const PooledGradient&, LayerContext&) {
  return false;
}

std::optional<PooledOutput> Layer::pooled_output(const Shape&, Device, Tensor&, LayerContext&) {
  return std::nullopt;
}

void copy_spatial_box(const Tensor& source, const std::vector<std::int64_t>& source_begin,
                      Tensor& destination, const std::vector<std::int64_t>& destination_begin,
                      const std::vector<std::int64_t>& extent) {
  const int rank = source.rank();
  TESSERA_CHECK(rank == 4 || rank == 5, "copy_spatial_box: an N x C x (D) x H x W tensor, got {}", source.shape().to_string());
  TESSERA_CHECK(destination.rank() == rank && destination.dim(0) == source.dim(0) && destination.dim(1) == source.dim(1),
                "copy_spatial_box: {} and {} differ in rank, samples or channels", source.shape().to_string(),
                destination.shape().to_string());
  const auto dims = static_cast<std::size_t>(rank - 2);
  TESSERA_CHECK(source_begin.size() == dims && destination_begin.size() == dims && extent.size() == dims,
                "copy_spatial_box: {} spatial dimensions expected", dims);
  for (std::size_t i = 0; i < dims; ++i) {
    const int d = static_cast<int>(i) + 2;
    TESSERA_CHECK(extent[i] >= 0 && source_begin[i] >= 0 && source_begin[i] + extent[i] <= source.dim(d) &&
                      destination_begin[i] >= 0 && destination_begin[i] + extent[i] <= destination.dim(d),
                  "copy_spatial_box: box at {} / {} of extents {} outside {} or {}", fmt::join(source_begin, ","),
                  fmt::join(destination_begin, ","), fmt::join(extent, ","), source.shape().to_string(),
                  destination.shape().to_string());
    if (extent[i] == 0) return;
  }
  TESSERA_CHECK(source.device() == destination.device(), "copy_spatial_box: {} and {} on different devices",
                source.device().to_string(), destination.device().to_string());
  // One box copy in the source's coordinates: the destination tile lies at source_begin -
  // destination_begin there (on a GPU: one kernel).
  Box region{{0, 0}, {source.dim(0), source.dim(1)}};
  Box source_box{std::vector<std::int64_t>(static_cast<std::size_t>(rank), 0), source.shape().dims()};
  Box destination_box{{0, 0}, destination.shape().dims()};
  for (std::size_t i = 0; i < dims; ++i) {
    region.begin.push_back(source_begin[i]);
    region.extent.push_back(extent[i]);
    destination_box.begin.push_back(source_begin[i] - destination_begin[i]);
  }
  copy_box(region, source.data(), source_box, destination.data(), destination_box, source.device());
}

Box filter_block(const Layer& layer, const ModelSplit& split, std::int64_t channels) {
  if (split.filter_parts > channels)
    fail_layer(layer, "cannot cut {} channels into {} filter parts", channels, split.filter_parts);
  return Box{{block_begin(channels, split.filter_parts, split.filter_coord)},
             {block_extent(channels, split.filter_parts, split.filter_coord)}};
}

std::vector<std::int64_t> spatial_extents(const Shape& shape) {
  return std::vector<std::int64_t>(shape.dims().begin() + 2, shape.dims().end());
}

PoolBox pool_box(const PoolingGeometry& g) {
  PoolBox b{g.batch * g.channels, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, {1, 1, 1}, {0, 0, 0},
            {0, 0, 0},            {1, 1, 1}, {0, 0, 0}};
  const std::size_t shift = 3 - g.input_size.size();
  const bool tile = !g.input_origin.empty();
  for (std::size_t i = 0; i < g.input_size.size(); ++i) {
    b.in[i + shift] = g.input_size[i];
    b.out[i + shift] = g.output_size[i];
    b.kernel[i + shift] = g.kernel[i];
    b.stride[i + shift] = g.stride[i];
    b.padding[i + shift] = g.padding[i];
    b.in_origin[i + shift] = tile ? g.input_origin[i] : 0;
    b.limit[i + shift] = tile ? g.global_input_size[i] : g.input_size[i];
    b.out_origin[i + shift] = tile ? g.output_origin[i] : 0;
  }
  // The output's layout: dense, or within a larger tensor (output_within, at output_offset).
  std::int64_t within[3] = {b.out[0], b.out[1], b.out[2]}, offset[3] = {0, 0, 0};
  if (!g.output_within.empty()) {
    TESSERA_CHECK(g.output_within.size() == g.output_size.size() && g.output_offset.size() == g.output_size.size(),
                  "pooling: an output within a tensor of {} dimensions at an offset of {}, for {} dimensions",
                  g.output_within.size(), g.output_offset.size(), g.output_size.size());
    for (std::size_t i = 0; i < g.output_size.size(); ++i) {
      TESSERA_CHECK(g.output_offset[i] >= 0 && g.output_offset[i] + g.output_size[i] <= g.output_within[i],
                    "pooling: {} outputs at offset {} do not fit in {}", g.output_size[i], g.output_offset[i],
                    g.output_within[i]);
      within[i + shift] = g.output_within[i];
      offset[i + shift] = g.output_offset[i];
    }
  }
  b.out_row = within[2];
  b.out_rows = within[1] * within[2];
  b.out_planes = within[0] * within[1] * within[2];
  b.out_first = offset[0] * b.out_rows + offset[1] * b.out_row + offset[2];
  return b;
}

std::size_t pooling_workspace_bytes(const PoolingGeometry& g) {
  if (g.mode != PoolingMode::Max) return 0;
  const PoolBox box = pool_box(g);
  return static_cast<std::size_t>(box.planes * box.out_plane()) * sizeof(std::int32_t);
}

}  // namespace tessera
