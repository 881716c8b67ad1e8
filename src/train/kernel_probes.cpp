#include "tessera/train/kernel_probes.hpp"

#include <fmt/format.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <thread>
#include <utility>

#include "tessera/core/clock.hpp"
#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/layers/options.hpp"
#include "tessera/parallel/calibration.hpp"
#include "tessera/tensor/box.hpp"

namespace tessera {
namespace {

std::unique_ptr<Layer> simple_layer(const std::string& type, const std::map<std::string, std::string>& options) {
  LayerOptions layer_options("calibration layer (" + type + ")");
  for (const auto& [key, value] : options) layer_options.set(key, value);
  return create_layer(type, "calibrate_" + type, 7, layer_options);
}

/// Uniform in [-1, 1), made on the host and copied to `device`.
Tensor random_tensor(const Shape& shape, std::uint64_t stream, Device device = Device::host()) {
  Tensor tensor(shape);
  float* data = tensor.data();
  for (std::int64_t i = 0; i < tensor.numel(); ++i)
    data[i] = 2.0f * random_uniform(17, stream, static_cast<std::uint64_t>(i)) - 1.0f;
  return tensor.to(device);
}

/// Waits for the work queued on `device` (the host's has finished when a call returns).
void finish(Device device) {
  if (!device.is_host()) cuda::synchronize();
}

}  // namespace

double Bench::run(DnnBackend& backend) {
  LayerContext ctx;
  ctx.backend = &backend;
  ctx.tile = tile.get();
  ctx.global_batch = inputs.front().dim(0);
  ctx.seed = 5;
  ctx.training = true;
  ctx.leaky_relu_after = leaky_relu_after;
  ctx.leaky_relu_before = leaky_relu_before;
  std::vector<const Tensor*> in;
  for (auto& t : inputs) in.push_back(&t);
  grads.resize(inputs.size());
  std::vector<Tensor*> grad_in;
  for (std::size_t i = 0; i < inputs.size(); ++i) grad_in.push_back(needs_grad[i] ? &grads[i] : nullptr);
  if (wait) finish(device);
  const auto start = Clock::now();
  layer->forward(in, output, ctx);
  if (wait) finish(device);
  double seconds = seconds_since(start);
  // The first call makes the output gradient (outside the timed part; the warm-up call anyway).
  if (!(grad_output.shape() == output.shape())) grad_output = random_tensor(output.shape(), 77, device);
  const auto again = Clock::now();
  layer->backward(in, output, grad_output, grad_in, ctx);
  if (wait) finish(device);
  return seconds + seconds_since(again);
}

double time_once(Bench& bench, DnnBackend& backend) {
  bench.run(backend);  // warm-up: primitive creation, first touch
  return bench.run(backend);
}

double time_sustained(Bench& bench, DnnBackend& backend, double span) {
  const double first = time_once(bench, backend);
  const int calls = static_cast<int>(std::clamp(std::ceil(span / std::max(first, 1e-9)), 1.0, 200.0));
  double total = 0;
  for (int c = 0; c < calls; ++c) total += bench.run(backend);
  return total / calls;
}

double time_bench(Bench& bench, DnnBackend& backend, int repeats) {
  bench.run(backend);  // warm-up: primitive creation, first touch
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) times.push_back(bench.run(backend));
  return median(times);
}

double median_rate(const std::vector<FlopsProbe>& probes) {
  std::vector<double> rates;
  for (const auto& p : probes) rates.push_back(p.rate());
  return median(rates);
}

FlopsProbe Prober::layer(std::unique_ptr<Layer> layer, const Shape& input, std::uint64_t stream, std::string what,
                         const std::function<double(const Shape&)>& flops, int times) const {
  Bench bench = bench_of(std::move(layer), input, stream);
  FlopsProbe p;
  p.what = std::move(what);
  if (precision == Precision::BF16) p.what += " bf16";
  p.flops = flops(bench.output_shape);
  p.seconds = time_bench(bench, backend, times);
  return p;
}

Bench Prober::bench_of(std::unique_ptr<Layer> layer, const Shape& input, std::uint64_t stream) const {
  Bench bench;
  bench.output_shape = layer->setup({input});
  layer->init_parameters(3);
  layer->move_to(device);
  bench.layer = std::move(layer);
  bench.device = device;
  bench.inputs.push_back(random_tensor(input, stream, device));
  bench.needs_grad = {true};
  return bench;
}

