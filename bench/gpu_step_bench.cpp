// One GPU, the MLPerf HPC CosmoFlow reference network, a training step on Tessera's CUDA
// kernels: cuDNN convolutions (algorithms searched once per shape), Tessera's pooling and
// element-wise kernels, cuBLAS linear layers, MSE, plain SGD. The same network, FLOP count and
// timing rule as bench/gpu_cosmoflow_torch.py (its peer), which bench/gpu_compare.py runs beside it:
//   input N x C x S^3 (default 4 x 4 x 128^3);
//   5 x [conv3d 3x3x3 (pad 1, bias), leaky ReLU 0.3, max-pool 2], base*2^i filters (32..512);
//   flatten, linear 128, leaky ReLU, linear 64, leaky ReLU, linear 4; MSE; SGD lr 1e-3.
// The step is composed here from the backend's kernels, as the executor runs them (each
// convolution applies its leaky ReLU in its bias pass; the pooling's backward applies the
// activation's): the kernels a GPU training step is made of, without the
// framework around them (bench_train --device cuda, which gpu_compare.py also runs, has that).
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>
#include <vector>

#include "layers/cuda_kernels.hpp"
#include "layers/pool_box.hpp"
#include "tessera/core/clock.hpp"
#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/layers/dnn_backend.hpp"
#include "tessera/tensor/tensor.hpp"

namespace tessera {
namespace {

constexpr int kBlocks = 5;
constexpr float kSlope = 0.3f;
constexpr std::int64_t kWidths[] = {128, 64, 4};

struct Options {
  std::int64_t size = 128, in_channels = 4, base_filters = 32, batch = 4;
  int steps = 20, warmup = 5, device = 0;
  bool tf32 = false, bf16 = false, bf16_exact = false, matmul = false, verbose = false;
  std::string json;
};

Tensor uniform(std::int64_t count, float bound, std::mt19937& generator, Device device) {
  Tensor host(Shape({count}));
  std::uniform_real_distribution<float> draw(-bound, bound);
  for (std::int64_t i = 0; i < count; ++i) host.data()[i] = draw(generator);
  return host.to(device);
}

/// A parameter and its gradient on the GPU.
struct Parameter {
  Tensor value, grad;
};

struct ConvBlock {
  ConvolutionGeometry conv;
  PoolingGeometry pool;
  Parameter weights, bias;
  ConvolutionGeometry fused;                  // conv with its leaky ReLU
  Tensor input, act_out, pool_out, argmax;    // forward activations
  Tensor grad_act, grad_input;                // backward buffers
};

struct LinearStage {
  LinearGeometry geometry;
  Parameter weights, bias;
  Tensor output, activated, grad_output, grad_activated, grad_input;
};

class CosmoFlowStep {
 public:
  CosmoFlowStep(const Options& options, DnnBackend& backend) : options_(options), backend_(backend) {
    const Device gpu = Device::cuda(options.device);
    std::mt19937 generator(0);
    std::int64_t channels = options.in_channels, side = options.size;
    input_ = uniform(options.batch * channels * side * side * side, 1.0f, generator, gpu);
    for (int b = 0; b < kBlocks; ++b) {
      ConvBlock block;
      const std::int64_t filters = options.base_filters << b;
      block.conv.batch = options.batch;
      block.conv.in_channels = channels;
      block.conv.out_channels = filters;
      block.conv.input_size = block.conv.output_size = {side, side, side};
      block.conv.kernel = {3, 3, 3};
      block.conv.stride = block.conv.dilation = {1, 1, 1};
      block.conv.padding = {1, 1, 1};
      block.conv.precision = options.bf16 ? Precision::BF16 : Precision::F32;
      const float bound = 1.0f / std::sqrt(static_cast<float>(channels * 27));  // PyTorch's default bound
      block.weights = {uniform(filters * channels * 27, bound, generator, gpu), Tensor(Shape({filters * channels * 27}), gpu)};
      block.bias = {uniform(filters, bound, generator, gpu), Tensor(Shape({filters}), gpu)};
      const std::int64_t out_side = (side + 1) / 2;  // pooling rounds up, as the peer does
      block.pool.mode = PoolingMode::Max;
      block.pool.batch = options.batch;
      block.pool.channels = filters;
      block.pool.input_size = {side, side, side};
      block.pool.kernel = block.pool.stride = {2, 2, 2};
      block.pool.padding = {0, 0, 0};
      block.pool.output_size = {out_side, out_side, out_side};
      const std::int64_t conv_elements = options.batch * filters * side * side * side;
      block.fused = block.conv;
      block.fused.leaky_relu = true;
      block.fused.leaky_slope = kSlope;
      block.act_out = Tensor(Shape({conv_elements}), gpu);
      block.grad_act = Tensor(Shape({conv_elements}), gpu);
      block.pool_out = Tensor(Shape({options.batch * filters * out_side * out_side * out_side}), gpu);
      block.argmax = Tensor(Shape({static_cast<std::int64_t>(backend.pooling().workspace_bytes(block.pool) / 4 + 1)}), gpu);
      if (b > 0) block.grad_input = Tensor(Shape({options.batch * channels * side * side * side}), gpu);
      blocks_.push_back(std::move(block));
      channels = filters;
      side = out_side;
    }
    std::int64_t features = channels * side * side * side;
    for (std::int64_t width : kWidths) {
      LinearStage stage;
      stage.geometry = {options.batch, features, width, true};
      stage.geometry.precision = options.bf16 ? Precision::BF16 : Precision::F32;
      const float bound = 1.0f / std::sqrt(static_cast<float>(features));
      stage.weights = {uniform(width * features, bound, generator, gpu), Tensor(Shape({width * features}), gpu)};
      stage.bias = {uniform(width, bound, generator, gpu), Tensor(Shape({width}), gpu)};
      for (Tensor* t : {&stage.output, &stage.activated, &stage.grad_output, &stage.grad_activated})
        *t = Tensor(Shape({options.batch * width}), gpu);
      stage.grad_input = Tensor(Shape({options.batch * features}), gpu);
      linears_.push_back(std::move(stage));
      features = width;
    }
    target_ = uniform(options.batch * kWidths[2], 1.0f, generator, gpu);
  }

