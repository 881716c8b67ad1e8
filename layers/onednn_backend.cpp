// The host DnnBackend: oneDNN kernel families sharing one engine and stream.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "layers/bf16_operands.hpp"
#include "layers/onednn_common.hpp"
#include "tessera/core/error.hpp"

namespace tessera {

std::string ConvolutionGeometry::to_string() const {
  return fmt::format("N={} C={} F={} input={} kernel={} stride={} padding={} dilation={} output={}{}{}{}{}", batch,
                     in_channels, out_channels, input_size, kernel, stride, padding, dilation, output_size,
                     bias ? " +bias" : "", precision == Precision::BF16 ? " bf16" : "",
                     leaky_relu ? fmt::format(" +leaky_relu({})", leaky_slope) : std::string(),
                     data_begin.empty() ? std::string()
                                        : fmt::format(" data={} from {}", data_extent, data_begin));
}

std::int64_t ConvolutionGeometry::input_elements() const {
  std::int64_t n = batch * in_channels;
  for (auto e : input_size) n *= e;
  return n;
}
std::int64_t ConvolutionGeometry::output_elements() const {
  std::int64_t n = batch * out_channels;
  for (auto e : output_size) n *= e;
  return n;
}
std::int64_t ConvolutionGeometry::weight_elements() const {
  std::int64_t n = out_channels * in_channels;
  for (auto e : kernel) n *= e;
  return n;
}

std::string PoolingGeometry::to_string() const {
  return fmt::format("{} N={} C={} input={} kernel={} stride={} padding={} output={}",
                     mode == PoolingMode::Max ? "max" : "avg", batch, channels, input_size, kernel, stride, padding,
                     output_size);
}

std::string LinearGeometry::to_string() const {
  return fmt::format("N={} in={} out={}{}{}", batch, in_features, out_features, bias ? " +bias" : "",
                     precision == Precision::BF16 ? " bf16" : "");
}

void ConvolutionKernels::backward_weights_from_pooling(const ConvolutionGeometry& geometry, const float*,
                                                       const PooledGradient& pooled, float*, float*) {
  fail("convolution kernels asked for the weight gradients of {} from a pooling ({}) they do not read (executor bug)",
       geometry.to_string(), pooled.geometry ? pooled.geometry->to_string() : std::string("none"));
}

void ConvolutionKernels::forward_pooled(const ConvolutionGeometry& geometry, const float*, const float*, const float*,
                                        const PooledOutput& pooled) {
  fail("convolution kernels asked for {} pooled by {}, which they do not write (executor bug)", geometry.to_string(),
       pooled.geometry ? pooled.geometry->to_string() : std::string("none"));
}

Bf16Convolutions parse_bf16_convolutions(const std::string& text) {
  if (text == "native") return Bf16Convolutions::Native;
  if (text == "exact") return Bf16Convolutions::Exact;
  throw InputError(fmt::format("bf16 convolutions '{}': choose native (cuDNN's bf16, bf16 results) or exact "
                               "(the host's fp32 results, at TF32's rate)",
                               text));
}

namespace {

class HostBackend final : public DnnBackend {
 public:
  explicit HostBackend(const HostBackendOptions& options)
      : convolution_(with_bf16_operands(onednn::make_convolution_kernels(context_, options.convolution_layout),
                                        host_elementwise(), Device::host())),
        pooling_(onednn::make_pooling_kernels(context_)),
        linear_(with_bf16_operands(onednn::make_linear_kernels(context_), host_elementwise(), Device::host())) {}

  std::string name() const override { return "onednn"; }
  ConvolutionKernels& convolution() override { return *convolution_; }
  PoolingKernels& pooling() override { return *pooling_; }
  LinearKernels& linear() override { return *linear_; }
  ElementwiseKernels& elementwise() override { return host_elementwise(); }
  std::vector<std::string> implementations() const override { return context_.implementations; }

 private:
  onednn::Context context_;
  std::unique_ptr<ConvolutionKernels> convolution_;
  std::unique_ptr<PoolingKernels> pooling_;
  std::unique_ptr<LinearKernels> linear_;
};

}  // namespace

std::unique_ptr<DnnBackend> make_host_backend(const HostBackendOptions& options) {
  return std::make_unique<HostBackend>(options);
}

}  // namespace tessera
