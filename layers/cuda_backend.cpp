// The CUDA DnnBackend: convolutions on cuDNN (the fastest algorithm for each geometry is
// measured once with cudnnFind*AlgorithmEx and cached, as PyTorch's cudnn.benchmark does),
// linear layers on cuBLAS, pooling on Tessera's own kernels (the host kernels' semantics, tiles
// included). fp32 by default means strict fp32: no TF32 tensor-core math in cuDNN (FMA math) or
// cuBLAS (its default math never uses TF32 for fp32), so results agree with the host backend to ~1e-6.
// Precision::BF16 (bf16 operands, fp32 sums):
//  - linear layers: the operands rounded to bf16 (with_bf16_operands), then cuBLAS with bf16
//    tensor-core math (CUBLAS_COMPUTE_32F_FAST_16BF: its conversion of the operands to bf16 is
//    exact, the sums and results fp32): the host's results.
//  - convolutions, Bf16Convolutions::Native (the default): cuDNN's bf16 configuration on bf16
//    tensors (bf16 tensor cores, fp32 sums; GEMM-type algorithms, which multiply the operands as
//    they are); cuDNN writes bf16 results, widened to fp32: the host's results rounded to bf16.
//  - convolutions, Bf16Convolutions::Exact: the rounded operands in fp32 tensors through cuDNN's
//    GEMM-type algorithms on TF32 tensor cores (a bf16 value is a TF32 value, so the products stay
//    exact; Winograd and FFT transform the operands first, so they are not used): the host's
//    fp32 results, at TF32's rate.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <map>
#include <memory>
#include <vector>

#include "layers/bf16_operands.hpp"
#include "layers/cuda_elementwise.hpp"
#include "layers/cuda_kernels.hpp"
#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/layers/dnn_backend.hpp"

namespace tessera {
namespace {

void check(cudnnStatus_t status, const char* what) {
  if (status != CUDNN_STATUS_SUCCESS) fail("cuDNN: {} failed: {}", what, cudnnGetErrorString(status));
}
void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) fail("cuBLAS: {} failed: {}", what, cublasGetStatusString(status));
}

/// Workspace from the caching allocator for the length of one queued call.
class Workspace {
 public:
  explicit Workspace(std::size_t bytes) : bytes_(bytes), pointer_(bytes ? cuda::allocate(bytes) : nullptr) {}
  ~Workspace() { cuda::release(pointer_); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  void* get() const { return pointer_; }
  std::size_t bytes() const { return bytes_; }

 private:
  std::size_t bytes_;
  void* pointer_;
};

template <typename T, cudnnStatus_t (*Create)(T*), cudnnStatus_t (*Destroy)(T)>
class Descriptor {
 public:
  Descriptor() { check(Create(&handle_), "creating a descriptor"); }
  ~Descriptor() { Destroy(handle_); }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  T get() const { return handle_; }

 private:
  T handle_{};
};
using TensorDescriptor = Descriptor<cudnnTensorDescriptor_t, cudnnCreateTensorDescriptor, cudnnDestroyTensorDescriptor>;
using FilterDescriptor = Descriptor<cudnnFilterDescriptor_t, cudnnCreateFilterDescriptor, cudnnDestroyFilterDescriptor>;
using ConvDescriptor =
    Descriptor<cudnnConvolutionDescriptor_t, cudnnCreateConvolutionDescriptor, cudnnDestroyConvolutionDescriptor>;

std::vector<int> as_int(const std::vector<std::int64_t>& values) { return {values.begin(), values.end()}; }

void set_tensor(const TensorDescriptor& descriptor, cudnnDataType_t type, std::vector<int> dims) {
  check(cudnnSetTensorNdDescriptorEx(descriptor.get(), CUDNN_TENSOR_NCHW, type, static_cast<int>(dims.size()), dims.data()),
        "cudnnSetTensorNdDescriptorEx");
}

/// Whether cuDNN has an algorithm for a direction of a geometry: not asked yet, one (chosen), none.
enum class Search { NotYet, Found, NoneUsable };

/// cuDNN's performance record of each direction's algorithm search.
template <typename Algo>
struct PerfOf;
template <>
struct PerfOf<cudnnConvolutionFwdAlgo_t> {
  using type = cudnnConvolutionFwdAlgoPerf_t;
};
template <>
struct PerfOf<cudnnConvolutionBwdDataAlgo_t> {
  using type = cudnnConvolutionBwdDataAlgoPerf_t;
};
template <>
struct PerfOf<cudnnConvolutionBwdFilterAlgo_t> {
  using type = cudnnConvolutionBwdFilterAlgoPerf_t;
};

/// One direction's convolution descriptor (it carries the math type its algorithm was measured
/// with) and the algorithm chosen for it.
template <typename Algo>
struct Chosen {
  ConvDescriptor conv;
  Search state = Search::NotYet;
  Algo algorithm{};
  std::size_t workspace = 0;
};

/// The descriptors of one convolution geometry and the algorithm chosen for each direction.
/// input, output and weights describe the data as stored (fp32, or bf16); bias and bias_output
/// are fp32 always (the bias is added to, and summed from, fp32).
struct ConvolutionPlan {
  TensorDescriptor input, output, bias, bias_output;
  FilterDescriptor weights;
  Chosen<cudnnConvolutionFwdAlgo_t> forward;
  Chosen<cudnnConvolutionBwdDataAlgo_t> data;
  Chosen<cudnnConvolutionBwdFilterAlgo_t> filter;
};

/// cuDNN's three convolution directions on data stored as `storage` (CUDNN_DATA_FLOAT, or
/// CUDNN_DATA_BFLOAT16: cuDNN's bf16 configuration, fp32 sums). Each call returns whether it ran:
/// with `required` a geometry without a usable algorithm fails instead.
class CudnnConvolutionCore {
 public:
  CudnnConvolutionCore(cudnnHandle_t handle, const CudaBackendOptions& options, std::vector<std::string>& log,
                       cudnnDataType_t storage)
      : handle_(handle),
        options_(options),
        log_(log),
        storage_(storage) {}

