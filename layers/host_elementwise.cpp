// The host's element-wise kernels (ElementwiseKernels), as Kokkos loops.
#include <algorithm>
#include <cmath>
#include <cstring>

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

  double softmax_cross_entropy(const float* scores, const float* labels, std::int64_t rows, std::int64_t classes,
                               double scale, float* grad) override {
    return host_sum("softmax_cross_entropy", rows, [=](std::int64_t n) {
      const float* row = scores + n * classes;
      double largest = row[0];
      for (std::int64_t k = 1; k < classes; ++k) largest = std::max(largest, static_cast<double>(row[k]));
      double total = 0.0;
      for (std::int64_t k = 0; k < classes; ++k) total += std::exp(row[k] - largest);
      const auto label = static_cast<std::int64_t>(labels[n]);
      if (grad) {
        for (std::int64_t k = 0; k < classes; ++k) {
          const double probability = std::exp(row[k] - largest) / total;
          grad[n * classes + k] = static_cast<float>((probability - (k == label ? 1.0 : 0.0)) * scale);
        }
      }
      return std::log(total) + largest - row[label];
    });
  }

  std::int64_t count_correct(const float* scores, const float* labels, std::int64_t rows,
                             std::int64_t classes) override {
    return static_cast<std::int64_t>(host_sum("softmax_cross_entropy correct", rows, [=](std::int64_t n) {
      const float* row = scores + n * classes;
      std::int64_t best = 0;
      for (std::int64_t k = 1; k < classes; ++k)
        if (row[k] > row[best]) best = k;
      return best == static_cast<std::int64_t>(labels[n]) ? 1.0 : 0.0;
    }));
  }

  void accumulate(const float* x, float* y, std::int64_t count) override {
    host_for("accumulate", count, [=](std::int64_t i) { y[i] += x[i]; });
  }

  void copy_rows(const float* source, std::int64_t source_stride, float* destination, std::int64_t destination_stride,
                 std::int64_t rows, std::int64_t length) override {
    host_for("copy rows", rows, [=](std::int64_t r) {
      std::memcpy(destination + r * destination_stride, source + r * source_stride,
                  static_cast<std::size_t>(length) * sizeof(float));
    });
  }
};

}  // namespace

ElementwiseKernels& host_elementwise() {
  static HostElementwise kernels;
  return kernels;
}

}  // namespace tessera