// Forward + backward of a convolution or a linear layer: 3 x the forward multiply-adds x 2.
FlopsProbe Prober::conv(std::int64_t batch, std::int64_t channels, std::int64_t filters, std::vector<std::int64_t> size,
                        std::int64_t kernel, int times) const {
  std::string extents;
  for (auto s : size) {
    if (!extents.empty()) extents += 'x';
    extents += std::to_string(s);
  }
  double window = 1;
  for (std::size_t i = 0; i < size.size(); ++i) window *= static_cast<double>(kernel);
  return layer(
      simple_layer("conv", {{"filters", std::to_string(filters)},
                            {"kernel", std::to_string(kernel)},
                            {"padding", std::to_string(kernel / 2)},
                            {"precision", std::string(precision_name(precision))}}),
      Shape::image(batch, channels, size), 1,
      fmt::format("conv {}-D {}->{} ch, {}, kernel {}, batch {}", size.size(), channels, filters, extents, kernel,
                  batch),
      [&](const Shape& output) {
        return 3.0 * 2.0 * static_cast<double>(output.numel()) * static_cast<double>(channels) * window;
      },
      times > 0 ? times : repeats);
}

FlopsProbe Prober::linear(std::int64_t batch, std::int64_t in, std::int64_t out) const {
  return layer(
      simple_layer("linear", {{"out", std::to_string(out)}, {"precision", std::string(precision_name(precision))}}),
      Shape({batch, in}, {DimKind::Sample, DimKind::Feature}), 2, fmt::format("linear {}x{} -> {}", batch, in, out),
      [&](const Shape&) {
        return 3.0 * 2.0 * static_cast<double>(batch) * static_cast<double>(in) * static_cast<double>(out);
      },
      repeats);
}

std::vector<FlopsProbe> measure_host_flops(const Prober& prober, bool quick) {
  std::vector<FlopsProbe> probes;
  if (quick) {
    probes.push_back(prober.conv(8, 16, 32, {28, 28}, 3));
    probes.push_back(prober.conv(2, 16, 16, {16, 16, 16}, 3));
    probes.push_back(prober.linear(256, 512, 512));
  } else {
    probes.push_back(prober.conv(32, 64, 64, {28, 28}, 3));
    probes.push_back(prober.conv(64, 32, 64, {14, 14}, 3));
    probes.push_back(prober.conv(4, 32, 32, {32, 32, 32}, 3));
    probes.push_back(prober.conv(4, 16, 32, {64, 64, 64}, 3, std::max(1, prober.repeats / 2)));
    probes.push_back(prober.linear(1024, 1024, 1024));
  }
  return probes;
}