  bool forward(const ConvolutionGeometry& g, const void* input, const void* weights, void* output, bool required) {
    ConvolutionPlan& plan = plan_for(g);
    auto& chosen = plan.forward;
    const auto find = [&](std::vector<cudnnConvolutionFwdAlgoPerf_t>& perf, int& returned, const Workspace& search) {
      return cudnnFindConvolutionForwardAlgorithmEx(handle_, plan.input.get(), input, plan.weights.get(), weights,
                                                    chosen.conv.get(), plan.output.get(), output,
                                                    static_cast<int>(perf.size()), &returned, perf.data(),
                                                    search.get(), search.bytes());
    };
    const auto size = [&](cudnnConvolutionFwdAlgo_t algo, std::size_t& bytes) {
      return cudnnGetConvolutionForwardWorkspaceSize(handle_, plan.input.get(), plan.weights.get(), chosen.conv.get(),
                                                     plan.output.get(), algo, &bytes);
    };
    if (!algorithm_for(chosen, CUDNN_CONVOLUTION_FWD_ALGO_COUNT, "forward", g, required, find, size)) return false;
    Workspace workspace(chosen.workspace);
    const float one = 1.0f, zero = 0.0f;
    check(cudnnConvolutionForward(handle_, &one, plan.input.get(), input, plan.weights.get(), weights, chosen.conv.get(),
                                  chosen.algorithm, workspace.get(), workspace.bytes(), &zero, plan.output.get(), output),
          "cudnnConvolutionForward");
    return true;
  }

  bool backward_data(const ConvolutionGeometry& g, const void* grad_output, const void* weights, void* grad_input,
                     bool required) {
    ConvolutionPlan& plan = plan_for(g);
    auto& chosen = plan.data;
    const auto find = [&](std::vector<cudnnConvolutionBwdDataAlgoPerf_t>& perf, int& returned, const Workspace& search) {
      return cudnnFindConvolutionBackwardDataAlgorithmEx(handle_, plan.weights.get(), weights, plan.output.get(),
                                                         grad_output, chosen.conv.get(), plan.input.get(), grad_input,
                                                         static_cast<int>(perf.size()), &returned, perf.data(),
                                                         search.get(), search.bytes());
    };
    const auto size = [&](cudnnConvolutionBwdDataAlgo_t algo, std::size_t& bytes) {
      return cudnnGetConvolutionBackwardDataWorkspaceSize(handle_, plan.weights.get(), plan.output.get(),
                                                          chosen.conv.get(), plan.input.get(), algo, &bytes);
    };
    if (!algorithm_for(chosen, CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT, "backward data", g, required, find, size))
      return false;
    Workspace workspace(chosen.workspace);
    const float one = 1.0f, zero = 0.0f;
    check(cudnnConvolutionBackwardData(handle_, &one, plan.weights.get(), weights, plan.output.get(), grad_output,
                                       chosen.conv.get(), chosen.algorithm, workspace.get(), workspace.bytes(), &zero,
                                       plan.input.get(), grad_input),
          "cudnnConvolutionBackwardData");
    return true;
  }

  bool backward_filter(const ConvolutionGeometry& g, const void* input, const void* grad_output, void* grad_weights,
                       bool required) {
    ConvolutionPlan& plan = plan_for(g);
    auto& chosen = plan.filter;
    const auto find = [&](std::vector<cudnnConvolutionBwdFilterAlgoPerf_t>& perf, int& returned,
                          const Workspace& search) {
      return cudnnFindConvolutionBackwardFilterAlgorithmEx(handle_, plan.input.get(), input, plan.output.get(),
                                                           grad_output, chosen.conv.get(), plan.weights.get(),
                                                           grad_weights, static_cast<int>(perf.size()), &returned,
                                                           perf.data(), search.get(), search.bytes());
    };
    const auto size = [&](cudnnConvolutionBwdFilterAlgo_t algo, std::size_t& bytes) {
      return cudnnGetConvolutionBackwardFilterWorkspaceSize(handle_, plan.input.get(), plan.output.get(),
                                                            chosen.conv.get(), plan.weights.get(), algo, &bytes);
    };
    if (!algorithm_for(chosen, CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT, "backward weights", g, required, find, size))
      return false;
    Workspace workspace(chosen.workspace);
    const float one = 1.0f, zero = 0.0f;
    check(cudnnConvolutionBackwardFilter(handle_, &one, plan.input.get(), input, plan.output.get(), grad_output,
                                         chosen.conv.get(), chosen.algorithm, workspace.get(), workspace.bytes(),
                                         &zero, plan.weights.get(), grad_weights),
          "cudnnConvolutionBackwardFilter");
    return true;
  }

  enum class Direction { Forward, Data, Filter };
  /// The (geometry, direction) searches that found no usable algorithm so far.
  int none_usable() const { return none_usable_; }
  /// False once the search found nothing usable for that direction of `g` (then every call of it
  /// returns false at once).
  bool may_run(const ConvolutionGeometry& g, Direction direction) {
    const ConvolutionPlan& plan = plan_for(g);
    const Search state = direction == Direction::Forward ? plan.forward.state
                         : direction == Direction::Data  ? plan.data.state
                                                         : plan.filter.state;
    return state != Search::NoneUsable;
  }

  /// output (fp32) += the bias of each output channel.
  void add_bias(const ConvolutionGeometry& g, const float* bias, float* output) {
    ConvolutionPlan& plan = plan_for(g);
    const float one = 1.0f;
    check(cudnnAddTensor(handle_, &one, plan.bias.get(), bias, &one, plan.bias_output.get(), output), "cudnnAddTensor");
  }

  /// grad_bias = the fp32 sum of grad_output (fp32) over everything but the channels.
  void bias_gradient(const ConvolutionGeometry& g, const float* grad_output, float* grad_bias) {
    ConvolutionPlan& plan = plan_for(g);
    const float one = 1.0f, zero = 0.0f;
    check(cudnnConvolutionBackwardBias(handle_, &one, plan.bias_output.get(), grad_output, &zero, plan.bias.get(),
                                       grad_bias),
          "cudnnConvolutionBackwardBias");
  }

 private:
  bool bf16_storage() const { return storage_ == CUDNN_DATA_BFLOAT16; }