  /// Forward, loss, backward, update: queued on the GPU's stream; returns without waiting.
  void step() {
    auto& conv = backend_.convolution();
    auto& pool = backend_.pooling();
    auto& linear = backend_.linear();
    const Tensor* x = &input_;
    for (auto& b : blocks_) {
      b.input = *x;
      conv.forward(b.fused, x->data(), b.weights.value.data(), b.bias.value.data(), b.act_out.data());
      pool.forward(b.pool, b.act_out.data(), b.pool_out.data(), b.argmax.data());
      x = &b.pool_out;
    }
    for (std::size_t i = 0; i < linears_.size(); ++i) {
      auto& s = linears_[i];
      linear.forward(s.geometry, x->data(), s.weights.value.data(), s.bias.value.data(), s.output.data());
      const bool last = i + 1 == linears_.size();
      if (!last) cuda_kernels::leaky_relu_forward(s.output.data(), s.activated.data(), s.output.numel(), kSlope);
      x = last ? &s.output : &s.activated;
    }
    cuda_kernels::squared_error(x->data(), target_.data(), x->numel(), 1.0 / static_cast<double>(x->numel()), 1.0,
                                loss_.data(), linears_.back().grad_output.data());
    for (std::size_t i = linears_.size(); i-- > 0;) {
      auto& s = linears_[i];
      if (i + 1 < linears_.size())
        cuda_kernels::leaky_relu_backward(s.output.data(), s.grad_activated.data(), s.grad_output.data(),
                                          s.output.numel(), kSlope);
      const float* input = i == 0 ? blocks_.back().pool_out.data() : linears_[i - 1].activated.data();
      linear.backward_weights(s.geometry, input, s.grad_output.data(), s.weights.grad.data(), s.bias.grad.data());
      float* grad_input = i == 0 ? s.grad_input.data() : linears_[i - 1].grad_activated.data();
      linear.backward_data(s.geometry, s.grad_output.data(), s.weights.value.data(), grad_input);
    }
    const float* grad = linears_.front().grad_input.data();
    for (std::size_t i = blocks_.size(); i-- > 0;) {
      auto& b = blocks_[i];
      pool.max_backward_through_leaky_relu(b.pool, grad, b.argmax.data(), b.pool_out.data(), kSlope,
                                           b.grad_act.data());
      conv.backward(b.conv, b.input.data(), b.grad_act.data(), b.weights.value.data(),
                    i == 0 ? nullptr : b.grad_input.data(), b.weights.grad.data(), b.bias.grad.data());
      grad = b.grad_input.data();
    }
    SgdStep sgd;
    sgd.lr = 1e-3f;
    for (auto* p : parameters()) cuda_kernels::sgd_update(p->value.data(), p->grad.data(), nullptr, p->value.numel(), sgd);
  }

  double loss() const {
    double value = 0;
    cuda::copy(&value, loss_.get(), sizeof(double));
    return value;
  }

  /// The same analytic count as the peer's step_flops().
  double flops() const {
    double total = 0;
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      const auto& g = blocks_[i].conv;
      const double forward = 2.0 * static_cast<double>(g.batch * g.out_channels * g.in_channels * 27) *
                             static_cast<double>(g.input_size[0] * g.input_size[1] * g.input_size[2]);
      total += forward + (i == 0 ? forward : 2 * forward);
    }
    for (const auto& s : linears_)
      total += 6.0 * static_cast<double>(s.geometry.batch * s.geometry.in_features * s.geometry.out_features);
    return total;
  }

