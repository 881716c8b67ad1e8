// The host's element-wise kernels (ElementwiseKernels), as Kokkos loops.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "layers/bf16_bits.hpp"
#include "layers/cuda_elementwise.hpp"
#include "layers/host_loops.hpp"
#include "tessera/layers/dnn_backend.hpp"

namespace tessera {
namespace {

// The optimizer updates: fp32 storage and arithmetic (like PyTorch's float kernels), one pass
// over each array, restrict-qualified so that the compiler vectorises them (plain loops: an
// update is memory-bound, and a fixed operation order keeps the CUDA kernels bit-equal).

void sgd_loop(std::int64_t n, float* __restrict p, const float* __restrict g, float* __restrict buf,
              const SgdStep& step) {
  const float lr = step.lr, momentum = step.momentum, weight_decay = step.weight_decay;
  if (buf == nullptr) {
    if (weight_decay != 0.0f) {
      for (std::int64_t i = 0; i < n; ++i) p[i] -= lr * (g[i] + weight_decay * p[i]);
    } else {
      for (std::int64_t i = 0; i < n; ++i) p[i] -= lr * g[i];
    }
    return;
  }
  if (step.nesterov) {
    for (std::int64_t i = 0; i < n; ++i) {
      const float d = g[i] + weight_decay * p[i];
      const float b = momentum * buf[i] + d;
      buf[i] = b;
      p[i] -= lr * (d + momentum * b);
    }
  } else {
    for (std::int64_t i = 0; i < n; ++i) {
      const float d = g[i] + weight_decay * p[i];
      const float b = momentum * buf[i] + d;
      buf[i] = b;
      p[i] -= lr * b;
    }
  }
}

void adam_loop(std::int64_t n, float* __restrict p, const float* __restrict g, float* __restrict m,
               float* __restrict v, const AdamStep& s) {
  const float l2 = s.l2_decay, scale = s.decoupled_scale, b1 = s.beta1, c1 = s.one_minus_beta1;
  const float b2 = s.beta2, c2 = s.one_minus_beta2, step_size = s.step_size;
  const float bc2 = s.bias_correction2_sqrt, eps = s.epsilon;
  for (std::int64_t i = 0; i < n; ++i) {
    const float pi = p[i] * scale;
    const float gi = g[i] + l2 * pi;
    const float mi = b1 * m[i] + c1 * gi;
    const float vi = b2 * v[i] + c2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi - step_size * (mi / (std::sqrt(vi) / bc2 + eps));
  }
}

/// The optimizer updates run over the threads in chunks of this many elements.
constexpr std::int64_t kUpdateChunk = 16384;

/// update(begin, n) over [0, count) in chunks of kUpdateChunk, spread over the rank's threads.
template <typename Update>
void update_in_chunks(const char* label, std::int64_t count, const Update& update) {
  host_for(
      label, (count + kUpdateChunk - 1) / kUpdateChunk,
      [=](std::int64_t c) {
        const std::int64_t begin = c * kUpdateChunk;
        update(begin, std::min(kUpdateChunk, count - begin));
      },
      kUpdateChunk);
}

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

  void round_to_bf16(const float* x, float* y, std::int64_t count) override {
    host_for("round_to_bf16", count, [=](std::int64_t i) {
      std::uint32_t bits;
      std::memcpy(&bits, x + i, sizeof bits);
      bits = bf16_round_bits(bits);
      std::memcpy(y + i, &bits, sizeof bits);
    });
  }
  void to_bf16(const float* x, std::uint16_t* y, std::int64_t count) override {
    host_for("to_bf16", count, [=](std::int64_t i) {
      std::uint32_t bits;
      std::memcpy(&bits, x + i, sizeof bits);
      y[i] = static_cast<std::uint16_t>(bf16_round_bits(bits) >> 16);
    });
  }
  void from_bf16(const std::uint16_t* x, float* y, std::int64_t count) override {
    host_for("from_bf16", count, [=](std::int64_t i) {
      const std::uint32_t bits = static_cast<std::uint32_t>(x[i]) << 16;
      std::memcpy(y + i, &bits, sizeof bits);
    });
  }
  void dropout_scales(const DropoutMask& mask, float* scales, std::int64_t count) override {
    host_for("dropout scales", count, [=](std::int64_t i) { scales[i] = dropout_scale(mask, i); });
  }
  void multiply(const float* a, const float* b, float* y, std::int64_t count) override {
    host_for("multiply", count, [=](std::int64_t i) { y[i] = a[i] * b[i]; });
  }