  ConvolutionPlan& plan_for(const ConvolutionGeometry& g) {
    auto it = plans_.find(g);
    if (it != plans_.end()) return *it->second;
    auto plan = std::make_unique<ConvolutionPlan>();
    const int spatial = static_cast<int>(g.input_size.size());
    TESSERA_CHECK(spatial == 2 || spatial == 3, "cuDNN convolution: {} spatial dimensions (2 or 3 supported)", spatial);
    std::vector<int> input{static_cast<int>(g.batch), static_cast<int>(g.in_channels)};
    std::vector<int> output{static_cast<int>(g.batch), static_cast<int>(g.out_channels)};
    std::vector<int> filter{static_cast<int>(g.out_channels), static_cast<int>(g.in_channels)};
    std::vector<int> bias(static_cast<std::size_t>(spatial) + 2, 1);
    bias[1] = static_cast<int>(g.out_channels);
    for (int i = 0; i < spatial; ++i) {
      input.push_back(static_cast<int>(g.input_size[static_cast<std::size_t>(i)]));
      output.push_back(static_cast<int>(g.output_size[static_cast<std::size_t>(i)]));
      filter.push_back(static_cast<int>(g.kernel[static_cast<std::size_t>(i)]));
    }
    set_tensor(plan->input, storage_, input);
    set_tensor(plan->output, storage_, output);
    set_tensor(plan->bias, CUDNN_DATA_FLOAT, bias);
    set_tensor(plan->bias_output, CUDNN_DATA_FLOAT, output);
    check(cudnnSetFilterNdDescriptor(plan->weights.get(), storage_, CUDNN_TENSOR_NCHW, static_cast<int>(filter.size()),
                                     filter.data()),
          "cudnnSetFilterNdDescriptor");
    const auto padding = as_int(g.padding), stride = as_int(g.stride), dilation = as_int(g.dilation);
    const cudnnMathType_t math = tensor_cores_allowed(g) ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
    for (const ConvDescriptor* conv : {&plan->forward.conv, &plan->data.conv, &plan->filter.conv}) {
      // fp32 sums in either storage (bf16: cuDNN's PSEUDO_BFLOAT16 configuration).
      check(cudnnSetConvolutionNdDescriptor(conv->get(), spatial, padding.data(), stride.data(), dilation.data(),
                                            CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT),
            "cudnnSetConvolutionNdDescriptor");
      check(cudnnSetConvolutionMathType(conv->get(), math), "cudnnSetConvolutionMathType");
    }
    // The geometry's output size must be cuDNN's: a mismatch is a bug in the caller.
    std::vector<int> computed(output.size());
    check(cudnnGetConvolutionNdForwardOutputDim(plan->forward.conv.get(), plan->input.get(), plan->weights.get(),
                                                static_cast<int>(computed.size()), computed.data()),
          "cudnnGetConvolutionNdForwardOutputDim");
    TESSERA_CHECK(computed == output, "cuDNN convolution {}: cuDNN computes another output size", g.to_string());
    return *plans_.emplace(g, std::move(plan)).first->second;
  }

  /// The workspace the algorithm search may try: the option's limit, at most half the free memory.
  std::size_t search_workspace() const {
    std::size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      cudaGetLastError();
      free_bytes = 0;
    }
    return std::min(options_.workspace_limit, free_bytes / 2);
  }


  /// How much slower than the fastest a deterministic algorithm on bf16 tensors may be and still
  /// be chosen.
  static constexpr float kDeterministicSlack = 1.1f;

  /// Tensor cores: where fp32 may use TF32 (allow_tf32), for bf16 operands in fp32 storage (TF32
  /// is exact on them), and for bf16 storage (bf16 tensor cores).
  bool tensor_cores_allowed(const ConvolutionGeometry& g) const {
    return options_.allow_tf32 || g.precision == Precision::BF16;
  }

  static bool tensor_op(cudnnMathType_t math) {
    return math == CUDNN_TENSOR_OP_MATH || math == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION;
  }

  /// Whether an algorithm multiplies bf16 operands as they are (then only the fp32 sums' order
  /// differs from the host's): GEMM-type algorithms do; Winograd and FFT transform them first, and
  /// ALLOW_CONVERSION converts the data to fp16. For bf16 operands in either storage.
  static bool exact_on_bf16(const cudnnConvolutionFwdAlgoPerf_t& p) {
    return p.mathType != CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION &&
           (p.algo == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM ||
            p.algo == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM || p.algo == CUDNN_CONVOLUTION_FWD_ALGO_GEMM ||
            p.algo == CUDNN_CONVOLUTION_FWD_ALGO_DIRECT);
  }
  static bool exact_on_bf16(const cudnnConvolutionBwdDataAlgoPerf_t& p) {
    return p.mathType != CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION &&
           (p.algo == CUDNN_CONVOLUTION_BWD_DATA_ALGO_0 || p.algo == CUDNN_CONVOLUTION_BWD_DATA_ALGO_1);
  }
  static bool exact_on_bf16(const cudnnConvolutionBwdFilterAlgoPerf_t& p) {
    return p.mathType != CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION &&
           (p.algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 || p.algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1 ||
            p.algo == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3);
  }

  /// The algorithm of one direction: searched on its first call (`find` runs cuDNN's Find on the
  /// call's own buffers, with a workspace as large as the most any algorithm asks for by `size`,
  /// within the limit), then cached. False when none is usable (an Error when `required`).
  template <typename Algo, typename Find, typename Size>
  bool algorithm_for(Chosen<Algo>& chosen, int candidates, const char* what, const ConvolutionGeometry& g,
                     bool required, const Find& find, const Size& size) {
    if (chosen.state == Search::NotYet) {
      std::size_t most = 0;
      for (int a = 0; a < candidates; ++a) {
        std::size_t bytes = 0;
        if (size(static_cast<Algo>(a), bytes) == CUDNN_STATUS_SUCCESS) most = std::max(most, bytes);
      }
      Workspace search(std::min(most, search_workspace()));
      std::vector<typename PerfOf<Algo>::type> perf(static_cast<std::size_t>(candidates));
      int returned = 0;
      const cudnnStatus_t status = find(perf, returned, search);
      const auto* best = choose(status, perf, returned, what, g, required);
      chosen.state = best ? Search::Found : Search::NoneUsable;
      if (best) {
        chosen.algorithm = best->algo;
        chosen.workspace = best->memory;
        use_math(chosen.conv, best->mathType, g);
        record(what, g, static_cast<int>(best->algo), best->memory, best->time, math_of(chosen.conv),
               best->determinism == CUDNN_DETERMINISTIC);
      }
    }
    return chosen.state == Search::Found;
  }

