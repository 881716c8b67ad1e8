#pragma once
// The Layer interface. A layer computes on local tensors (this rank's tile); whatever it needs
// from the rest of the job (the global batch size, a communicator for global statistics, the
// global index of its first sample) comes in the LayerContext from the executor. Layers never
// call MPI directly.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/core/precision.hpp"
#include "tessera/layers/options.hpp"
#include "tessera/parallel/step_plan.hpp"
#include "tessera/parallel/tile_geometry.hpp"
#include "tessera/tensor/box.hpp"
#include "tessera/tensor/shape.hpp"
#include "tessera/tensor/tensor.hpp"

namespace tessera {

class Communicator;
class DnnBackend;
struct PooledGradient;
struct PooledOutput;

/// Where this rank's tile of a spatially split layer lies, in global coordinates, one entry per
/// spatial dimension (D, H, W or H, W). The local input covers the global input positions
/// [window_begin, window_begin + local extent): its own block plus the halos its outputs read,
/// and, at the global boundary, positions outside the input (zeros: the layer's padding). The
/// layer computes the outputs [output_begin, output_begin + output_extent).
struct SpatialTile {
  std::vector<std::int64_t> input_global;   ///< global input extents
  std::vector<std::int64_t> window_begin;   ///< global position of local input element 0 (may be < 0)
  std::vector<std::int64_t> output_global;  ///< global output extents
  std::vector<std::int64_t> output_begin;
  std::vector<std::int64_t> output_extent;
};

/// What the executor hands a layer on every call.
struct LayerContext {
  DnnBackend* backend = nullptr;
  /// Ranks that hold other samples or other spatial tiles of the same batch and channels (for
  /// global batch-norm statistics); nullptr when this rank holds all of it.
  Communicator* sample_comm = nullptr;
  /// Ranks that hold the other spatial tiles of this rank's samples (batch-norm statistics always
  /// cover the whole spatial extent); nullptr when the layer is not split spatially.
  Communicator* spatial_comm = nullptr;
  /// Set when the layer runs on a spatial tile (see SpatialTile); nullptr: whole samples.
  const SpatialTile* tile = nullptr;
  /// Global position (within the batch) of this rank's first sample.
  std::int64_t sample_offset = 0;
  /// Samples in the whole batch, over all ranks.
  std::int64_t global_batch = 0;
  std::uint64_t seed = 0;
  /// Optimizer step (keys dropout masks together with the layer id and the global element index).
  std::int64_t step = 0;
  bool training = true;
  /// The leaky ReLU (this slope; relu: 0) forward applies to its output in the same pass, for
  /// the reader running in place whose forward is then skipped (StepPlan::leaky_relu_after).
  std::optional<float> leaky_relu_after;
  /// The leaky ReLU running in place before it whose backward this backward does: the input
  /// gradient times that layer's factor (1 where the input > 0, else this slope); that layer's
  /// backward is then skipped (StepPlan::leaky_relu_before).
  std::optional<float> leaky_relu_before;
  /// Non-empty: the output tensor forward writes (and backward's output and output gradient) is
  /// its reader's halo window, which holds this layer's output from this spatial offset
  /// (StepPlan::output_in_window; layers with LayerTraits::writes_into_window only).
  std::vector<std::int64_t> output_offset;
  /// Set for a convolution whose reader's max pooling left its backward to it (StepPlan::
  /// gradient_from_pooling): backward computes the weight gradients from the pooling's gradient
  /// and maxima (no input gradient), and reads no output gradient of its own.
  const PooledGradient* pooled_gradient = nullptr;
  /// Set for a convolution whose reader's max pooling leaves its forward to it (StepPlan::
  /// pooled_by): forward writes the pooling's output and maxima there, and no output of its own.
  const PooledOutput* pooled_output = nullptr;
};

/// A trainable tensor and its gradient. Under a model-parallel (filter/channel) split a rank
/// holds only its block of the weight: `value` and `grad` are that block, `global_shape` the
/// whole tensor's shape and `box` where the block lies in it (both empty: the tensor is whole).
struct Parameter {
  std::string name;  ///< "<layer>.<weight|bias|gamma|beta>"
  Tensor value;
  Tensor grad;
  /// False for parameters that weight decay must skip (biases, norm scales).
  bool decay = true;
  /// Shape of the whole tensor; empty when `value` is the whole tensor.
  std::vector<std::int64_t> global_shape = {};
  /// This rank's block of the whole tensor (global coordinates); empty when whole.
  Box box = {};
  /// The block is the same on every rank of the layer's channel group (the bias of a channel-split
  /// layer): its gradient is summed over the channel ranks too.
  bool replicated_over_channels = false;
  /// The whole shape of a parameter whose value and gradient are not allocated yet (its layer
  /// defers them: Layer::defer_parameters); empty once they are (by its split, or allocate()).
  std::vector<std::int64_t> deferred_shape = {};

