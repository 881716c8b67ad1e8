#pragma once
// Convolutions of one input channel (a network's first layer) computed directly on Tessera's plain
// layout, forward and backward-weights, on the host's threads: oneDNN's kernels for them need its
// blocked layout and so convert the layer's large output and its gradient (docs/benchmarks.md).
#include <cstdint>
#include <memory>
#include <vector>

#include "tessera/layers/dnn_backend.hpp"
#include "tessera/parallel/step_plan.hpp"

namespace tessera::host {

/// Whether the direct kernels compute this convolution: 2-D or 3-D, one input channel, stride and
/// dilation 1, kernel width 3 and at most 7 along the other dimensions, padding below the kernel.
bool direct_convolution_applies(const ConvolutionGeometry& geometry);

/// Whether DirectConvolution::backward_weights_from_pooling applies: a max pooling of windows 2
/// wide and high (1 or 2 deep) at their own stride and without padding, in rows of
/// kPooledRowWindows or more (step_plan.hpp), whose windows tile this convolution's output (its input, as the
/// convolution computes it) exactly.
bool pooled_gradient_applies(const ConvolutionGeometry& geometry, const PoolingGeometry& pooling);

/// The direct kernels. Forward sums each output's taps in one fixed order (bias first), so an
/// output does not depend on the tile or region it is computed in; backward-weights sums each
/// plane (sample, output depth) in fp32 and the planes in double.
class DirectConvolution {
 public:
  /// geometry.leaky_relu: the activation applied as leaky_relu_forward does (slopes > 0).
  void forward(const ConvolutionGeometry& geometry, const float* input, const float* weights, const float* bias,
               float* output);
  /// Overwrites grad_weights, and grad_bias when the geometry has a bias.
  void backward_weights(const ConvolutionGeometry& geometry, const float* input, const float* grad_output,
                        float* grad_weights, float* grad_bias);
  /// forward followed by that max pooling's forward (where pooled_gradient_applies): its output
  /// and the places of its maxima into `pooled`, without the convolution's output: the same values
  /// and places to the bit.
  void forward_pooled(const ConvolutionGeometry& geometry, const float* input, const float* weights, const float* bias,
                      const PooledOutput& pooled);
  /// backward_weights of the output gradient a max pooling's backward would write (where
  /// pooled_gradient_applies), made a row at a time from `pooled`: the same sums to the bit.
  void backward_weights_from_pooling(const ConvolutionGeometry& geometry, const float* input,
                                     const PooledGradient& pooled, float* grad_weights, float* grad_bias);

 private:
  /// backward_weights over the output gradient's rows as `rows` gives them (DenseRows, PooledRows).
  template <typename Rows>
  void weights_from(const ConvolutionGeometry& geometry, const float* input, const Rows& rows, float* grad_weights,
                    float* grad_bias);
  /// The input with its padding written out as zeros, rows rounded up for whole vectors.
  const float* padded_input(const ConvolutionGeometry& geometry, const float* input);

  struct AlignedFree {
    void operator()(float* p) const;
  };
  std::unique_ptr<float[], AlignedFree> padded_;
  std::int64_t padded_capacity_ = 0;
  /// Per thread: forward's row buffers, backward-weights' packed output gradients and a row of
  /// them (kept, so that a training step allocates nothing).
  std::vector<float> rows_, packs_;
};

}  // namespace tessera::host