  /// Results come sorted by time; the first that ran, fits the workspace limit and, in strict
  /// fp32, does not run on tensor-op (TF32) math wins (bf16 operands may, with a GEMM-type
  /// algorithm: TF32 is exact on them in fp32 storage, bf16 tensor cores in bf16 storage). In bf16
  /// storage the fastest deterministic one wins when it takes at most kDeterministicSlack times
  /// the fastest's time (atomic accumulation sums, and rounds, in another order at every call:
  /// a run with a non-deterministic one does not repeat itself exactly; the log says which ran;
  /// the choice rests on measured times, so it may differ between runs). None: null, with the reason and what the search found in the
  /// log, or an Error when `required`. A search that fails is an Error, but for cuDNN's "not
  /// supported" where there is a fallback.
  template <typename Perf>
  const Perf* choose(cudnnStatus_t search, const std::vector<Perf>& perf, int returned, const char* what,
                     const ConvolutionGeometry& g, bool required) {
    if (search != CUDNN_STATUS_SUCCESS && (required || search != CUDNN_STATUS_NOT_SUPPORTED))
      fail("cuDNN: the {} algorithm search for the convolution {}{} failed: {}", what, g.to_string(),
           bf16_storage() ? " on bf16 tensors" : "", cudnnGetErrorString(search));
    std::string found;
    if (search == CUDNN_STATUS_SUCCESS) {
      const Perf* fastest = nullptr;
      const Perf* deterministic = nullptr;
      for (int i = 0; i < returned; ++i) {
        const Perf& candidate = perf[static_cast<std::size_t>(i)];
        if (candidate.status != CUDNN_STATUS_SUCCESS || candidate.memory > options_.workspace_limit) continue;
        if (!tensor_cores_allowed(g) && tensor_op(candidate.mathType)) continue;
        if (g.precision == Precision::BF16 && !exact_on_bf16(candidate)) continue;
        if (!fastest) fastest = &candidate;
        if (!deterministic && candidate.determinism == CUDNN_DETERMINISTIC) deterministic = &candidate;
      }
      if (fastest) {
        if (bf16_storage() && deterministic && deterministic->time <= kDeterministicSlack * fastest->time)
          return deterministic;
        return fastest;
      }
      for (int i = 0; i < returned; ++i) {
        const Perf& c = perf[static_cast<std::size_t>(i)];
        found += fmt::format("{}algorithm {} ({}, {}, {} KiB)", i ? "; " : " (found: ", static_cast<int>(c.algo),
                             cudnnGetErrorString(c.status), math_name(c.mathType), c.memory / 1024);
      }
      if (returned > 0) found += ")";
    } else {
      found = fmt::format(" (the search: {})", cudnnGetErrorString(search));
    }
    const std::string problem = fmt::format(
        "cuDNN found no usable {} algorithm for the convolution {}{}{}", what, g.to_string(),
        bf16_storage()                   ? " on bf16 tensors (GEMM-type algorithms only)"
        : g.precision == Precision::BF16 ? " with bf16 operands (GEMM-type algorithms only)"
        : tensor_cores_allowed(g)        ? ""
                                         : " in strict fp32",
        found);
    if (required) fail("{}", problem);
    log_.push_back(problem + "; it runs as Bf16Convolutions::Exact");
    ++none_usable_;
    return nullptr;
  }

  /// With tensor cores allowed, an algorithm runs with the math type it was measured with (as
  /// PyTorch does); in strict fp32 the descriptor keeps FMA math whatever Find reports (it reports
  /// algorithms without tensor-op kernels as DEFAULT math, which would allow TF32 elsewhere).
  void use_math(const ConvDescriptor& conv, cudnnMathType_t measured, const ConvolutionGeometry& g) {
    if (tensor_cores_allowed(g)) check(cudnnSetConvolutionMathType(conv.get(), measured), "cudnnSetConvolutionMathType");
  }

  static cudnnMathType_t math_of(const ConvDescriptor& conv) {
    cudnnMathType_t math = CUDNN_DEFAULT_MATH;
    check(cudnnGetConvolutionMathType(conv.get(), &math), "cudnnGetConvolutionMathType");
    return math;
  }

  static const char* math_name(cudnnMathType_t math) {
    switch (math) {
      case CUDNN_DEFAULT_MATH: return "CUDNN_DEFAULT_MATH";
      case CUDNN_TENSOR_OP_MATH: return "CUDNN_TENSOR_OP_MATH (tensor-op)";
      case CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION: return "CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION (tensor-op)";
      case CUDNN_FMA_MATH: return "CUDNN_FMA_MATH (strict fp32)";
    }
    return "unknown math";
  }

  void record(const char* what, const ConvolutionGeometry& g, int algorithm, std::size_t workspace, float ms,
              cudnnMathType_t math, bool deterministic) {
    log_.push_back(fmt::format("convolution {} {}{}: cuDNN algorithm {} ({}, {}), workspace {} KiB, {:.3f} ms", what,
                               g.to_string(), bf16_storage() ? " on bf16 tensors" : "", algorithm, math_name(math),
                               deterministic ? "deterministic" : "not deterministic", workspace / 1024, ms));
  }

  cudnnHandle_t handle_;
  CudaBackendOptions options_;
  std::vector<std::string>& log_;
  cudnnDataType_t storage_;
  int none_usable_ = 0;  ///< (geometry, direction) searches that found nothing usable
  std::map<ConvolutionGeometry, std::unique_ptr<ConvolutionPlan>> plans_;
};

/// The output's elements per sample and channel.
std::int64_t output_inner(const ConvolutionGeometry& g) {
  std::int64_t inner = 1;
  for (auto e : g.output_size) inner *= e;
  return inner;
}

/// Convolutions on fp32 tensors: fp32, and bf16 operands already rounded (with_bf16_operands:
/// Bf16Convolutions::Exact).
class CudnnConvolution final : public ConvolutionKernels {
 public:
  CudnnConvolution(cudnnHandle_t handle, const CudaBackendOptions& options, std::vector<std::string>& log)
      : core_(handle, options, log, CUDNN_DATA_FLOAT) {}

