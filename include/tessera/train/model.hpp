#pragma once
// A model: a DAG of layers built from a model file (YAML), in the file's order (which is a
// topological order: a layer may only take inputs defined above it), and a loss.
//
//   name: fashion_cnn
//   input: {shape: [1, 28, 28]}          # one sample: C, (D,) H, W — or [features]
//   layers:
//     - {name: conv1, type: conv, filters: 32, kernel: 3, padding: 1}
//     - {name: relu1, type: relu}
//     - {name: skip, type: add, inputs: [relu1, conv1]}
//   loss: softmax_cross_entropy          # or {type: mse}
//   precision: bf16                      # optional: fp32 (default) or bf16 mixed precision for
//                                        # every conv and linear layer without its own 'precision'
//   activations: bf16                    # optional, with precision bf16 (its default there; fp32
//                                        # otherwise): the activations kept for backward in bf16
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/layers/layer.hpp"
#include "tessera/core/precision.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/planner.hpp"

namespace tessera {

struct ModelNode {
  std::unique_ptr<Layer> layer;
  /// Indices of the producing nodes; kModelInput for the model's input.
  std::vector<int> inputs;
  /// Output shape for a batch of one sample (dimension 0 = batch).
  Shape output;
  /// Nodes that consume this node's output.
  std::vector<int> consumers;
};

/// What a command line may change in a model file.
struct ModelOptions {
  /// Replaces the file's model-wide `precision` (layers that name their own keep it).
  std::optional<Precision> precision;
  /// Whether parsing allocates every layer's whole weights and gradients. Off, the weights stay
  /// unallocated until the executor's split allocates each rank's block (Layer::defer_parameters)
  /// and allocate_parameters() the rest: what tessera train does, so that a model larger than a
  /// rank trains under a filter or channel split.
  bool allocate_parameters = true;
  /// With allocate_parameters, the most parameter elements the whole model may have: 2^28 (1 GiB
  /// of fp32; each layer at most 2^27, layers/layer_common.hpp), so that parsing a model file
  /// never allocates more.
  std::int64_t largest_weights = std::int64_t{1} << 28;
};

class Model {
 public:
  static constexpr int kModelInput = -1;

  static Model load(const std::string& path, const ModelOptions& options = {});
  static Model parse(const std::string& yaml_text, const std::string& source_name, const ModelOptions& options = {});

  const std::string& name() const { return name_; }
  const std::string& source() const { return source_; }
  /// The model-wide precision of conv and linear layers (a layer may name its own).
  Precision precision() const { return precision_; }
  /// How a training step keeps the activations that backward reads (outputs and copies, between
  /// their last forward reader and the first backward that reads them): fp32, or bf16 (half the
  /// bytes; the values rounded as bf16 operands round them, so a bf16 convolution's or linear
  /// layer's gradients and the activations' and max pooling's masks come out the same to the bit,
  /// but for positive values below 9e-41, which round to zero; batch norm's backward reads the
  /// rounded input; nothing a layer computing in fp32 reads is copied, LayerTraits::backward_reads_fp32).
  /// `activations: bf16` needs `precision: bf16`, whose default it is.
  Precision activation_precision() const { return activations_; }
  /// One sample's shape (no batch dimension).
  const Shape& sample_shape() const { return sample_shape_; }
  /// The model's input for a batch of `batch` samples: batch x sample_shape().
  Shape input_shape(std::int64_t batch) const;
  /// Per-sample shape of the targets the loss expects ({} for class labels).
  const Shape& target_shape() const { return target_shape_; }
  std::vector<ModelNode>& nodes() { return nodes_; }
  const std::vector<ModelNode>& nodes() const { return nodes_; }
  int output_node() const { return output_; }
  Loss& loss() { return *loss_; }

  /// Deterministic, rank-independent initial weights (this rank's blocks of split layers, drawn by
  /// global index); allocates deferred parameters first.
  void init_parameters(std::uint64_t seed);
  /// Allocates every parameter still deferred, whole (the executor, after its split).
  void allocate_parameters();
  std::vector<Parameter*> parameters();
  std::int64_t parameter_count();
  /// Layers with their global output shapes, for checking a plan.
  std::vector<PlanLayerInfo> plan_info(std::int64_t global_batch) const;
  /// What the planner needs of the layers for a global batch of `global_batch` (model_planner.cpp).
  PlannerGraph planner_graph(std::int64_t global_batch) const;
  /// A fresh layer of node `node`'s type and options (same name and id), not set up: for
  /// timing it on other shapes (`tessera calibrate`).
  std::unique_ptr<Layer> make_layer(std::size_t node) const;
  /// Node `node`'s layer options as the model file gave them (`tessera export onnx`).
  const LayerOptions& layer_options(std::size_t node) const;

 private:
  /// parse() without its net for yaml-cpp's own exceptions.
  static Model parse_unchecked(const std::string& yaml_text, const std::string& source_name,
                               const ModelOptions& options);

  std::string name_;
  std::string source_;
  Precision precision_ = Precision::F32;
  Precision activations_ = Precision::F32;
  Shape sample_shape_;
  Shape target_shape_;
  std::vector<ModelNode> nodes_;
  int output_ = -1;
  std::unique_ptr<Loss> loss_;
  /// Each node's layer type and options as parsed (for make_layer).
  std::vector<std::pair<std::string, LayerOptions>> layer_specs_;
};

}  // namespace tessera
