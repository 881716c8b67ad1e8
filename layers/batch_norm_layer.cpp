// "batchnorm": per-channel normalization over the batch and spatial dimensions, with learned
// scale (gamma) and shift (beta). The statistics always cover the whole spatial extent (the ranks
// holding other spatial tiles of the same samples); with `global: true` they cover the whole batch
// across the ranks of the sample communicator, in forward and in backward. Its element-wise passes
// are the backend's ElementwiseKernels (Kokkos loops on the host, CUDA kernels on a GPU) rather
// than oneDNN's batch norm, which cannot take statistics reduced across processes in its backward
// pass; the per-channel arithmetic runs on the host.
#include <cmath>

#include "layers/layer_common.hpp"
#include "tessera/core/communicator.hpp"

namespace tessera {
namespace {

class BatchNormLayer final : public Layer {
 public:
  BatchNormLayer(const std::string& name, int id, LayerOptions& options)
      : Layer(name, id),
        epsilon_(options.get_float("epsilon", 1e-5)),
        momentum_(options.get_float("momentum", 0.1)),
        global_(options.get_bool("global", false)) {
    if (!(epsilon_ > 0)) fail_layer(*this, "parameter 'epsilon' must be positive, got {}", epsilon_);
    if (!(momentum_ >= 0 && momentum_ <= 1)) fail_layer(*this, "parameter 'momentum' must be in [0, 1], got {}", momentum_);
  }

  std::string_view type() const override { return "batchnorm"; }
  bool spatially_splittable() const override { return true; }

  Shape setup(const std::vector<Shape>& inputs) override {
    check_input_count(*this, inputs, 1);
    input_shape_ = inputs[0];
    channels_ = input_shape_[1];
    const Shape channel_shape{channels_};
    gamma_ = {name() + ".gamma", Tensor(channel_shape), Tensor(channel_shape), false};
    beta_ = {name() + ".beta", Tensor(channel_shape), Tensor(channel_shape), false};
    running_mean_ = Tensor(channel_shape);
    running_variance_ = Tensor(channel_shape);
    init_parameters(0);
    return input_shape_;
  }

  std::vector<Parameter*> parameters() override { return {&gamma_, &beta_}; }
  std::vector<Tensor*> buffers() override { return {&running_mean_, &running_variance_}; }

  bool filter_splittable() const override { return true; }

  void set_model_split(const ModelSplit& split) override {
    if (split == model_split_) return;
    Layer::set_model_split(split);
    // This rank's block of the channels: statistics per channel need no other channels, and the
    // executor's statistics communicators hold the ranks with the same block.
    const Box box = filter_block(*this, split, channels_);
    shard_parameter(gamma_, box);
    shard_parameter(beta_, box);
    Parameter mean{"", running_mean_, running_mean_, false}, variance{"", running_variance_, running_variance_, false};
    shard_parameter(mean, box);
    shard_parameter(variance, box);
    running_mean_ = mean.value;
    running_variance_ = variance.value;
    channels_ = box.extent[0];
    input_shape_ = input_shape_.with(1, channels_);
  }

  Box buffer_box(std::size_t index, std::vector<std::int64_t>& global_shape) override {
    if (!gamma_.sharded()) return Layer::buffer_box(index, global_shape);
    global_shape = gamma_.global_shape;
    return gamma_.box;
  }

  void init_parameters(std::uint64_t) override {
    gamma_.value.fill(1.0f);
    beta_.value.zero();
    running_mean_.zero();
    running_variance_.fill(1.0f);
  }

  void forward(std::span<const Tensor* const> inputs, Tensor& output, LayerContext& ctx) override {
    const Tensor& input = *inputs[0];
    check_same_sample_shape(*this, input_shape_, input.shape(), ctx);
    ElementwiseKernels& kernels = elementwise_of(ctx, input);
    output.resize(input.shape(), input.device());
    const std::int64_t batch = input.dim(0), channels = channels_, inner = input.shape().sample_numel() / channels_;
    mean_.assign(static_cast<std::size_t>(channels), 0.0);
    inverse_std_.assign(static_cast<std::size_t>(channels), 0.0);
    used_batch_statistics_ = ctx.training;
    const float* x = input.data();
    // The running statistics and the parameters are per-channel arrays: read and updated on the host
    // (copies of them when the layer is on a GPU).
    Tensor running_mean = running_mean_.to(Device::host()), running_variance = running_variance_.to(Device::host());
    if (ctx.training) {
      // [sum x per channel..., sum x^2 per channel..., element count], reduced in one call.
      std::vector<double> sums(static_cast<std::size_t>(2 * channels + 1), 0.0);
      if (batch * inner > 0) kernels.batch_norm_statistics(x, batch, channels, inner, sums.data());
      sums.back() = static_cast<double>(batch * inner);
      if (Communicator* comm = statistics_comm(ctx)) comm->allreduce(std::span<double>(sums));
      const double count = sums.back();
      if (count == 0) return;  // no sample anywhere: nothing to normalize, statistics unchanged
      for (std::int64_t c = 0; c < channels; ++c) {
        const auto u = static_cast<std::size_t>(c);
        const double mean = sums[u] / count;
        const double variance = std::max(0.0, sums[static_cast<std::size_t>(channels + c)] / count - mean * mean);
        mean_[u] = mean;
        inverse_std_[u] = 1.0 / std::sqrt(variance + epsilon_);
        // Running variance is the unbiased estimate, as in PyTorch.
        const double unbiased = count > 1 ? variance * count / (count - 1) : variance;
        running_mean.data()[c] = static_cast<float>((1 - momentum_) * running_mean.data()[c] + momentum_ * mean);
        running_variance.data()[c] =
            static_cast<float>((1 - momentum_) * running_variance.data()[c] + momentum_ * unbiased);
      }
      if (!running_mean_.device().is_host()) {
        running_mean_.copy_from(running_mean);
        running_variance_.copy_from(running_variance);
      }
    } else {
      for (std::int64_t c = 0; c < channels; ++c) {
        const auto u = static_cast<std::size_t>(c);
        mean_[u] = running_mean.data()[c];
        inverse_std_[u] = 1.0 / std::sqrt(static_cast<double>(running_variance.data()[c]) + epsilon_);
      }
    }
    // y = scale * x + shift per channel, folded so the inner loop is one multiply-add.
    const Tensor gamma = gamma_.value.to(Device::host()), beta = beta_.value.to(Device::host());
    std::vector<float> scale(static_cast<std::size_t>(channels)), shift(static_cast<std::size_t>(channels));
    for (std::int64_t c = 0; c < channels; ++c) {
      const auto u = static_cast<std::size_t>(c);
      const float g = gamma.data()[c];
      scale[u] = static_cast<float>(g * inverse_std_[u]);
      shift[u] = static_cast<float>(beta.data()[c] - g * inverse_std_[u] * mean_[u]);
    }
    if (batch * inner > 0)
      kernels.batch_norm_normalize(x, output.data(), batch, channels, inner, scale.data(), shift.data());
  }