  // The bias-and-activation pass (cuda_kernels::finish_output) computes it as the layer does.
  bool fuses_leaky_relu(float) const override { return true; }

  void forward(const ConvolutionGeometry& g, const float* input, const float* weights, const float* bias,
               float* output) override {
    const ConvolutionGeometry plain = g.without_activation();  // plans are the convolution's
    core_.forward(plain, input, weights, output, true);
    if (g.leaky_relu)
      cuda_kernels::finish_output(output, g.bias ? bias : nullptr, g.batch, g.out_channels, output_inner(g), true,
                                  g.leaky_slope);
    else if (g.bias)
      core_.add_bias(plain, bias, output);
  }
  void backward_data(const ConvolutionGeometry& g, const float* grad_output, const float* weights,
                     float* grad_input) override {
    core_.backward_data(g, grad_output, weights, grad_input, true);
  }
  void backward_weights(const ConvolutionGeometry& g, const float* input, const float* grad_output,
                        float* grad_weights, float* grad_bias) override {
    core_.backward_filter(g, input, grad_output, grad_weights, true);
    if (g.bias) core_.bias_gradient(g, grad_output, grad_bias);
  }

 private:
  CudnnConvolutionCore core_;
};

/// A bf16 buffer on the GPU, kept between calls and grown as needed.
class Bf16Buffer {
 public:
  Bf16Buffer() = default;
  ~Bf16Buffer() { release(); }
  Bf16Buffer(const Bf16Buffer&) = delete;
  Bf16Buffer& operator=(const Bf16Buffer&) = delete;

  std::uint16_t* get(std::int64_t count) {
    const std::size_t bytes = static_cast<std::size_t>(count) * sizeof(std::uint16_t);
    if (bytes > bytes_) {
      release();
      pointer_ = cuda::allocate(bytes);
      bytes_ = bytes;
    }
    return static_cast<std::uint16_t*>(pointer_);
  }
  /// `values` rounded to bf16 (the host's rounding) into this buffer.
  const std::uint16_t* round(const float* values, std::int64_t count) {
    std::uint16_t* stored = get(count);
    cuda_kernels::to_bf16(values, stored, count);
    return stored;
  }
  void release() {
    cuda::release(pointer_);  // stream-ordered: work queued before reads it first
    pointer_ = nullptr;
    bytes_ = 0;
  }
  std::size_t bytes() const { return bytes_; }

 private:
  void* pointer_ = nullptr;
  std::size_t bytes_ = 0;
};

/// Bf16Convolutions::Native: Precision::BF16 convolutions on bf16 tensors (cuDNN's bf16
/// configuration, bf16 tensor cores, fp32 sums), the operands rounded to bf16 as the host rounds
/// them, the results widened to fp32 (exact: they are bf16 values). Three buffers, kept between
/// calls: one input-sized (the input, or its gradient), one output-sized (the output, or its
/// gradient) and one weights-sized (the weights, or their gradient); each call uses each buffer
/// for one value at a time. fp32 convolutions, and directions of a geometry cuDNN cannot run on
/// bf16 tensors, go to `exact` (with_bf16_operands over CudnnConvolution).
class NativeBf16Convolution final : public ConvolutionKernels {
 public:
  NativeBf16Convolution(cudnnHandle_t handle, const CudaBackendOptions& options, std::vector<std::string>& log,
                        std::unique_ptr<ConvolutionKernels> exact)
      : core_(handle, options, log, CUDNN_DATA_BFLOAT16), exact_(std::move(exact)) {}

  bool fuses_leaky_relu(float) const override { return true; }

  void forward(const ConvolutionGeometry& g, const float* input, const float* weights, const float* bias,
               float* output) override {
    const ConvolutionGeometry plain = g.without_activation();  // plans are the convolution's
    if (!on_bf16(plain, Direction::Forward)) return exact_->forward(g, input, weights, bias, output);
    const std::uint16_t* x = input_.round(input, g.input_elements());
    const std::uint16_t* w = weights_.round(weights, g.weight_elements());
    std::uint16_t* y = output_.get(g.output_elements());
    if (!core_.forward(plain, x, w, y, false)) return exact_->forward(g, input, weights, bias, output);
    if (g.bias || g.leaky_relu)
      cuda_kernels::from_bf16_finish(y, g.bias ? bias : nullptr, output, g.batch, g.out_channels, output_inner(g),
                                     g.leaky_relu, g.leaky_slope);
    else
      cuda_kernels::from_bf16(y, output, g.output_elements());
  }

  void backward_data(const ConvolutionGeometry& g, const float* grad_output, const float* weights,
                     float* grad_input) override {
    if (!on_bf16(g, Direction::Data) ||
        !data_on_bf16(g, output_.round(grad_output, g.output_elements()), weights, grad_input))
      exact_->backward_data(g, grad_output, weights, grad_input);
  }

  void backward_weights(const ConvolutionGeometry& g, const float* input, const float* grad_output,
                        float* grad_weights, float* grad_bias) override {
    if (!on_bf16(g, Direction::Filter) ||
        !filter_on_bf16(g, input, output_.round(grad_output, g.output_elements()), grad_weights, grad_bias))
      exact_->backward_weights(g, input, grad_output, grad_weights, grad_bias);
  }

  /// The output gradient rounded once for both directions.
  void backward(const ConvolutionGeometry& g, const float* input, const float* grad_output, const float* weights,
                float* grad_input, float* grad_weights, float* grad_bias) override {
    const bool data = grad_input && on_bf16(g, Direction::Data), filter = on_bf16(g, Direction::Filter);
    if (!data && !filter) return exact_->backward(g, input, grad_output, weights, grad_input, grad_weights, grad_bias);
    const std::uint16_t* dy = output_.round(grad_output, g.output_elements());
    if (grad_input && !(data && data_on_bf16(g, dy, weights, grad_input)))
      exact_->backward_data(g, grad_output, weights, grad_input);
    if (!(filter && filter_on_bf16(g, input, dy, grad_weights, grad_bias)))
      exact_->backward_weights(g, input, grad_output, grad_weights, grad_bias);
  }

