#pragma once
// Internal to the oneDNN backend: the engine and stream the kernel families share, and the
// operand helper that binds a caller's plain buffer to the layout a primitive chose.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#include "tessera/layers/dnn_backend.hpp"

namespace tessera::onednn {

struct Context {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::vector<std::string> implementations;

  /// Records which implementation oneDNN chose for a primitive (see DnnBackend::implementations).
  void record(const std::string& what, const dnnl::primitive_desc_base& descriptor) {
    implementations.push_back(what + ": " + descriptor.impl_info_str());
  }
  void record(const std::string& what, const std::string& implementation) {
    implementations.push_back(what + ": " + implementation);
  }
  /// Whether oneDNN runs AVX-512 kernels here (its effective ISA includes avx512_core).
  bool avx512() const {
    const auto mask = static_cast<unsigned>(dnnl_cpu_isa_avx512_core);
    return (static_cast<unsigned>(dnnl::get_effective_cpu_isa()) & mask) == mask;
  }
};

using Dims = dnnl::memory::dims;
using Tag = dnnl::memory::format_tag;

inline Dims to_dims(const std::vector<std::int64_t>& values) { return Dims(values.begin(), values.end()); }

/// N x C x spatial... in plain order (nchw / ncdhw), or `any` to let the primitive choose.
inline dnnl::memory::desc activation_desc(std::int64_t n, std::int64_t c, const std::vector<std::int64_t>& spatial,
                                          bool let_library_choose) {
  Dims dims{n, c};
  dims.insert(dims.end(), spatial.begin(), spatial.end());
  const Tag tag = let_library_choose ? Tag::any : (spatial.size() == 3 ? Tag::ncdhw : Tag::nchw);
  return dnnl::memory::desc(dims, dnnl::memory::data_type::f32, tag);
}

/// A caller's plain buffer and the memory a primitive reads or writes. When the primitive chose
/// another layout, a reorder primitive (built once) converts through a buffer owned here;
/// otherwise both name the same memory and binding costs one pointer assignment.
class Operand {
 public:
  Operand() = default;
  Operand(const dnnl::memory::desc& user_desc, const dnnl::memory::desc& primitive_desc,
          const dnnl::engine& engine, bool is_input)
      : user_(user_desc, engine, DNNL_MEMORY_NONE) {
    if (user_desc == primitive_desc) {
      internal_ = user_;
    } else {
      internal_ = dnnl::memory(primitive_desc, engine);
      reorder_ = is_input ? dnnl::reorder(user_, internal_) : dnnl::reorder(internal_, user_);
    }
  }

  /// For inputs: points at the caller's data and converts it if needed.
  dnnl::memory& bind_input(const float* data, dnnl::stream& stream) {
    user_.set_data_handle(const_cast<float*>(data));
    if (reorder_) reorder_->execute(stream, user_, internal_);
    return internal_;
  }
  /// For outputs: points at the caller's buffer; call finish_output after the primitive ran.
  dnnl::memory& bind_output(float* data) {
    user_.set_data_handle(data);
    return internal_;
  }
  void finish_output(dnnl::stream& stream) {
    if (reorder_) reorder_->execute(stream, internal_, user_);
  }
  bool converts() const { return reorder_.has_value(); }

 private:
  dnnl::memory user_;
  dnnl::memory internal_;
  std::optional<dnnl::reorder> reorder_;
};

/// How 3-D (5-D tensor) backward-weights is computed. oneDNN 2.6 has no jit kernel for it on
/// AVX2 (it falls back to im2col + gemm); the decomposed forms run 2-D jit kernels instead:
/// PerDepth one 2-D problem per kernel depth position kd over the (sample, output depth) pairs,
/// Folded one 2-D problem with the kd positions folded into the input channels (for few channels).
enum class BackwardWeights3d {
  /// Decomposed when oneDNN's own 3-D primitive is not a jit one, the problem has 2^20 or more
  /// multiply-adds and the 2-D kernels are jit ones (Folded below 8 input channels).
  Automatic,
  Direct,     ///< always oneDNN's own 3-D primitive
  PerDepth,   ///< always per kd (tests)
  Folded,     ///< always folded (tests)
};

std::unique_ptr<ConvolutionKernels> make_convolution_kernels(Context& context, HostConvolutionLayout layout,
                                                             BackwardWeights3d backward_weights_3d = BackwardWeights3d::Automatic);
std::unique_ptr<PoolingKernels> make_pooling_kernels(Context& context);
std::unique_ptr<LinearKernels> make_linear_kernels(Context& context);

}  // namespace tessera::onednn
