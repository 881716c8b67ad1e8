// The host's element-wise kernels (ElementwiseKernels), as Kokkos loops.
#include <algorithm>

#include "layers/host_loops.hpp"
#include "tessera/layers/dnn_backend.hpp"

namespace tessera {
namespace {

class HostElementwise final : public ElementwiseKernels {
 public:
  void leaky_relu_forward(const float* x, float* y, std::int64_t count, float slope) override {
    // Written branch-free (max/min) so the compiler vectorizes it; exact for every input.
    host_for("leaky_relu forward", count, [=](std::int64_t i) {
      const float value = x[i];
      y[i] = std::max(value, 0.0f) + slope * std::min(value, 0.0f);
    });
  }

  void leaky_relu_backward(const float* x, const float* dy, float* dx, std::int64_t count, float slope) override {
    host_for("leaky_relu backward", count, [=](std::int64_t i) {
      const float factor = x[i] > 0 ? 1.0f : slope;
      dx[i] = dy[i] * factor;
    });
  }

  double squared_error(const float* prediction, const float* target, std::int64_t count, double weight, double scale,
                       float* grad) override {
    return host_sum("squared error", count, [=](std::int64_t i) {
      const double difference = static_cast<double>(prediction[i]) - target[i];
      if (grad) grad[i] = static_cast<float>(2.0 * difference * weight * scale);
      return difference * difference * weight;
    });
  }
};

}  // namespace

ElementwiseKernels& host_elementwise() {
  static HostElementwise kernels;
  return kernels;
}

}  // namespace tessera