  std::int64_t scratch_bytes() const override {
    return static_cast<std::int64_t>(input_.bytes() + output_.bytes() + weights_.bytes()) + exact_->scratch_bytes();
  }
  /// The (geometry, direction) pairs cuDNN could not run on bf16 tensors: they run exact.
  int exact_directions() const { return core_.none_usable(); }
  void release_scratch() override {
    input_.release();
    output_.release();
    weights_.release();
    exact_->release_scratch();
  }

 private:
  using Direction = CudnnConvolutionCore::Direction;

  /// Whether a direction of `g` runs here: bf16, and not known to lack a cuDNN algorithm (then
  /// its operands are not converted at all).
  bool on_bf16(const ConvolutionGeometry& g, Direction direction) {
    return g.precision == Precision::BF16 && core_.may_run(g, direction);
  }

  /// grad_input from dy (bf16, in output_); the input buffer holds the bf16 result.
  bool data_on_bf16(const ConvolutionGeometry& g, const std::uint16_t* dy, const float* weights, float* grad_input) {
    const std::uint16_t* w = weights_.round(weights, g.weight_elements());
    std::uint16_t* dx = input_.get(g.input_elements());
    if (!core_.backward_data(g, dy, w, dx, false)) return false;
    cuda_kernels::from_bf16(dx, grad_input, g.input_elements());
    return true;
  }

  /// grad_weights from the input and dy (bf16, in output_); the weights buffer holds the bf16
  /// result. The bias gradient is the sum of the rounded output gradient, as on the host.
  bool filter_on_bf16(const ConvolutionGeometry& g, const float* input, const std::uint16_t* dy, float* grad_weights,
                      float* grad_bias) {
    const std::uint16_t* x = input_.round(input, g.input_elements());
    std::uint16_t* dw = weights_.get(g.weight_elements());
    if (!core_.backward_filter(g, x, dy, dw, false)) return false;
    cuda_kernels::from_bf16(dw, grad_weights, g.weight_elements());
    if (g.bias) cuda_kernels::bf16_channel_sums(dy, g.batch, g.out_channels, output_inner(g), grad_bias);
    return true;
  }


  CudnnConvolutionCore core_;
  std::unique_ptr<ConvolutionKernels> exact_;
  Bf16Buffer input_, output_, weights_;
};

/// The CUDA kernels pool into dense outputs only (PoolingGeometry::output_within: host kernels).
PoolBox dense_pool_box(const PoolingGeometry& g) {
  const PoolBox box = pool_box(g);
  TESSERA_CHECK(box.dense_output(), "pooling on a GPU into a larger tensor (output_within): the CUDA kernels "
                "write dense outputs only (executor bug)");
  return box;
}

class CudaPooling final : public PoolingKernels {
 public:
  std::size_t workspace_bytes(const PoolingGeometry& g) override { return pooling_workspace_bytes(g); }
  void forward(const PoolingGeometry& g, const float* input, float* output, void* workspace) override {
    const PoolBox box = dense_pool_box(g);
    if (g.mode == PoolingMode::Max)
      cuda_kernels::max_pool_forward(box, input, output, static_cast<std::int32_t*>(workspace));
    else
      cuda_kernels::average_pool_forward(box, input, output);
  }
  void max_backward_through_leaky_relu(const PoolingGeometry& g, const float* grad_output, const void* workspace,
                                       const float* output, float slope, float* grad_input) override {
    cuda_kernels::max_pool_backward_leaky_relu(dense_pool_box(g), grad_output, static_cast<const std::int32_t*>(workspace),
                                               output, slope, grad_input);
  }

  void backward(const PoolingGeometry& g, const float* grad_output, const void* workspace, float* grad_input) override {
    const PoolBox box = dense_pool_box(g);
    if (g.mode == PoolingMode::Max)
      cuda_kernels::max_pool_backward(box, grad_output, static_cast<const std::int32_t*>(workspace), grad_input);
    else
      cuda_kernels::average_pool_backward(box, grad_output, grad_input);
  }
};

/// Row-major linear layers as column-major cuBLAS GEMMs (a row-major R x C buffer is a
/// column-major C x R one):
///   forward          Y^T[O,N]  = W^T-as-stored[I,O]^T * X^T[I,N]
///   backward data    dX^T[I,N] = W-as-stored[I,O] * dY^T[O,N]
///   backward weights dW[I,O]   = X^T[I,N] * dY^T[O,N]^T
class CublasLinear final : public LinearKernels {
 public:
  explicit CublasLinear(cublasHandle_t handle) : handle_(handle) {}

  void forward(const LinearGeometry& g, const float* input, const float* weights, const float* bias,
               float* output) override {
    const int n = static_cast<int>(g.batch), in = static_cast<int>(g.in_features), out = static_cast<int>(g.out_features);
    gemm(g, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, weights, in, input, in, output, out, "linear forward");
    if (g.bias) cuda_kernels::add_row_bias(output, bias, g.batch, g.out_features);
  }
  void backward_data(const LinearGeometry& g, const float* grad_output, const float* weights,
                     float* grad_input) override {
    const int n = static_cast<int>(g.batch), in = static_cast<int>(g.in_features), out = static_cast<int>(g.out_features);
    gemm(g, CUBLAS_OP_N, CUBLAS_OP_N, in, n, out, weights, in, grad_output, out, grad_input, in,
         "linear backward data");
  }
  void backward_weights(const LinearGeometry& g, const float* input, const float* grad_output, float* grad_weights,
                        float* grad_bias) override {
    const int n = static_cast<int>(g.batch), in = static_cast<int>(g.in_features), out = static_cast<int>(g.out_features);
    gemm(g, CUBLAS_OP_N, CUBLAS_OP_T, in, out, n, input, in, grad_output, out, grad_weights, in,
         "linear backward weights");
    if (g.bias) cuda_kernels::row_bias_gradient(grad_output, grad_bias, g.batch, g.out_features);
  }