  bool sharded() const { return !global_shape.empty(); }
  bool allocated() const { return deferred_shape.empty(); }
  /// Allocates a deferred parameter whole (value and gradient zero); nothing when allocated.
  void allocate();
  /// The whole tensor's shape (the value's own when neither sharded nor deferred).
  std::vector<std::int64_t> whole_shape() const {
    return sharded() ? global_shape : !allocated() ? deferred_shape : value.shape().dims();
  }
  /// This rank's box of the whole tensor (all of it when not sharded).
  Box whole_box() const;
};

/// Which block of a model-parallel layer this rank computes: output channels/features cut into
/// `filter_parts`, input channels/features into `channel_parts` (partial sums over the channel
/// blocks are reduced by the executor).
struct ModelSplit {
  int filter_parts = 1, filter_coord = 0;
  int channel_parts = 1, channel_coord = 0;
  bool none() const { return filter_parts == 1 && channel_parts == 1; }
  bool operator==(const ModelSplit&) const = default;
};

class Layer {
 public:
  Layer(std::string name, int id) : name_(std::move(name)), id_(id) {}
  virtual ~Layer() = default;
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  const std::string& name() const { return name_; }
  /// Position in the model; keys this layer's random streams.
  int id() const { return id_; }
  virtual std::string_view type() const = 0;
  /// Number of inputs the layer takes; -1: two or more (add, concat).
  virtual int arity() const { return 1; }

  /// Given the input shapes (dimension 0 = batch, any extent), returns the output shape and
  /// creates the parameters. Throws InputError naming the layer when the shapes do not fit.
  virtual Shape setup(const std::vector<Shape>& inputs) = 0;
  virtual std::vector<Parameter*> parameters() { return {}; }
  /// Whether the layer can run on spatial tiles (SpatialTile): convolution, pooling, batch norm
  /// and the element-wise layers can; flatten and linear cannot.
  virtual bool spatially_splittable() const { return false; }
  /// What its outputs read along spatial dimension `dim` (0 = the first spatial dimension):
  /// point-wise layers their own positions.
  virtual SpatialWindow spatial_window(int /*dim*/) const { return {}; }
  /// The input positions [first, last) along spatial dimension `dim` that outputs [begin, end)
  /// read; may reach outside the input (padding).
  std::pair<std::int64_t, std::int64_t> input_range(int dim, std::int64_t begin, std::int64_t end) const {
    return spatial_window(dim).inputs(begin, end);
  }
  /// spatial_window of each of the `dims` spatial dimensions.
  std::vector<SpatialWindow> spatial_windows(int dims) const;

  /// Whether the layer accepts filter/channel (model-parallel) splits: convolution and linear.
  virtual bool model_splittable() const { return false; }
  /// The arithmetic of the layer's kernels (conv and linear may compute with bf16 operands).
  virtual Precision precision() const { return Precision::F32; }
  /// Whether the layer accepts filter splits: the weight layers, and per-channel layers (batch
  /// norm, dropout, pooling, relu, leaky_relu), which then compute on their block of the channels
  /// (features) only (input block = output block).
  virtual bool filter_splittable() const { return model_splittable(); }
  /// Makes this rank compute only its block (see ModelSplit): the parameters shrink to their
  /// blocks, keeping the values they hold (sliced from the whole tensors), and init_parameters
  /// then draws each block's values by global index, so any split holds the 1-rank weights. The
  /// layer then takes its channel block of the input and produces its filter block of the output
  /// (with channel parts: a partial sum; the bias is added by channel block 0 only). Call after
  /// setup, at most once. The default refuses anything but no split.
  virtual void set_model_split(const ModelSplit& split);
  /// Moves the parameters (values and gradients) and the buffers to `device`; the layer then
  /// takes its inputs there. Layers whose kernels run on the host only refuse tensors on another
  /// device in forward, with a message that says so.
  void move_to(Device device);
  const ModelSplit& model_split() const { return model_split_; }
  /// With `defer`, setup() leaves the whole weights unallocated (Parameter::deferred_shape): the
  /// split allocates only this rank's block, and Model::allocate_parameters the rest.
  void defer_parameters(bool defer) { defer_parameters_ = defer; }
  bool defers_parameters() const { return defer_parameters_; }

  /// Non-trainable state that evaluation and checkpoints need (batch-norm running statistics).
  virtual std::vector<Tensor*> buffers() { return {}; }
  /// What the step plan may do with the layer (run it in place, fuse it, let its inputs go, overlap
  /// its halos).
  virtual LayerTraits traits() const { return {}; }
  /// Bytes of what the layer keeps from its forward for its backward besides its output, on the
  /// tensors' device (max pooling's positions of the maxima, dropout's scales, a convolution's
  /// region copies when halos overlap its compute); grown as needed, kept between steps.
  virtual std::int64_t workspace_bytes() const { return 0; }
  /// Where buffer `index` lies in the whole buffer (a block under a filter split): sets
  /// `global_shape` and returns the box. The default: the buffer is whole.
  virtual Box buffer_box(std::size_t index, std::vector<std::int64_t>& global_shape);
  /// Fills parameters from the counter-based RNG keyed by (seed, this layer's id, global index).
  virtual void init_parameters(std::uint64_t seed) {}