// Its samples, its block of the channels under a filter/channel split, and under a spatial split
// a tile whose outputs have the workload's extents (the executor's SpatialTile, including the
// halo its window reads).
Bench workload_bench(const Model& model, const PlannerGraph& graph, const Workload& w, Device device) {
  const auto node = static_cast<std::size_t>(w.layer);
  const auto& info = graph.layers.at(node);
  const auto& model_node = model.nodes().at(node);
  Bench bench;
  bench.layer = model.make_layer(node);
  Layer& layer = *bench.layer;
  layer.defer_parameters(true);  // only the block that the workload's split holds is allocated
  // Global shapes of the inputs, with the local sample count.
  std::vector<Shape> shapes;
  for (int in : model_node.inputs)
    shapes.push_back(in == Model::kModelInput ? model.input_shape(w.samples)
                                              : model.nodes().at(static_cast<std::size_t>(in)).output.with(0, w.samples));
  const Shape output = layer.setup(shapes);
  const int dims = output.spatial_dims();
  const bool tiled = dims > 0 && static_cast<int>(w.output_extent.size()) == dims &&
                     [&] {
                       for (int j = 0; j < dims; ++j)
                         if (w.output_extent[static_cast<std::size_t>(j)] != output[j + 2]) return true;
                       return false;
                     }();
  if (tiled && !layer.spatially_splittable())
    fail("calibrate: workload {} splits layer '{}' spatially, which it cannot be", w.key(graph), info.name);
  const ModelSplit split{w.filter_parts, 0, w.channel_parts, 0};
  if (!split.none()) layer.set_model_split(split);
  for (Parameter* p : layer.parameters()) p->allocate();
  layer.init_parameters(11);
  layer.move_to(device);
  bench.device = device;
  // As the step runs it: with the leaky ReLUs the step plan fuses into its passes (none into
  // partial sums: a channel split's forward).
  {
    const std::vector<std::vector<int>> inputs = graph.inputs();
    const std::vector<LayerTraits> traits = graph.traits();
    const FusionCandidates fusion =
        fusion_candidates(inputs, traits, graph.output, default_step_options(!device.is_host()));
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      if (fusion.forward[i] && inputs[i][0] == w.layer && w.channel_parts == 1)
        bench.leaky_relu_after = traits[i].leaky_relu_slope;
      if (fusion.backward[i] && fusion.reader[i] == w.layer) bench.leaky_relu_before = traits[i].leaky_relu_slope;
    }
  }
  std::vector<std::int64_t> window;  // local input extents under a spatial split
  if (tiled) {
    bench.tile = std::make_unique<SpatialTile>();
    auto& tile = *bench.tile;
    for (int j = 0; j < dims; ++j) {
      const std::int64_t e = w.output_extent[static_cast<std::size_t>(j)];
      // The first tile along each dimension: its window reaches into the padding (zeros).
      const auto [first, last] = layer.input_range(j, 0, e);
      tile.input_global.push_back(shapes.front()[j + 2]);
      tile.window_begin.push_back(first);
      tile.output_global.push_back(output[j + 2]);
      tile.output_begin.push_back(0);
      tile.output_extent.push_back(e);
      window.push_back(last - first);
    }
  }
  for (std::size_t a = 0; a < shapes.size(); ++a) {
    Shape local = shapes[a];
    if (local.rank() >= 2 && !split.none()) {
      // conv/linear read their channel block; per-channel layers their filter block.
      const std::int64_t channels = local[1];
      const int parts = layer.model_splittable() ? split.channel_parts : split.filter_parts;
      local = local.with(1, block_extent(channels, parts, 0));
    }
    for (std::size_t j = 0; j < window.size(); ++j) local = local.with(static_cast<int>(j) + 2, window[j]);
    bench.inputs.push_back(random_tensor(local, 100 + a, device));
    bench.needs_grad.push_back(model_node.inputs[a] != Model::kModelInput);
  }
  return bench;
}

// a[i] = b[i] + s c[i] with all threads, STREAM's count of 3 x 4 bytes per element.
double measure_triad(int threads, std::size_t bytes_per_array, int repeats) {
  const std::size_t n = bytes_per_array / sizeof(float);
  std::vector<float> a(n), b(n), c(n);  // zero-filled by one thread; re-touched below by each
  auto part = [&](int t) {
    const std::size_t begin = n * static_cast<std::size_t>(t) / static_cast<std::size_t>(threads);
    const std::size_t end = n * static_cast<std::size_t>(t + 1) / static_cast<std::size_t>(threads);
    return std::pair{begin, end};
  };
  auto parallel = [&](auto&& body) {
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back([&, t] { body(t); });
    body(0);
    for (auto& th : pool) th.join();
  };
  parallel([&](int t) {
    const auto [begin, end] = part(t);
    for (std::size_t i = begin; i < end; ++i) {
      a[i] = 0.0f;
      b[i] = 1.0f;
      c[i] = 2.0f;
    }
  });
  double best = 0;
  const float s = 0.5f;
  for (int r = 0; r < repeats + 1; ++r) {
    const auto start = Clock::now();
    parallel([&](int t) {
      const auto [begin, end] = part(t);
      float* __restrict pa = a.data();
      const float* __restrict pb = b.data();
      const float* __restrict pc = c.data();
      for (std::size_t i = begin; i < end; ++i) pa[i] = pb[i] + s * pc[i];
    });
    const double seconds = seconds_since(start);
    if (r > 0) best = std::max(best, 3.0 * static_cast<double>(n * sizeof(float)) / seconds);
  }
  if (a[n / 2] != 2.0f) fail("calibrate: the triad computed a wrong value ({})", a[n / 2]);
  return best;
}