 private:
  /// C = op(A) * op(B), column-major fp32; the handle's math for fp32; for bf16 operands (already
  /// bf16 values, so cuBLAS's conversion to bf16 is exact) bf16 tensor cores with fp32 sums.
  void gemm(const LinearGeometry& g, cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k, const float* a,
            int lda, const float* b, int ldb, float* c, int ldc, const char* what) {
    const float one = 1.0f, zero = 0.0f;
    if (g.precision == Precision::F32) {
      check(cublasSgemm(handle_, op_a, op_b, m, n, k, &one, a, lda, b, ldb, &zero, c, ldc), what);
      return;
    }
    check(cublasGemmEx(handle_, op_a, op_b, m, n, k, &one, a, CUDA_R_32F, lda, b, CUDA_R_32F, ldb, &zero, c, CUDA_R_32F,
                       ldc, CUBLAS_COMPUTE_32F_FAST_16BF, CUBLAS_GEMM_DEFAULT),
          what);
  }

  cublasHandle_t handle_;
};

template <typename T>
std::size_t bytes(std::int64_t count) {
  return static_cast<std::size_t>(count) * sizeof(T);
}

class CudaElementwise final : public ElementwiseKernels {
 public:
  void leaky_relu_forward(const float* x, float* y, std::int64_t count, float slope) override {
    cuda_kernels::leaky_relu_forward(x, y, count, slope);
  }
  void leaky_relu_backward(const float* x, const float* dy, float* dx, std::int64_t count, float slope) override {
    cuda_kernels::leaky_relu_backward(x, dy, dx, count, slope);
  }
  double squared_error(const float* prediction, const float* target, std::int64_t count, double weight, double scale,
                       float* grad) override {
    Workspace sum(sizeof(double));
    cuda_kernels::squared_error(prediction, target, count, weight, scale, static_cast<double*>(sum.get()), grad);
    double value = 0;
    cuda::copy(&value, sum.get(), sizeof(double));  // waits for the kernel
    return value;
  }
  double softmax_cross_entropy(const float* scores, const float* labels, std::int64_t rows, std::int64_t classes,
                               double scale, float* grad) override {
    Workspace per_row(static_cast<std::size_t>(rows) * sizeof(double));
    cuda_kernels::softmax_cross_entropy(scores, labels, rows, classes, scale, static_cast<double*>(per_row.get()), grad);
    return sum_in_row_order(per_row, rows);
  }
  std::int64_t count_correct(const float* scores, const float* labels, std::int64_t rows,
                             std::int64_t classes) override {
    Workspace per_row(static_cast<std::size_t>(rows) * sizeof(double));
    cuda_kernels::count_correct(scores, labels, rows, classes, static_cast<double*>(per_row.get()));
    return static_cast<std::int64_t>(sum_in_row_order(per_row, rows));
  }
  void accumulate(const float* x, float* y, std::int64_t count) override { cuda_kernels::accumulate(x, y, count); }
  void dropout_scales(const DropoutMask& mask, float* scales, std::int64_t count) override {
    cuda_kernels::dropout_scales(mask, scales, count);
  }
  void round_to_bf16(const float* x, float* y, std::int64_t count) override {
    if (count > 0) cuda_kernels::round_to_bf16(x, y, count);
  }
  void to_bf16(const float* x, std::uint16_t* y, std::int64_t count) override {
    if (count > 0) cuda_kernels::to_bf16(x, y, count);
  }
  void from_bf16(const std::uint16_t* x, float* y, std::int64_t count) override {
    if (count > 0) cuda_kernels::from_bf16(x, y, count);
  }
  void multiply(const float* a, const float* b, float* y, std::int64_t count) override {
    if (count > 0) cuda_kernels::multiply(a, b, y, count);
  }
  void copy_rows(const float* source, std::int64_t source_stride, float* destination, std::int64_t destination_stride,
                 std::int64_t rows, std::int64_t length) override {
    if (rows == 0 || length == 0) return;
    const cudaError_t status = cudaMemcpy2DAsync(
        destination, static_cast<std::size_t>(destination_stride) * sizeof(float), source,
        static_cast<std::size_t>(source_stride) * sizeof(float), static_cast<std::size_t>(length) * sizeof(float),
        static_cast<std::size_t>(rows), cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(cuda::stream()));
    if (status != cudaSuccess) fail("CUDA: cudaMemcpy2DAsync failed: {}", cudaGetErrorString(status));
  }
  void sgd_update(float* p, const float* g, float* momentum_buffer, std::int64_t count, const SgdStep& step) override {
    if (count > 0) cuda_kernels::sgd_update(p, g, momentum_buffer, count, step);
  }
  void adam_update(float* p, const float* g, float* m, float* v, std::int64_t count, const AdamStep& step) override {
    if (count > 0) cuda_kernels::adam_update(p, g, m, v, count, step);
  }

  // Batch norm: the per-channel arrays go to and from the device around the kernels (a few KiB).
  void batch_norm_statistics(const float* x, std::int64_t batch, std::int64_t channels, std::int64_t inner,
                             double* sums) override {
    const Workspace device_sums(bytes<double>(2 * channels));
    cuda_kernels::channel_sums(x, nullptr, nullptr, nullptr, batch, channels, inner,
                               static_cast<double*>(device_sums.get()));
    cuda::copy(sums, device_sums.get(), device_sums.bytes());  // waits for the kernel
  }
  void batch_norm_normalize(const float* x, float* y, std::int64_t batch, std::int64_t channels, std::int64_t inner,
                            const float* scale, const float* shift) override {
    const std::int64_t count = batch * channels * inner;
    if (count == 0) return;
    std::vector<float> host(static_cast<std::size_t>(2 * channels));  // one copy (each one waits)
    std::copy(scale, scale + channels, host.begin());
    std::copy(shift, shift + channels, host.begin() + channels);
    const Workspace factors(bytes<float>(2 * channels));
    auto* device_factors = static_cast<float*>(factors.get());
    cuda::copy(device_factors, host.data(), factors.bytes());
    cuda_kernels::batch_norm_normalize(x, y, count, channels, inner, device_factors, device_factors + channels);
  }
  void batch_norm_backward_sums(const float* x, const float* dy, std::int64_t batch, std::int64_t channels,
                                std::int64_t inner, const double* mean, const double* inverse_std,
                                double* sums) override {
    std::vector<double> host(static_cast<std::size_t>(2 * channels));
    std::copy(mean, mean + channels, host.begin());
    std::copy(inverse_std, inverse_std + channels, host.begin() + channels);
    const Workspace statistics(bytes<double>(2 * channels)), device_sums(bytes<double>(2 * channels));
    auto* device_statistics = static_cast<double*>(statistics.get());
    cuda::copy(device_statistics, host.data(), statistics.bytes());
    cuda_kernels::channel_sums(x, dy, device_statistics, device_statistics + channels, batch, channels, inner,
                               static_cast<double*>(device_sums.get()));
    cuda::copy(sums, device_sums.get(), device_sums.bytes());  // waits for the kernel
  }
  void batch_norm_backward(const float* x, const float* dy, float* dx, std::int64_t batch, std::int64_t channels,
                           std::int64_t inner, const double* scale, const double* mean, const double* inverse_std,
                           const double* mean_dy, const double* mean_dy_xhat) override {
    const std::int64_t count = batch * channels * inner;
    if (count == 0) return;
    std::vector<double> host(static_cast<std::size_t>(5 * channels), 0.0);
    const double* sources[] = {scale, mean, inverse_std, mean_dy, mean_dy_xhat};
    for (std::int64_t k = 0; k < 5; ++k)
      if (sources[k]) std::copy(sources[k], sources[k] + channels, host.begin() + k * channels);
    const Workspace arrays(bytes<double>(5 * channels));
    auto* device = static_cast<double*>(arrays.get());
    cuda::copy(device, host.data(), arrays.bytes());  // one copy (each one waits)
    cuda_kernels::batch_norm_backward(x, dy, dx, count, channels, inner, device, device + channels,
                                      device + 2 * channels, mean_dy ? device + 3 * channels : nullptr,
                                      device + 4 * channels);
  }