  void backward(std::span<const Tensor* const> inputs, const Tensor& output, const Tensor& grad_output,
                std::span<Tensor* const> grad_inputs, LayerContext& ctx) override {
    const Tensor& input = *inputs[0];
    ElementwiseKernels& kernels = elementwise_of(ctx, input);
    const std::int64_t batch = input.dim(0), channels = channels_, inner = input.shape().sample_numel() / channels_;
    const float* x = input.data();
    const float* dy = grad_output.data();
    // Local sums of dy and dy * xhat per channel: this rank's share of the parameter gradients
    // (the executor's gradient reduction adds the shares), and, reduced, the terms of dx.
    std::vector<double> sums(static_cast<std::size_t>(2 * channels + 1), 0.0);
    if (batch * inner > 0)
      kernels.batch_norm_backward_sums(x, dy, batch, channels, inner, mean_.data(), inverse_std_.data(), sums.data());
    sums.back() = static_cast<double>(batch * inner);
    // The parameter gradients are written on the host (into copies when they live on a GPU).
    Tensor beta_grad = beta_.grad.device().is_host() ? beta_.grad : Tensor(beta_.grad.shape());
    Tensor gamma_grad = gamma_.grad.device().is_host() ? gamma_.grad : Tensor(gamma_.grad.shape());
    for (std::int64_t c = 0; c < channels; ++c) {
      beta_grad.data()[c] = static_cast<float>(sums[static_cast<std::size_t>(c)]);
      gamma_grad.data()[c] = static_cast<float>(sums[static_cast<std::size_t>(channels + c)]);
    }
    if (!beta_.grad.device().is_host()) {
      beta_.grad.copy_from(beta_grad);
      gamma_.grad.copy_from(gamma_grad);
    }
    // Every rank joins the reduction (also one without samples), or the others would hang.
    if (used_batch_statistics_) {
      if (Communicator* comm = statistics_comm(ctx)) comm->allreduce(std::span<double>(sums));
    }
    Tensor* dx_tensor = grad_inputs[0];
    if (!dx_tensor) return;
    dx_tensor->resize(input.shape(), input.device());
    if (batch == 0) return;
    const Tensor gamma = gamma_.value.to(Device::host());
    const double count = sums.back();
    std::vector<double> scale(static_cast<std::size_t>(channels)), mean_dy(scale.size()), mean_dy_xhat(scale.size());
    for (std::int64_t c = 0; c < channels; ++c) {
      const auto u = static_cast<std::size_t>(c);
      scale[u] = gamma.data()[c] * inverse_std_[u];
      // dx = gamma * inv_std * (dy - mean(dy) - xhat * mean(dy * xhat)), means over the whole batch.
      mean_dy[u] = sums[u] / count;
      mean_dy_xhat[u] = sums[static_cast<std::size_t>(channels + c)] / count;
    }
    if (inner > 0)
      kernels.batch_norm_backward(x, dy, dx_tensor->data(), batch, channels, inner, scale.data(), mean_.data(),
                                  inverse_std_.data(), used_batch_statistics_ ? mean_dy.data() : nullptr,
                                  mean_dy_xhat.data());
  }

 private:
  /// The ranks whose statistics are combined with this rank's: the other spatial tiles of the same
  /// samples always, and with global statistics every rank holding part of the batch.
  Communicator* statistics_comm(const LayerContext& ctx) const { return global_ ? ctx.sample_comm : ctx.spatial_comm; }

  double epsilon_, momentum_;
  bool global_;
  Shape input_shape_;
  std::int64_t channels_ = 0;
  Parameter gamma_, beta_;
  Tensor running_mean_, running_variance_;
  // Saved by forward for backward.
  std::vector<double> mean_, inverse_std_;
  bool used_batch_statistics_ = true;
};

}  // namespace

std::unique_ptr<Layer> make_batch_norm_layer(const std::string& name, int id, LayerOptions& options) {
  return std::make_unique<BatchNormLayer>(name, id, options);
}

}  // namespace tessera
