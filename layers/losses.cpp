// Losses: "softmax_cross_entropy" (class index per sample, stored as float) and "mse".
// Both return the sum of the local samples' losses and write the gradient of the global batch's
// mean loss, so the ranks' gradients add up to the 1-rank gradient.
#include <cmath>
#include <map>

#include <fmt/ranges.h>

#include "layers/layer_common.hpp"
#include "tessera/core/error.hpp"
#include "tessera/layers/layer.hpp"

namespace tessera {
namespace {

double global_batch_of(const LayerContext& ctx, std::string_view loss) {
  if (ctx.global_batch <= 0) fail("loss {}: the layer context has no global batch size (executor bug)", loss);
  return static_cast<double>(ctx.global_batch);
}

void check_batch(std::string_view loss, const Tensor& prediction, const Tensor& target, std::int64_t target_numel) {
  if (target.numel() != prediction.dim(0) * target_numel)
    fail_input("loss {}: prediction {} needs {} target values per sample, got target {}", loss,
               prediction.shape().to_string(), target_numel, target.shape().to_string());
}

/// A loss computed by one pass that returns the sum of the local samples' losses and, when given a
/// gradient buffer, writes scale x d(that sum)/d(prediction) into it.
class SummedLoss : public Loss {
 public:
  double forward_backward(const Tensor& prediction, const Tensor& target, Tensor& grad_prediction,
                          const LayerContext& ctx) final {
    const double scale = 1.0 / global_batch_of(ctx, type());
    grad_prediction.resize(prediction.shape(), prediction.device());
    return run(prediction, target, grad_prediction.data(), scale, elementwise_of(ctx, prediction));
  }

  double forward(const Tensor& prediction, const Tensor& target) final {
    return run(prediction, target, nullptr, 0.0, elementwise_kernels(prediction.device()));
  }

 protected:
  /// `kernels`: the element-wise kernels of the prediction's device.
  virtual double run(const Tensor& prediction, const Tensor& target, float* grad, double scale,
                     ElementwiseKernels& kernels) = 0;
};

class SoftmaxCrossEntropy final : public SummedLoss {
 public:
  std::string_view type() const override { return "softmax_cross_entropy"; }

  Shape target_shape(const Shape& prediction_sample_shape) const override {
    if (prediction_sample_shape.rank() != 1 || prediction_sample_shape[0] < 2)
      fail_input("loss softmax_cross_entropy needs one score per class (two or more) per sample, got {} per sample",
                 prediction_sample_shape.to_string());
    return Shape(std::vector<std::int64_t>{});
  }


  std::int64_t correct(const Tensor& prediction, const Tensor& target) const override {
    check(prediction, target);
    return kernels_of(prediction).count_correct(prediction.data(), target.data(), prediction.dim(0),
                                                prediction.dim(1));
  }

 private:
  /// The labels are checked on the host (a copy of them when they are on a GPU: one float per sample).
  void check(const Tensor& prediction, const Tensor& target) const {
    if (prediction.rank() != 2) fail_input("loss softmax_cross_entropy needs N x classes scores, got {}", prediction.shape().to_string());
    check_batch(type(), prediction, target, 1);
    if (target.device() != prediction.device())
      fail("loss softmax_cross_entropy: scores on {}, labels on {} (executor bug)", prediction.device().to_string(),
           target.device().to_string());
    const Tensor labels = target.to(Device::host());
    const std::int64_t classes = prediction.dim(1);
    for (std::int64_t n = 0; n < prediction.dim(0); ++n) {
      const float label = labels.data()[n];
      if (!(label >= 0 && label < static_cast<float>(classes)) || label != std::floor(label))
        fail_input("loss softmax_cross_entropy: sample {} has label {}, but labels must be class indices 0..{}", n,
                   label, classes - 1);
    }
  }

  /// correct() has no context: the kernels of the scores' device.
  static ElementwiseKernels& kernels_of(const Tensor& prediction) { return elementwise_kernels(prediction.device()); }

  /// Loss sum; when `grad` is given, also (softmax - one_hot) * scale. Log-sum-exp in double.
  double run(const Tensor& prediction, const Tensor& target, float* grad, double scale,
             ElementwiseKernels& kernels) override {
    check(prediction, target);
    return kernels.softmax_cross_entropy(prediction.data(), target.data(), prediction.dim(0), prediction.dim(1), scale,
                                         grad);
  }
};

/// Per sample: the mean over its values of (prediction - target)^2, so the batch mean equals
/// PyTorch's MSELoss (mean over every element).
class MeanSquaredError final : public SummedLoss {
 public:
  std::string_view type() const override { return "mse"; }

  Shape target_shape(const Shape& prediction_sample_shape) const override { return prediction_sample_shape; }


 private:
  double run(const Tensor& prediction, const Tensor& target, float* grad, double scale,
             ElementwiseKernels& kernels) override {
    const std::int64_t per_sample = prediction.shape().sample_numel();
    check_batch(type(), prediction, target, per_sample);
    if (target.device() != prediction.device())
      fail("loss mse: prediction on {}, target on {} (executor bug)", prediction.device().to_string(),
           target.device().to_string());
    const double inverse_count = 1.0 / static_cast<double>(std::max<std::int64_t>(per_sample, 1));
    return kernels.squared_error(prediction.data(), target.data(), prediction.numel(), inverse_count, scale, grad);
  }
};

}  // namespace

std::unique_ptr<Loss> create_loss(const std::string& type, LayerOptions& options) {
  std::unique_ptr<Loss> loss;
  if (type == "softmax_cross_entropy") loss = std::make_unique<SoftmaxCrossEntropy>();
  else if (type == "mse") loss = std::make_unique<MeanSquaredError>();
  else fail_input("unknown loss '{}'; known losses: mse, softmax_cross_entropy", type);
  options.check_all_used();
  return loss;
}

}  // namespace tessera
