#pragma once
// Internal helpers the layer implementations share: error prefixes, shape checks, weight init,
// and the factory table that create_layer reads.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tessera/core/error.hpp"
#include "tessera/layers/dnn_backend.hpp"
#include "tessera/layers/layer.hpp"

namespace tessera {

/// "layer 'conv1' (conv)", the prefix of every error a layer raises.
inline std::string describe(const Layer& layer) { return fmt::format("layer '{}' ({})", layer.name(), layer.type()); }

template <typename... Args>
[[noreturn]] void fail_layer(const Layer& layer, fmt::format_string<Args...> format, Args&&... args) {
  throw InputError(describe(layer) + ": " + fmt::format(format, std::forward<Args>(args)...));
}

/// All shapes in "[2, 3, 8, 8] and [2, 4, 8, 8]" form, for messages.
std::string shapes_to_string(const std::vector<Shape>& shapes);

/// Checks the count of inputs (arity -1: two or more) and that every shape has a batch dimension.
void check_input_count(const Layer& layer, const std::vector<Shape>& inputs, int arity);

/// Throws unless `input` matches what setup saw, apart from the batch extent (and, on a spatial
/// tile, apart from the spatial extents, which the tile gives).
void check_same_sample_shape(const Layer& layer, const Shape& expected, const Shape& input,
                             const LayerContext& ctx);

/// Checks a kernel-like per-spatial-dimension option against the input's spatial rank; a single
/// value is repeated.
std::vector<std::int64_t> expand_per_dimension(const Layer& layer, const char* option,
                                               const std::vector<std::int64_t>& values, int spatial_dims);

/// The backend from the context, or an error that says the executor forgot it.
DnnBackend& backend_of(const Layer& layer, const LayerContext& context);

/// The element-wise kernels for a tensor: the context's backend's, or those of the tensor's
/// device when the context has none.
ElementwiseKernels& elementwise_of(const LayerContext& context, const Tensor& tensor);

/// Inputs of one layer call must be on one device.
void check_same_device(const Layer& layer, const Tensor& first, const Tensor& other);

/// Uniform(-b, b) with b = sqrt(6 / fan_in) (He), drawn per global flat index so every tiling
/// of the tensor gets the same values.
void he_uniform_init(Tensor& tensor, std::uint64_t seed, int layer_id, int parameter_index, std::int64_t fan_in);

/// The same over this rank's block of a (possibly sharded) parameter: each element draws by its
/// index in the whole tensor.
void he_uniform_init(Parameter& parameter, std::uint64_t seed, int layer_id, int parameter_index, std::int64_t fan_in);

/// The most elements one layer's whole weight tensor may have where it is allocated whole at setup
/// (a layer that does not defer its parameters): 2^27 (512 MiB of fp32). A deferred layer's limit
/// is the rank's memory, checked against the plan's estimate (tessera train).
inline constexpr std::int64_t kLargestLayerWeights = std::int64_t{1} << 27;

/// A whole parameter "<layer>.<what>" of extents `dims`: value and gradient zero, or, where the
/// layer defers its parameters, not allocated yet (Parameter::deferred_shape). Allocated at once,
/// refused beyond kLargestLayerWeights with an InputError naming the layer.
Parameter whole_parameter(const Layer& layer, const std::string& what, const std::vector<std::int64_t>& dims,
                          bool decay);

/// Shrinks `parameter` to the block `box` of the whole tensor: an allocated value keeps the block's
/// elements, a deferred one allocates only the block (zero); the gradient becomes a zero tensor of
/// the block's shape.
void shard_parameter(Parameter& parameter, const Box& box);

/// Global flat (row-major) index in a tensor of `global` extents of element `local` of `box`.
std::int64_t global_index(const std::vector<std::int64_t>& global, const Box& box, std::int64_t local);

/// The block of `channels` channels (features) that a point-wise layer split by filter holds under
/// `split`, as a one-dimensional box; an InputError naming the layer when there are more parts
/// than channels.
Box filter_block(const Layer& layer, const ModelSplit& split, std::int64_t channels);

/// Copies the spatial box [source_begin, source_begin + extent) of every sample and channel of
/// `source` (N x C x (D) x H x W) to `destination` (same N and C, same device) at
/// `destination_begin` (a box copy: one kernel on a GPU).
void copy_spatial_box(const Tensor& source, const std::vector<std::int64_t>& source_begin,
                      Tensor& destination, const std::vector<std::int64_t>& destination_begin,
                      const std::vector<std::int64_t>& extent);

/// Spatial extents (dims 2...) of an image shape.
std::vector<std::int64_t> spatial_extents(const Shape& shape);

// Factories, one per layer .cpp file; create_layer dispatches on the type name.
std::unique_ptr<Layer> make_convolution_layer(const std::string& name, int id, LayerOptions& options);
std::unique_ptr<Layer> make_max_pool_layer(const std::string& name, int id, LayerOptions& options);
std::unique_ptr<Layer> make_avg_pool_layer(const std::string& name, int id, LayerOptions& options);
std::unique_ptr<Layer> make_batch_norm_layer(const std::string& name, int id, LayerOptions& options);
std::unique_ptr<Layer> make_relu_layer(const std::string& name, int id, LayerOptions& options);
std::unique_ptr<Layer> make_leaky_relu_layer(const std::string& name, int id, LayerOptions& options);
std::unique_ptr<Layer> make_flatten_layer(const std::string& name, int id, LayerOptions& options);
std::unique_ptr<Layer> make_dropout_layer(const std::string& name, int id, LayerOptions& options);
std::unique_ptr<Layer> make_add_layer(const std::string& name, int id, LayerOptions& options);
std::unique_ptr<Layer> make_concat_layer(const std::string& name, int id, LayerOptions& options);
std::unique_ptr<Layer> make_linear_layer(const std::string& name, int id, LayerOptions& options);

}  // namespace tessera