double measure_device_copy(Device device, std::size_t bytes, int repeats) {
  const auto n = static_cast<std::int64_t>(bytes / sizeof(float));
  Tensor from(Shape({n}), device), to(Shape({n}), device);
  from.fill(1.5f);
  constexpr int kCopies = 8;
  double best = 0;
  for (int r = 0; r < repeats + 1; ++r) {
    finish(device);
    const auto start = Clock::now();
    for (int k = 0; k < kCopies; ++k) cuda::copy_on_device(to.data(), from.data(), bytes);
    finish(device);
    const double seconds = seconds_since(start);
    if (r > 0) best = std::max(best, 2.0 * static_cast<double>(bytes) * kCopies / seconds);
  }
  const float copied = to.slice(n / 2, n / 2 + 1).to(Device::host()).data()[0];
  if (copied != 1.5f) fail("calibrate: the device copy gave a wrong value ({})", copied);
  return best;
}

// A convolution too small to compute anything, `calls` times, then one wait; half of that per call.
double measure_call_overhead(const Prober& prober, int calls) {
  Bench bench = prober.bench_of(simple_layer("conv", {{"filters", "1"}, {"kernel", "1"}}), Shape::image(1, 1, {4, 4}), 1);
  bench.wait = false;
  for (int k = 0; k < 3; ++k) bench.run(prober.backend);  // warm-up: algorithm choice, first allocations
  finish(prober.device);
  const auto start = Clock::now();
  for (int k = 0; k < calls; ++k) bench.run(prober.backend);
  finish(prober.device);
  return seconds_since(start) / calls / 2;
}

// fp32 and bf16 rates as the executor runs them: strict fp32, and with bf16 operands.
GpuMeasures measure_gpu(DnnBackend& backend, Device device, int repeats, bool quick) {
  auto rates = [&](Precision precision) {
    const Prober prober{backend, device, repeats, precision};
    std::vector<FlopsProbe> probes;
    if (quick) {
      probes.push_back(prober.conv(2, 16, 32, {32, 32, 32}, 3));
      probes.push_back(prober.conv(16, 64, 64, {28, 28}, 3));
      probes.push_back(prober.linear(1024, 1024, 1024));
    } else {
      probes.push_back(prober.conv(4, 32, 64, {64, 64, 64}, 3));
      probes.push_back(prober.conv(8, 128, 128, {32, 32, 32}, 3));
      probes.push_back(prober.conv(32, 256, 256, {56, 56}, 3));
      probes.push_back(prober.linear(8192, 4096, 4096));
    }
    return probes;
  };
  GpuMeasures m;
  // A GPU that runs bf16 convolutions exact (before compute capability 8.0) has no faster bf16 path.
  m.bf16_tensor_cores = backend.bf16_convolutions() != "exact";
  m.fp32 = rates(Precision::F32);
  if (m.bf16_tensor_cores) m.bf16 = rates(Precision::BF16);
  m.memory_bandwidth =
      measure_device_copy(device, quick ? (std::size_t{64} << 20) : (std::size_t{1} << 30), repeats);
  m.kernel_overhead = measure_call_overhead(Prober{backend, device, 1, Precision::F32}, quick ? 50 : 200);
  m.memory_bytes = static_cast<double>(cuda::device_memory_bytes(device.index));
  m.description = cuda::describe_device(device.index);
  return m;
}

int allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 0;
  return CPU_COUNT(&set);
}

// mpirun binds each rank to a core when there are few ranks.
int widen_affinity(int cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c = 0; c < cpus && c < CPU_SETSIZE; ++c) CPU_SET(c, &set);
  sched_setaffinity(0, sizeof(set), &set);  // may fail under a cgroup limit: report what we got
  return allowed_cpus();
}

// Sampled while this job sleeps: timings on a busy machine come out low.
double busy_cores(double seconds) {
  auto sample = [] {
    std::ifstream in("/proc/stat");
    std::string cpu;
    double user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
    in >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
    if (!in || cpu != "cpu") return std::pair{-1.0, -1.0};
    return std::pair{user + nice + system + irq + softirq + steal, idle + iowait};
  };
  const auto [busy0, idle0] = sample();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  const auto [busy1, idle1] = sample();
  const double total = (busy1 - busy0) + (idle1 - idle0);
  if (busy0 < 0 || busy1 < 0 || total <= 0) return -1;
  return (busy1 - busy0) / total * std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace tessera
