#pragma once
// 3 x 3 x 3 convolutions at stride 1 computed by Winograd's minimal filtering F(2x2x2, 3x3x3) on
// Tessera's plain layout, forward, backward-data and backward-weights, on the host's threads: 8
// multiplications per output and channel pair instead of 27 (docs/benchmarks.md measures what it
// saves).
#include <cstdint>
#include <memory>
#include <vector>

#include "tessera/layers/dnn_backend.hpp"

namespace tessera::host {

struct WinogradShape;

/// Whether the Winograd kernels compute this convolution: 3-D, fp32, kernel 3 x 3 x 3, stride and
/// dilation 1, padding at most 2, at least 8 input and 8 output channels.
bool winograd_convolution_applies(const ConvolutionGeometry& geometry);

/// The 2 x 2 x 2 output tiles the kernels compute a 3-D convolution in (the last ones partial).
std::int64_t winograd_tiles(const ConvolutionGeometry& geometry);

/// The Winograd kernels. Tiles of 2 x 2 x 2 outputs start at even positions of the region a call
/// computes; each output sums its 64 transformed products in one fixed order, so a result depends
/// on the tile's position in that region only through rounding (about 1e-7 relative).
class WinogradConvolution {
 public:
  /// geometry.leaky_relu: the activation applied as leaky_relu_forward does (slopes > 0).
  void forward(const ConvolutionGeometry& geometry, const float* input, const float* weights, const float* bias,
               float* output);
  /// grad_input = the convolution of grad_output with the flipped, transposed weights; where the
  /// geometry names a data region within 2 - padding of the window's start, only that region
  /// (zeros around it).
  void backward_data(const ConvolutionGeometry& geometry, const float* grad_output, const float* weights,
                     float* grad_input);
  /// Overwrites grad_weights, and grad_bias when the geometry has a bias. Each thread sums its
  /// tiles' products in fp32, per chunk of 256 tiles in 16 lanes whose sums are added up at the
  /// chunk's end; the threads' sums are added in double.
  void backward_weights(const ConvolutionGeometry& geometry, const float* input, const float* grad_output,
                        float* grad_weights, float* grad_bias);

 private:
  struct AlignedFree {
    void operator()(float* p) const;
  };
  static float* buffer(std::unique_ptr<float[], AlignedFree>& kept, std::int64_t& capacity, std::int64_t floats);
  /// The input with its padding written out as zeros, every tile's window inside (the input
  /// itself where it needs no padding and no slack: WinogradShape::padded_in_place).
  const float* pad(const WinogradShape& shape, const float* input);
  void run(const WinogradShape& shape, const float* input, const float* bias, bool leaky, float slope, float* output);

  std::unique_ptr<float[], AlignedFree> padded_;  ///< the input with its padding written out as zeros
  std::int64_t padded_capacity_ = 0;
  std::vector<float> transformed_;  ///< the weights, transformed: [64 points][in channels][out channels]
  std::unique_ptr<float[], AlignedFree> blocks_;  ///< per thread: the blocks' transformed operands and sums
  std::int64_t blocks_capacity_ = 0;
  std::vector<double> sums_;  ///< backward-weights: the threads' sums per point, channel and filter
};

}  // namespace tessera::host