  /// Resizes `output` (its batch extent follows the input's) and computes it.
  virtual void forward(std::span<const Tensor* const> inputs, Tensor& output, LayerContext& ctx) = 0;
  /// Writes the input gradients (a nullptr entry: not needed) and the parameters' gradients
  /// (overwritten, not accumulated). Uses the inputs (their values only where
  /// backward_reads_inputs) and what forward saved, never `output`: the executor releases an
  /// output once every consumer holds a copy of what it reads (spatial plans), so `output` may be
  /// empty here. The one exception: given LayerContext::leaky_relu_before, max pooling reads its
  /// output (the input at each maximum), which the executor then keeps for it.
  virtual void backward(std::span<const Tensor* const> inputs, const Tensor& output,
                        const Tensor& grad_output, std::span<Tensor* const> grad_inputs,
                        LayerContext& ctx) = 0;

  // Halo overlap (see Executor): a layer on a spatial tile whose halos are still travelling.
  /// With traits().computes_output_regions, the executor runs forward on the window before the
  /// halos arrived and, once they arrived, forward_region on each part of the tile that reads them.
  /// Recomputes the local outputs [begin, begin + extent) (spatial dimensions; all samples and
  /// channels) of the tile from the same inputs, into `output` as forward sized it. Only on a
  /// spatial tile (ctx.tile), after forward with the same inputs and context.
  virtual void forward_region(std::span<const Tensor* const> inputs, Tensor& output, LayerContext& ctx,
                              const std::vector<std::int64_t>& begin, const std::vector<std::int64_t>& extent);
  /// With traits().splits_backward, backward in two passes (backward_inputs, then
  /// backward_parameters, writing what backward writes): the executor sends the input gradients'
  /// halos to their owners while the parameter gradients are computed.
  virtual void backward_inputs(std::span<const Tensor* const> inputs, const Tensor& grad_output,
                               std::span<Tensor* const> grad_inputs, LayerContext& ctx);
  virtual void backward_parameters(std::span<const Tensor* const> inputs, const Tensor& grad_output,
                                   LayerContext& ctx);

  // A max pooling's backward done by the convolution it reads (StepPlan::gradient_from_pooling).
  /// Max pooling: its backward as its producer can read it, after forward (`output`, its output,
  /// read through the leaky ReLU of `leaky_relu`; `grad_output`, its gradient); nullopt where its
  /// last forward's windows are not ones the producer can read (and for other layers).
  virtual std::optional<PooledGradient> pooled_gradient(const Tensor& output, const Tensor& grad_output,
                                                        std::optional<float> leaky_relu) const;
  /// Convolution: whether backward, with `inputs` and ctx as it will be called, can compute the
  /// weight gradients from `pooled` (LayerContext::pooled_gradient; false for other layers).
  virtual bool reads_pooled_gradient(std::span<const Tensor* const> inputs, const PooledGradient& pooled,
                                     LayerContext& ctx);
  /// Max pooling: forward's set-up for an input of `input` (its geometry, `output` sized or its
  /// reader's window checked, its workspace), where its producer will write the output and the
  /// maxima (LayerContext::pooled_output); nullopt where its windows are not ones the producer can
  /// write (and for other layers). Null pointers: no samples.
  virtual std::optional<PooledOutput> pooled_output(const Shape& input, Device device, Tensor& output,
                                                    LayerContext& ctx);

 private:
  std::string name_;
  int id_;
  bool defer_parameters_ = false;

 protected:
  ModelSplit model_split_;
};

/// Creates a layer of a registered type; unknown types and unknown or bad parameters are
/// InputErrors naming the layer. Every option must be consumed (checked here).
std::unique_ptr<Layer> create_layer(const std::string& type, const std::string& name, int id,
                                    LayerOptions& options);
/// The registered layer type names.
std::vector<std::string> layer_types();

/// A loss over a prediction and a target. The loss of a batch is the mean over its global
/// batch, so each rank's gradient is d(sum of its samples' losses)/d(prediction) / global_batch.
class Loss {
 public:
  virtual ~Loss() = default;
  virtual std::string_view type() const = 0;
  /// Per-sample target shape expected for this prediction shape (both without the batch dimension).
  /// Throws InputError when the prediction cannot be used with this loss.
  virtual Shape target_shape(const Shape& prediction_sample_shape) const = 0;
  /// Returns the sum of the local samples' losses and writes the gradient of the batch's mean loss.
  virtual double forward_backward(const Tensor& prediction, const Tensor& target,
                                  Tensor& grad_prediction, const LayerContext& ctx) = 0;
  /// Sum of the local samples' losses only (evaluation).
  virtual double forward(const Tensor& prediction, const Tensor& target) = 0;
  /// Number of correctly classified local samples; -1 when the loss is not a classification loss.
  virtual std::int64_t correct(const Tensor& prediction, const Tensor& target) const { return -1; }
};

/// "softmax_cross_entropy" (targets: class index per sample) or "mse" (targets: N x T).
std::unique_ptr<Loss> create_loss(const std::string& type, LayerOptions& options);

}  // namespace tessera