  void copy_rows(const float* source, std::int64_t source_stride, float* destination, std::int64_t destination_stride,
                 std::int64_t rows, std::int64_t length) override {
    host_for(
        "copy rows", rows,
        [=](std::int64_t r) {
          std::memcpy(destination + r * destination_stride, source + r * source_stride,
                      static_cast<std::size_t>(length) * sizeof(float));
        },
        length);
  }

  void sgd_update(float* p, const float* g, float* momentum_buffer, std::int64_t count, const SgdStep& step) override {
    update_in_chunks("sgd update", count, [=](std::int64_t begin, std::int64_t n) {
      sgd_loop(n, p + begin, g + begin, momentum_buffer ? momentum_buffer + begin : nullptr, step);
    });
  }

  void adam_update(float* p, const float* g, float* m, float* v, std::int64_t count, const AdamStep& step) override {
    update_in_chunks("adam update", count, [=](std::int64_t begin, std::int64_t n) {
      adam_loop(n, p + begin, g + begin, m + begin, v + begin, step);
    });
  }

  void batch_norm_statistics(const float* x, std::int64_t batch, std::int64_t channels, std::int64_t inner,
                             double* sums) override {
    host_for(
        "batchnorm statistics", channels,
        [=](std::int64_t c) {
          double sum = 0.0, squares = 0.0;
          for (std::int64_t n = 0; n < batch; ++n) {
            const float* row = x + (n * channels + c) * inner;
            for (std::int64_t i = 0; i < inner; ++i) {
              sum += row[i];
              squares += static_cast<double>(row[i]) * row[i];
            }
          }
          sums[c] = sum;
          sums[channels + c] = squares;
        },
        batch * inner);
  }

  void batch_norm_normalize(const float* x, float* y, std::int64_t batch, std::int64_t channels, std::int64_t inner,
                            const float* scale, const float* shift) override {
    host_for(
        "batchnorm normalize", batch * channels,
        [=](std::int64_t row) {
          const std::int64_t c = row % channels;
          const float a = scale[c], b = shift[c];
          const float* in = x + row * inner;
          float* out = y + row * inner;
          for (std::int64_t i = 0; i < inner; ++i) out[i] = a * in[i] + b;
        },
        inner);
  }

  void batch_norm_backward_sums(const float* x, const float* dy, std::int64_t batch, std::int64_t channels,
                                std::int64_t inner, const double* mean, const double* inverse_std,
                                double* sums) override {
    host_for(
        "batchnorm backward sums", channels,
        [=](std::int64_t c) {
          double sum_dy = 0.0, sum_dy_xhat = 0.0;
          for (std::int64_t n = 0; n < batch; ++n) {
            const std::int64_t offset = (n * channels + c) * inner;
            for (std::int64_t i = 0; i < inner; ++i) {
              sum_dy += dy[offset + i];
              sum_dy_xhat += static_cast<double>(dy[offset + i]) * ((x[offset + i] - mean[c]) * inverse_std[c]);
            }
          }
          sums[c] = sum_dy;
          sums[channels + c] = sum_dy_xhat;
        },
        batch * inner);
  }

  void batch_norm_backward(const float* x, const float* dy, float* dx, std::int64_t batch, std::int64_t channels,
                           std::int64_t inner, const double* scale, const double* mean, const double* inverse_std,
                           const double* mean_dy, const double* mean_dy_xhat) override {
    host_for(
        "batchnorm backward", batch * channels,
        [=](std::int64_t row) {
          const std::int64_t c = row % channels;
          const std::int64_t offset = row * inner;
          if (!mean_dy) {  // statistics were constants (evaluation mode)
            for (std::int64_t i = 0; i < inner; ++i) dx[offset + i] = static_cast<float>(scale[c] * dy[offset + i]);
            return;
          }
          for (std::int64_t i = 0; i < inner; ++i) {
            const double xhat = (x[offset + i] - mean[c]) * inverse_std[c];
            dx[offset + i] = static_cast<float>(scale[c] * (dy[offset + i] - mean_dy[c] - xhat * mean_dy_xhat[c]));
          }
        },
        inner);
  }
};

}  // namespace

ElementwiseKernels& host_elementwise() {
  static HostElementwise kernels;
  return kernels;
}

ElementwiseKernels& elementwise_kernels(const Device& device) {
  if (device.is_host()) return host_elementwise();
  return cuda_elementwise(device.index);
}

}  // namespace tessera