 private:
  std::vector<Parameter*> parameters() {
    std::vector<Parameter*> all;
    for (auto& b : blocks_) all.insert(all.end(), {&b.weights, &b.bias});
    for (auto& s : linears_) all.insert(all.end(), {&s.weights, &s.bias});
    return all;
  }

  Options options_;
  DnnBackend& backend_;
  Tensor input_, target_;
  /// The loss (one double) on the GPU.
  struct DeviceDouble {
    DeviceDouble() : pointer(static_cast<double*>(cuda::allocate(sizeof(double)))) {}
    ~DeviceDouble() { cuda::release(pointer); }
    DeviceDouble(const DeviceDouble&) = delete;
    DeviceDouble& operator=(const DeviceDouble&) = delete;
    double* data() const { return pointer; }
    double* get() const { return pointer; }
    double* pointer;
  } loss_;
  std::vector<ConvBlock> blocks_;
  std::vector<LinearStage> linears_;
};

/// FLOP/s of an n^3 GEMM through the backend's linear kernels (cuBLAS; in bf16 with the operands'
/// conversions, O(n^2) beside the GEMM's O(n^3)).
double matmul_rate(DnnBackend& backend, std::int64_t n, Precision precision) {
  const Device gpu = Device::cuda(cuda::current_device());
  std::mt19937 generator(1);
  const Tensor a = uniform(n * n, 1.0f, generator, gpu), b = uniform(n * n, 1.0f, generator, gpu);
  Tensor c(Shape({n * n}), gpu);
  LinearGeometry g{n, n, n, false};
  g.precision = precision;
  for (int i = 0; i < 3; ++i) backend.linear().forward(g, a.data(), b.data(), nullptr, c.data());
  cuda::synchronize();
  const auto start = Clock::now();
  constexpr int kRepeats = 10;
  for (int i = 0; i < kRepeats; ++i) backend.linear().forward(g, a.data(), b.data(), nullptr, c.data());
  cuda::synchronize();
  return 2.0 * static_cast<double>(n * n * n) * kRepeats / seconds_since(start);
}

int run(const Options& options) {
  if (cuda::device_count() == 0) {
    fmt::print(stderr, "gpu_step_bench: no GPU: {}\n", cuda::unavailable_reason());
    return 2;
  }
  cuda::set_device(options.device);
  CudaBackendOptions backend_options;
  backend_options.allow_tf32 = options.tf32;
  backend_options.bf16_convolutions = options.bf16_exact ? Bf16Convolutions::Exact : Bf16Convolutions::Native;
  auto backend = make_cuda_backend(backend_options);
  const std::string precision = options.bf16 ? (options.bf16_exact ? "bf16-exact" : "bf16") : options.tf32 ? "tf32" : "fp32";
  fmt::print("Tessera GPU step: {}\n", cuda::describe_device(options.device));
  fmt::print("input {} x {} x {}^3, base filters {}, {} (the step composed from Tessera's CUDA kernels, without\n"
             "the executor: bench_train --device cuda runs the executor)\n",
             options.batch, options.in_channels, options.size, options.base_filters,
             !options.bf16        ? (options.tf32 ? "TF32 allowed" : "strict fp32")
             : options.bf16_exact ? "bf16 operands, convolutions on TF32 tensor cores with fp32 results"
                                  : "bf16: convolutions on bf16 tensors (bf16 results), GEMMs on bf16 tensor cores");

  CosmoFlowStep step(options, *backend);
  const auto warm_start = Clock::now();
  for (int i = 0; i < options.warmup; ++i) step.step();
  cuda::synchronize();
  const double warmup_s = seconds_since(warm_start);
  const double first_loss = step.loss();
  // Each step timed on its own (synchronised), and all together (one synchronisation: the
  // steady-state throughput, as the peer's CUDA events measure it).
  std::vector<double> per_step;
  for (int i = 0; i < options.steps; ++i) {
    const auto start = Clock::now();
    step.step();
    cuda::synchronize();
    per_step.push_back(seconds_since(start) * 1e3);
  }
  const auto start = Clock::now();
  for (int i = 0; i < options.steps; ++i) step.step();
  cuda::synchronize();
  const double mean_ms = seconds_since(start) * 1e3 / options.steps;
  const double last_loss = step.loss();
  std::sort(per_step.begin(), per_step.end());
  const double median_ms = per_step[per_step.size() / 2], min_ms = per_step.front();
  if (!std::isfinite(last_loss)) {
    fmt::print(stderr, "gpu_step_bench: the loss is {} after {} steps\n", last_loss, options.warmup + 2 * options.steps);
    return 3;
  }
  const double flops = step.flops();
  const auto stats = cuda::allocator_stats();
  fmt::print("step FLOPs {:.4g} (conv + linear, forward + backward); warm-up {} steps {:.2f} s (algorithm search)\n",
             flops, options.warmup, warmup_s);
  fmt::print("loss {:.6g} after warm-up -> {:.6g} after {} more steps\n", first_loss, last_loss, 2 * options.steps);
  fmt::print("{:<10} {:>5} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9}\n", "precision", "batch", "median ms", "min ms",
             "mean ms", "samples/s", "TFLOP/s", "peak GiB");
  fmt::print("{:<10} {:>5} {:>10.3f} {:>10.3f} {:>10.3f} {:>10.2f} {:>9.2f} {:>9.2f}\n", precision, options.batch,
             median_ms, min_ms, mean_ms, options.batch / (mean_ms * 1e-3), flops / (mean_ms * 1e-3) / 1e12,
             static_cast<double>(stats.peak_bytes_in_use) / (1ull << 30));
  nlohmann::json record = {{"record", "step"},          {"framework", "tessera"},
                           {"precision", precision},     {"batch", options.batch},
                           {"size", options.size},       {"in_channels", options.in_channels},
                           {"base_filters", options.base_filters},
                           {"median_ms", median_ms},     {"min_ms", min_ms},
                           {"mean_ms", mean_ms},         {"samples_per_s", options.batch / (mean_ms * 1e-3)},
                           {"step_flops", flops},        {"tflops", flops / (mean_ms * 1e-3) / 1e12},
                           {"peak_gib", static_cast<double>(stats.peak_bytes_in_use) / (1ull << 30)},
                           {"loss_first", first_loss},   {"loss_last", last_loss}};
  std::vector<nlohmann::json> records{record};
  if (options.matmul) {
    const double rate = matmul_rate(*backend, 8192, options.bf16 ? Precision::BF16 : Precision::F32) / 1e12;
    fmt::print("cuBLAS 8192^3 GEMM ({}): {:.2f} TFLOP/s; the step reaches {:.1f} % of it\n", precision, rate,
               100.0 * flops / (mean_ms * 1e-3) / 1e12 / rate);
    records.push_back({{"record", "matmul"}, {"framework", "tessera"}, {"precision", precision}, {"n", 8192},
                       {"tflops", rate}});
  }
  if (options.verbose)
    for (const auto& line : backend->implementations()) fmt::print("  {}\n", line);
  if (!options.json.empty()) {
    std::ofstream out(options.json, std::ios::app);
    for (const auto& r : records) out << r.dump() << "\n";
    TESSERA_CHECK(out.good(), "cannot write {}", options.json);
  }
  return 0;
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
  tessera::Options options;
  CLI::App app{"Training steps of the CosmoFlow reference network on one GPU with Tessera's CUDA kernels"};
  app.add_option("--size", options.size, "side of the cubic input")->check(CLI::PositiveNumber);
  app.add_option("--in-channels", options.in_channels, "input channels")->check(CLI::PositiveNumber);
  app.add_option("--base-filters", options.base_filters, "filters of the first conv (doubling per block)")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch", options.batch, "samples per step")->check(CLI::PositiveNumber);
  app.add_option("--steps", options.steps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", options.warmup, "untimed steps first (the algorithm search happens here)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--device", options.device, "GPU index");
  app.add_flag("--tf32", options.tf32, "let cuDNN and cuBLAS use TF32 tensor cores (default: strict fp32)");
  app.add_flag("--bf16", options.bf16,
               "bf16 (Precision::BF16): convolutions on bf16 tensors (cuDNN's bf16 configuration, bf16 results), "
               "GEMMs over bf16 operands on bf16 tensor cores, fp32 sums");
  app.add_flag("--bf16-exact", options.bf16_exact,
               "with --bf16: convolutions over the bf16-rounded operands on TF32 tensor cores, fp32 results "
               "(Bf16Convolutions::Exact)");
  app.add_flag("--matmul", options.matmul, "also measure an 8192^3 cuBLAS GEMM at the same precision");
  app.add_flag("--verbose", options.verbose, "print the algorithm chosen for every kernel");
  app.add_option("--json", options.json, "append the results as JSON lines to this file");
  CLI11_PARSE(app, argc, argv);
  if (options.bf16_exact && !options.bf16) {
    fmt::print(stderr, "gpu_step_bench: --bf16-exact goes with --bf16\n");
    return 2;
  }
  try {
    return tessera::run(options);
  } catch (const std::exception& error) {
    fmt::print(stderr, "gpu_step_bench: {}\n", error.what());
    return 1;
  }
}