 private:
  /// The rows' values summed on the host in row order (as the host kernels do, one row at a time).
  static double sum_in_row_order(const Workspace& per_row, std::int64_t rows) {
    std::vector<double> values(static_cast<std::size_t>(rows));
    cuda::copy(values.data(), per_row.get(), values.size() * sizeof(double));  // waits for the kernel
    double total = 0;
    for (double v : values) total += v;
    return total;
  }
};

class CudaBackend final : public DnnBackend {
 public:
  explicit CudaBackend(const CudaBackendOptions& options) {
    const int device = cuda::current_device();
    auto* stream = static_cast<cudaStream_t>(cuda::stream());
    check(cudnnCreate(&cudnn_), "cudnnCreate");
    check(cudnnSetStream(cudnn_, stream), "cudnnSetStream");
    check(cublasCreate(&cublas_), "cublasCreate");
    check(cublasSetStream(cublas_, stream), "cublasSetStream");
    check(cublasSetMathMode(cublas_, options.allow_tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH),
          "cublasSetMathMode");
    const Device gpu = Device::cuda(device);
    // bf16 tensor cores, and cuDNN's bf16 configuration, need compute capability 8.0 (A100) or newer.
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      cudaGetLastError();
      major = 0;
    }
    const bool native = options.bf16_convolutions == Bf16Convolutions::Native && major >= 8;
    // 0: a sixteenth of the GPU's memory, at least 1 GiB (3-D convolutions' fastest algorithms may
    // need GiBs).
    CudaBackendOptions chosen = options;
    if (chosen.workspace_limit == 0)
      chosen.workspace_limit = std::max(std::size_t{1} << 30, cuda::device_memory_bytes(device) / 16);
    auto exact = with_bf16_operands(std::make_unique<CudnnConvolution>(cudnn_, chosen, log_), elementwise_, gpu);
    if (native) {
      auto on_bf16 = std::make_unique<NativeBf16Convolution>(cudnn_, chosen, log_, std::move(exact));
      native_ = on_bf16.get();
      convolution_ = std::move(on_bf16);
    } else {
      convolution_ = std::move(exact);
    }
    linear_ = with_bf16_operands(std::make_unique<CublasLinear>(cublas_), elementwise_, gpu);
    log_.push_back(fmt::format("device {}: {}; cuDNN {}, cuBLAS; fp32: {}; convolution workspace up to {} MiB; "
                               "bf16 convolutions: {}",
                               device, cuda::describe_device(device), cudnnGetVersion(),
                               options.allow_tf32 ? "TF32 allowed" : "strict",
                               chosen.workspace_limit >> 20,
                               native ? "native (bf16 tensors and results)"
                               : options.bf16_convolutions == Bf16Convolutions::Native
                                   ? "exact (fp32 results; native needs compute capability 8.0)"
                                   : "exact (fp32 results, TF32 tensor cores)"));
  }
  ~CudaBackend() override {
    convolution_.reset();
    linear_.reset();
    cublasDestroy(cublas_);
    cudnnDestroy(cudnn_);
  }

  std::string name() const override { return "cuda"; }
  ConvolutionKernels& convolution() override { return *convolution_; }
  PoolingKernels& pooling() override { return pooling_; }
  LinearKernels& linear() override { return *linear_; }
  ElementwiseKernels& elementwise() override { return elementwise_; }
  std::vector<std::string> implementations() const override { return log_; }
  std::string bf16_convolutions() const override {
    if (!native_) return "exact";
    const int exact = native_->exact_directions();
    return exact == 0 ? "native" : fmt::format("native, {} exact", exact);
  }

 private:
  cudnnHandle_t cudnn_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  /// The convolutions when they run bf16 on bf16 tensors (Bf16Convolutions::Native, compute
  /// capability 8.0 and newer); null when exact.
  const NativeBf16Convolution* native_ = nullptr;
  std::vector<std::string> log_;
  CudaElementwise elementwise_;  // before the kernels that round with it
  std::unique_ptr<ConvolutionKernels> convolution_;
  CudaPooling pooling_;
  std::unique_ptr<LinearKernels> linear_;
};

}  // namespace

ElementwiseKernels& cuda_elementwise(int device) {
  cuda::set_device(device);
  static CudaElementwise kernels;  // stateless: its kernels run on the current device's stream
  return kernels;
}

std::unique_ptr<DnnBackend> make_cuda_backend(const CudaBackendOptions& options) {
  TESSERA_CHECK(cuda::device_count() > 0, "the CUDA backend needs a GPU, but {}", cuda::unavailable_reason());
  return std::make_unique<CudaBackend>(options);
}

}  // namespace tessera
