// `tessera calibrate`: measures this machine for the planner and writes a machine file
// (parallel/machine.hpp) that `tessera plan --machine` and `tessera train --plan auto` read.
//
//   mpirun -n 2 --bind-to none tessera calibrate -o machines/local.yaml
//   mpirun -n 2 --bind-to none tessera calibrate --base machines/local.yaml
//       --model models/cosmoflow.yaml --batch 8 --ranks 1,2,4 -o machines/local.yaml
//
// What it measures (one node: the machine file describes nodes like this one):
// - flops: forward + backward of a few convolutions and a matrix product through the project's
//   own layers (oneDNN) with all the node's hardware threads; the median rate;
// - memory_bandwidth: a triad a[i] = b[i] + s c[i] over arrays far larger than the caches, with
//   all threads (STREAM's count: 3 x 4 bytes per element); the best of the repeats;
// - kernel_overhead: half the forward + backward time of a tiny convolution (dispatch cost);
// - intra p2p: a ping-pong between ranks 0 and 1 over message sizes; alpha and beta fitted by
//   least squares on relative errors; allreduce (all ranks, fitted to the allreduce formula of
//   machine.hpp) and alltoallv (all ranks, (p-1) alpha + n beta) likewise;
// - inter = intra (one node), grad_overlap = 0 (host MPI has no progress thread: a gradient
//   allreduce hides little behind backward), as `source` says;
// - kernels (with --model): every local workload the planner can consider for the rank counts
//   of --ranks, each timed forward + backward on a fresh layer at the threads per rank the
//   machine gives that rank count: --repeats rounds over all the workloads (each round a fresh
//   layer, a warm-up call and one timed call per workload), the median per workload. A slow
//   period of the machine (a VM's neighbours, clock changes) then costs one round of every
//   workload instead of every repeat of a few, which the median discards.
// Compute and kernel timings run on rank 0 alone while the other ranks wait in a nonblocking
// barrier polled with sleeps (a blocking MPI wait spins a core and would steal it from the
// timing); rank 0 widens its CPU affinity to the whole node first (launchers bind ranks to cores).
// Communication needs at least 2 ranks; with --base at 1 rank only kernels are added.
//
//   tessera calibrate --device cuda --base machines/perlmutter_class.yaml --name my-gpu-node
//       --model models/cosmoflow_128.yaml --batch 8 --ranks 1,4 -o machines/my_gpu_node.yaml
//
// --device cuda measures one GPU at one rank on top of --base (a GPU machine file): flops and
// bf16_flops (convolutions and a matrix product through the CUDA backend, strict fp32 and bf16
// operands), memory_bandwidth (a device-to-device copy), kernel_overhead (tiny layer calls queued
// back to back), memory_per_rank (90 % of the GPU's memory) and the kernels of --model on the
// GPU (each timed call waited for). The nodes, ranks per node and communication lines stay the
// base's: NCCL between GPUs is not measured yet.
#include <fmt/format.h>
#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <exception>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <thread>
#include <tuple>
#include <vector>

#include "commands.hpp"
#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/layers/dnn_backend.hpp"
#include "tessera/layers/layer.hpp"
#include "tessera/layers/runtime.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/parallel/machine.hpp"
#include "tessera/parallel/planner.hpp"
#include "tessera/tensor/distribution.hpp"
#include "tessera/train/model.hpp"

namespace tessera {
namespace {

using Clock = std::chrono::steady_clock;

struct CalibrateArgs {
  std::string output, base, model, ranks, name;
  std::string device = "host";
  std::int64_t batch = 0;
  int repeats = 5;
  int ranks_per_node = 0;
  double memory_per_rank = 0;
  bool quick = false;
};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

std::string today() {
  const std::time_t now = std::time(nullptr);
  char text[32] = {};
  std::strftime(text, sizeof(text), "%Y-%m-%d", std::localtime(&now));
  return text;
}

std::vector<int> parse_rank_list(const std::string& text) {
  std::vector<int> ranks;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    int value = 0;
    try {
      std::size_t used = 0;
      value = std::stoi(item, &used);
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      fail_input("--ranks expects a comma-separated list of rank counts like 1,2,4, got '{}'", text);
    }
    if (value < 1) fail_input("--ranks: rank counts must be at least 1, got {}", value);
    if (std::find(ranks.begin(), ranks.end(), value) == ranks.end()) ranks.push_back(value);
  }
  if (ranks.empty()) fail_input("--ranks expects a comma-separated list of rank counts like 1,2,4, got '{}'", text);
  return ranks;
}

/// Waits for every rank at a barrier without spinning: ranks that have nothing to do while
/// rank 0 times kernels must leave the cores to it.
void idle_barrier(MPI_Comm comm) {
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_Ibarrier(comm, &request);
  int done = 0;
  while (true) {
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (done) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

/// Runs `work` on rank 0 while the other ranks sleep in idle_barrier; an error on rank 0 then
/// fails every rank together (AgreedFailure).
void on_rank0_alone(Communicator& world, const std::function<void()>& work) {
  std::exception_ptr error;
  if (world.rank() == 0) {
    try {
      work();
    } catch (...) {
      error = std::current_exception();
    }
  }
  idle_barrier(MPI_COMM_WORLD);
  collectively(world, [&] {
    if (error) std::rethrow_exception(error);
  });
}

/// CPUs this process may run on.
int allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 0;
  return CPU_COUNT(&set);
}

/// Lets the calling thread (and the OpenMP threads it starts later) run on every CPU of the
/// node: mpirun binds each rank to a core when there are few ranks. Returns the CPUs allowed now.
int widen_affinity(int cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c = 0; c < cpus && c < CPU_SETSIZE; ++c) CPU_SET(c, &set);
  sched_setaffinity(0, sizeof(set), &set);  // may fail under a cgroup limit: report what we got
  return allowed_cpus();
}

/// Cores' worth of CPU time other processes use, sampled over `seconds` while this job sleeps
/// (/proc/stat); -1 when it cannot be read. Timings on a busy machine come out low.
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

// --------------------------------------------------------------------------------------------
// Least squares.

/// Fits t = a + b x minimizing the relative errors sum ((t_i - a - b x_i) / t_i)^2, so that
/// small messages (which set a) count as much as large ones (which set b); a, b >= 0.
std::pair<double, double> fit_line(const std::vector<double>& x, const std::vector<double>& t) {
  double s00 = 0, s01 = 0, s11 = 0, r0 = 0, r1 = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double w = 1.0 / (t[i] * t[i]);
    s00 += w;
    s01 += w * x[i];
    s11 += w * x[i] * x[i];
    r0 += w * t[i];
    r1 += w * x[i] * t[i];
  }
  const double det = s00 * s11 - s01 * s01;
  double a = (r0 * s11 - r1 * s01) / det;
  double b = (s00 * r1 - s01 * r0) / det;
  if (!(b > 0)) {  // degenerate: a pure latency; keep a tiny positive beta
    b = 1e-15;
    a = r0 / s00;
  }
  if (!(a >= 0)) {  // a line through the origin
    a = 0;
    b = r1 / s11;
  }
  return {a, b};
}

// --------------------------------------------------------------------------------------------
// Compute: flops, kernel overhead, kernel timings.

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

/// Waits for the work queued on `device` (a GPU's kernels run after the call that queues them
/// returns; the host's have finished by then).
void finish(Device device) {
  if (!device.is_host()) cuda::synchronize();
}

/// A layer with its inputs, ready to run forward + backward repeatedly.
struct Bench {
  std::unique_ptr<Layer> layer;
  std::vector<Tensor> inputs;
  std::vector<bool> needs_grad;
  std::unique_ptr<SpatialTile> tile;
  Tensor output, grad_output;
  std::vector<Tensor> grads;
  Device device;  ///< where the layer, its inputs and its results are
  /// Waits for the device after forward and after backward (the timed parts); false: queues only.
  bool wait = true;
  Shape output_shape;  ///< the layer's output (from its setup; Prober::bench_of)

  /// Seconds of one forward + backward.
  double run(DnnBackend& backend) {
    LayerContext ctx;
    ctx.backend = &backend;
    ctx.tile = tile.get();
    ctx.global_batch = inputs.front().dim(0);
    ctx.seed = 5;
    ctx.training = true;
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
};

/// Seconds of one forward + backward after one warm-up call.
double time_once(Bench& bench, DnnBackend& backend) {
  bench.run(backend);  // warm-up: primitive creation, first touch
  return bench.run(backend);
}

/// Median seconds of forward + backward after one warm-up call.
double time_bench(Bench& bench, DnnBackend& backend, int repeats) {
  bench.run(backend);  // warm-up: primitive creation, first touch
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) times.push_back(bench.run(backend));
  return median(times);
}

struct FlopsProbe {
  std::string what;
  double flops = 0;  ///< forward + backward
  double seconds = 0;
  double rate() const { return flops / seconds; }
};

/// Where and how the compute probes run: the backend, its device, the timed repeats, and the
/// precision of the convolutions and matrix products (the model file's `precision`).
struct Prober {
  DnnBackend& backend;
  Device device;
  int repeats = 1;
  Precision precision = Precision::F32;

  /// Times forward + backward of `layer` on a random `input`; `flops` gives the work of both
  /// from the output shape.
  FlopsProbe layer(std::unique_ptr<Layer> layer, const Shape& input, std::uint64_t stream, std::string what,
                   const std::function<double(const Shape&)>& flops, int times) const {
    Bench bench = bench_of(std::move(layer), input, stream);
    FlopsProbe p;
    p.what = std::move(what);
    if (precision == Precision::BF16) p.what += " bf16";
    p.flops = flops(bench.output_shape);
    p.seconds = time_bench(bench, backend, times);
    return p;
  }

  /// `layer` set up on a random `input` on the device.
  Bench bench_of(std::unique_ptr<Layer> layer, const Shape& input, std::uint64_t stream) const {
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

  /// Forward + backward of a convolution or a linear layer: 3 x the forward multiply-adds x 2.
  FlopsProbe conv(std::int64_t batch, std::int64_t channels, std::int64_t filters, std::vector<std::int64_t> size,
                  std::int64_t kernel, int times = 0) const {
    std::string extents;
    for (auto s : size) extents += (extents.empty() ? "" : "x") + std::to_string(s);
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

  FlopsProbe linear(std::int64_t batch, std::int64_t in, std::int64_t out) const {
    return layer(
        simple_layer("linear", {{"out", std::to_string(out)}, {"precision", std::string(precision_name(precision))}}),
        Shape({batch, in}, {DimKind::Sample, DimKind::Feature}), 2, fmt::format("linear {}x{} -> {}", batch, in, out),
        [&](const Shape&) {
          return 3.0 * 2.0 * static_cast<double>(batch) * static_cast<double>(in) * static_cast<double>(out);
        },
        repeats);
  }
};

/// Sets up a fresh copy of model node `w.layer` on the local workload `w` (see planner.hpp): its
/// samples, its block of the channels under a filter/channel split, and under a spatial split
/// a tile whose outputs have the workload's extents (the executor's SpatialTile, including the
/// halo its window reads).
Bench workload_bench(const Model& model, const PlannerGraph& graph, const Workload& w, Device device) {
  const auto node = static_cast<std::size_t>(w.layer);
  const auto& info = graph.layers.at(node);
  const auto& model_node = model.nodes().at(node);
  Bench bench;
  bench.layer = model.make_layer(node);
  Layer& layer = *bench.layer;
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
  layer.init_parameters(11);
  layer.move_to(device);
  bench.device = device;
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

struct KernelRow {
  std::string key;
  std::string layer;
  int ranks = 0;
  double seconds = 0;
};

// --------------------------------------------------------------------------------------------
// Memory bandwidth.

/// Best triad bandwidth (bytes/s) with `threads` threads over `bytes_per_array` bytes per array.
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

// --------------------------------------------------------------------------------------------
// One GPU (--device cuda): its compute, memory and call overhead.

/// Best device-to-device copy bandwidth (bytes/s, each byte read once and written once, as
/// STREAM's copy counts it) over buffers of `bytes` bytes.
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

/// Seconds per layer call when calls are queued back to back (a GPU runs them while the host
/// queues the next): a convolution too small to compute anything, forward + backward `calls`
/// times, then one wait; half of that per call.
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

/// Measures the GPU of `device` into `machine`: flops and bf16_flops (the median rate of
/// convolutions and a matrix product, forward + backward, in strict fp32 and with bf16 operands
/// as the executor runs them), memory_bandwidth, kernel_overhead and (unless given)
/// memory_per_rank. Prints what it measured.
void measure_gpu(Machine& machine, DnnBackend& backend, Device device, const CalibrateArgs& args) {
  const bool quick = args.quick;
  auto rates = [&](Precision precision) {
    const Prober prober{backend, device, args.repeats, precision};
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
  // bf16_flops > 0 tells the planner that bf16 convolutions run on bf16 tensor cores; a GPU that
  // runs them exact (before compute capability 8.0) has no faster bf16 path: 0, as `flops`.
  const bool bf16_tensor_cores = backend.bf16_convolutions() != "exact";
  const std::vector<FlopsProbe> fp32 = rates(Precision::F32);
  const std::vector<FlopsProbe> bf16 = bf16_tensor_cores ? rates(Precision::BF16) : std::vector<FlopsProbe>{};
  auto median_rate = [](const std::vector<FlopsProbe>& probes) {
    std::vector<double> r;
    for (const auto& p : probes) r.push_back(p.rate());
    return median(r);
  };
  machine.device = "gpu";
  machine.flops = median_rate(fp32);
  machine.bf16_flops = bf16_tensor_cores ? median_rate(bf16) : 0;
  machine.memory_bandwidth = measure_device_copy(device, quick ? (std::size_t{64} << 20) : (std::size_t{1} << 30),
                                                 args.repeats);
  machine.kernel_overhead = measure_call_overhead(Prober{backend, device, 1, Precision::F32}, quick ? 50 : 200);
  const double memory = static_cast<double>(cuda::device_memory_bytes(device.index));
  if (args.memory_per_rank == 0) machine.memory_per_rank = 0.9 * memory;
  const std::string gpu = cuda::describe_device(device.index);
  // The base's kernel timings stay only when they were measured on this kind of GPU.
  const std::string measured_here = "tessera calibrate --device cuda on ";
  const bool same_gpu = machine.source.find(measured_here) != std::string::npos &&
                        machine.source.find(gpu) != std::string::npos;
  const std::size_t dropped = same_gpu ? 0 : machine.kernels.size();
  if (!same_gpu) machine.kernels.clear();
  const std::string base_source = machine.source.find(measured_here) != std::string::npos
                                      ? "itself measured by tessera calibrate --device cuda"
                                      : machine.source;
  machine.source = fmt::format(
      "measured by tessera calibrate --device cuda on {} ({}; {}): flops = median strict-fp32 rate and bf16_flops = "
      "median rate with bf16 operands (convolutions on bf16 tensors; 0 where they run exact) of conv/linear "
      "forward+backward (cuDNN, cuBLAS); kernels timed with bf16 convolutions on bf16 tensors; memory_bandwidth = device-to-device copy (read + write); kernel_overhead = half a tiny convolution's "
      "forward+backward queued back to back; memory_per_rank = {}. Nodes, ranks per node and communication "
      "(NCCL between GPUs is not measured yet) from {}: {}",
      host_name(), today(), gpu,
      args.memory_per_rank == 0 ? "90% of the GPU's memory" : "as given (--memory-per-rank)", args.base, base_source);
  fmt::print("tessera calibrate: {} on {}{}\n", machine.name, gpu, quick ? " (quick)" : "");
  fmt::print("  compute (forward + backward):\n");
  for (const auto* probes : {&fp32, &bf16})
    for (const auto& p : *probes)
      fmt::print("    {:<52} {:8.3f} ms  {:8.2f} TFLOP/s\n", p.what, p.seconds * 1e3, p.rate() * 1e-12);
  fmt::print("  flops            {:.4g} FLOP/s (median, strict fp32)\n", machine.flops);
  if (bf16_tensor_cores)
    fmt::print("  bf16_flops       {:.4g} FLOP/s (median, bf16 operands)\n", machine.bf16_flops);
  else
    fmt::print("  bf16_flops       0: this GPU runs bf16 convolutions exact (no bf16 tensor cores), at the fp32 rate\n");
  if (dropped > 0)
    fmt::print("  dropped the {} kernel timings of --base {} (not measured on this GPU)\n", dropped, args.base);
  fmt::print("  memory_bandwidth {:.4g} B/s (device-to-device copy)\n", machine.memory_bandwidth);
  fmt::print("  kernel_overhead  {:.3g} us per call (queued back to back)\n", machine.kernel_overhead * 1e6);
  fmt::print("  memory_per_rank  {:.4g} B (the GPU has {:.4g} B)\n", machine.memory_per_rank, memory);
  std::fflush(stdout);
}

// --------------------------------------------------------------------------------------------
// Communication (every rank takes part).

struct CommPoint {
  double bytes = 0;
  double seconds = 0;
};

std::vector<std::size_t> message_sizes(std::size_t largest) {
  std::vector<std::size_t> sizes;
  for (std::size_t s = 8; s <= largest; s *= 4) sizes.push_back(s);
  return sizes;
}

int iterations_for(std::size_t bytes, bool quick) {
  const double budget = quick ? 2e6 : 2e7;  // bytes moved per size, roughly
  return static_cast<int>(std::clamp(budget / static_cast<double>(bytes), quick ? 3.0 : 10.0, quick ? 200.0 : 2000.0));
}

/// One-way times of a ping-pong between ranks 0 and 1 (the others wait without spinning).
std::vector<CommPoint> ping_pong(bool quick) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::vector<CommPoint> points;
  const std::size_t largest = quick ? (1u << 20) : (16u << 20);
  std::vector<char> buffer(largest, 1);
  for (std::size_t bytes : message_sizes(largest)) {
    const int iterations = iterations_for(bytes, quick);
    std::vector<double> one_way;
    for (int rep = 0; rep < 3; ++rep) {
      if (rank > 1) continue;
      const int peer = 1 - rank;
      // Warm-up exchange, then the timed ones.
      for (int i = -1; i < iterations; ++i) {
        if (i == 0) one_way.push_back(MPI_Wtime());
        if (rank == 0) {
          MPI_Send(buffer.data(), static_cast<int>(bytes), MPI_BYTE, peer, 9, MPI_COMM_WORLD);
          MPI_Recv(buffer.data(), static_cast<int>(bytes), MPI_BYTE, peer, 9, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        } else {
          MPI_Recv(buffer.data(), static_cast<int>(bytes), MPI_BYTE, peer, 9, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
          MPI_Send(buffer.data(), static_cast<int>(bytes), MPI_BYTE, peer, 9, MPI_COMM_WORLD);
        }
      }
      one_way.back() = (MPI_Wtime() - one_way.back()) / (2.0 * iterations);
    }
    if (rank == 0) points.push_back({static_cast<double>(bytes), *std::min_element(one_way.begin(), one_way.end())});
  }
  idle_barrier(MPI_COMM_WORLD);
  return points;
}

/// Seconds per call of `op` over all ranks: the slowest rank's mean, the best of 3 rounds.
template <typename Op>
double time_collective(int iterations, Op&& op) {
  double best = 1e300;
  for (int rep = 0; rep < 3; ++rep) {
    MPI_Barrier(MPI_COMM_WORLD);
    op();  // warm-up
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = MPI_Wtime();
    for (int i = 0; i < iterations; ++i) op();
    double mean = (MPI_Wtime() - start) / iterations;
    MPI_Allreduce(MPI_IN_PLACE, &mean, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    best = std::min(best, mean);
  }
  return best;
}

std::vector<CommPoint> allreduce_points(bool quick) {
  std::vector<CommPoint> points;
  const std::size_t largest = quick ? (1u << 20) : (16u << 20);
  std::vector<float> data(largest / sizeof(float), 1.0f);
  for (std::size_t bytes : message_sizes(largest)) {
    const int count = static_cast<int>(bytes / sizeof(float));
    if (count < 1) continue;
    const double seconds = time_collective(iterations_for(bytes, quick), [&] {
      MPI_Allreduce(MPI_IN_PLACE, data.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    });
    points.push_back({static_cast<double>(count * sizeof(float)), seconds});
  }
  return points;
}

/// n = bytes each rank sends in all, spread evenly over the other ranks.
std::vector<CommPoint> alltoall_points(bool quick) {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<CommPoint> points;
  const std::size_t largest = quick ? (1u << 20) : (16u << 20);
  std::vector<char> send(largest), recv(largest);
  std::vector<int> counts(static_cast<std::size_t>(size)), displs(static_cast<std::size_t>(size));
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  for (std::size_t bytes : message_sizes(largest)) {
    const std::size_t per_peer = std::max<std::size_t>(1, bytes / static_cast<std::size_t>(size - 1));
    int offset = 0;
    for (int r = 0; r < size; ++r) {
      counts[static_cast<std::size_t>(r)] = r == rank ? 0 : static_cast<int>(per_peer);
      displs[static_cast<std::size_t>(r)] = offset;
      offset += counts[static_cast<std::size_t>(r)];
    }
    const double seconds = time_collective(iterations_for(bytes, quick), [&] {
      MPI_Alltoallv(send.data(), counts.data(), displs.data(), MPI_BYTE, recv.data(), counts.data(), displs.data(),
                    MPI_BYTE, MPI_COMM_WORLD);
    });
    points.push_back({static_cast<double>(per_peer * static_cast<std::size_t>(size - 1)), seconds});
  }
  return points;
}

/// Fits t = a + b n, then alpha = a / alpha_factor, beta = b / beta_factor. A point more than
/// 3x off the line (a rank descheduled by another process) is dropped and the line refitted,
/// at most twice.
AlphaBeta fit_level(const std::vector<CommPoint>& points, double alpha_factor, double beta_factor) {
  std::vector<double> x, t;
  for (const auto& p : points) {
    x.push_back(p.bytes);
    t.push_back(p.seconds);
  }
  auto [a, b] = fit_line(x, t);
  for (int round = 0; round < 2 && x.size() > 3; ++round) {
    std::size_t worst = 0;
    double worst_ratio = 1;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double model = a + b * x[i];
      const double ratio = std::max(t[i] / model, model / t[i]);
      if (ratio > worst_ratio) worst = i, worst_ratio = ratio;
    }
    if (worst_ratio < 3) break;
    x.erase(x.begin() + static_cast<std::ptrdiff_t>(worst));
    t.erase(t.begin() + static_cast<std::ptrdiff_t>(worst));
    std::tie(a, b) = fit_line(x, t);
  }
  return {a / alpha_factor, b / beta_factor};
}

void print_points(const char* what, const std::vector<CommPoint>& points, const AlphaBeta& ab, double alpha_factor,
                  double beta_factor) {
  fmt::print("  {:<10} alpha {:.3g} us, beta {:.3g} ns/KiB ({:.3g} GB/s)\n", what, ab.alpha * 1e6,
             ab.beta * 1024 * 1e9, 1e-9 / ab.beta);
  std::string line = "             measured (size: us, model):";
  for (const auto& p : points)
    line += fmt::format(" {}: {:.3g}/{:.3g}", p.bytes >= 1024 ? fmt::format("{}K", p.bytes / 1024) : fmt::format("{}", p.bytes),
                        p.seconds * 1e6, (alpha_factor * ab.alpha + beta_factor * ab.beta * p.bytes) * 1e6);
  fmt::print("{}\n", line);
}

// --------------------------------------------------------------------------------------------

/// Busy arithmetic for `iterations` steps (not optimized away).
double spin(long iterations) {
  volatile double x = 1.0;
  for (long i = 0; i < iterations; ++i) x = x * 1.0000001 + 1e-9;
  return x;
}

/// Seconds a blocking exchange waits for its peers beyond its alpha-beta cost with this job's
/// ranks on the node: every rank alternates a few milliseconds of work with a small exchange with
/// its ring neighbours (as a halo exchange between layers does). Without waiting, an iteration
/// takes the work (stretched by the node's oversubscription) plus two messages; what it takes
/// beyond that, per exchange, is the wait.
double measure_sync_wait(Communicator& world, const Machine& machine, int cores, int repeats) {
  const int size = world.size();
  long iterations = 1 << 20;
  double solo = 0;
  on_rank0_alone(world, [&] {
    // About 5 ms of work on one core.
    const auto start = Clock::now();
    spin(iterations);
    const double t = seconds_since(start);
    iterations = std::max<long>(1000, static_cast<long>(static_cast<double>(iterations) * 0.005 / std::max(t, 1e-6)));
    const auto again = Clock::now();
    spin(iterations);
    solo = seconds_since(again);
  });
  MPI_Bcast(&iterations, 1, MPI_LONG, 0, MPI_COMM_WORLD);
  MPI_Bcast(&solo, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  const int left = (world.rank() + size - 1) % size, right = (world.rank() + 1) % size;
  char out[64] = {}, in_left[64], in_right[64];
  constexpr int kRounds = 40;
  std::vector<double> waits;
  const double stretch = std::max(1.0, static_cast<double>(machine.ranks_on_node(size)) / cores);
  const double expected = solo * stretch + machine.intra.p2p.alpha + 64 * machine.intra.p2p.beta;
  for (int repeat = 0; repeat < repeats; ++repeat) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto start = Clock::now();
    for (int round = 0; round < kRounds; ++round) {
      spin(iterations);
      MPI_Request requests[4];
      MPI_Irecv(in_left, 64, MPI_CHAR, left, 7, MPI_COMM_WORLD, &requests[0]);
      MPI_Irecv(in_right, 64, MPI_CHAR, right, 8, MPI_COMM_WORLD, &requests[1]);
      MPI_Isend(out, 64, MPI_CHAR, right, 7, MPI_COMM_WORLD, &requests[2]);
      MPI_Isend(out, 64, MPI_CHAR, left, 8, MPI_COMM_WORLD, &requests[3]);
      MPI_Waitall(4, requests, MPI_STATUSES_IGNORE);
    }
    const double per_round = world.allreduce_value(seconds_since(start) / kRounds, ReduceOp::Max);
    waits.push_back(std::max(0.0, per_round - expected));
  }
  return median(waits);  // the same on every rank (from allreduced values)
}

void run_calibrate(Communicator& world, const CalibrateArgs& args) {
  const int size = world.size();
  const bool gpu = args.device == "cuda";
  const bool measure = args.base.empty();  // the node (host) from scratch
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  Machine machine;
  std::unique_ptr<Model> model;
  std::vector<int> rank_counts;
  collectively(world, [&] {
    if (args.device != "host" && !gpu) fail_input("--device {}: expected host or cuda", args.device);
    if (gpu) {
      if (size != 1)
        fail_input("tessera calibrate --device cuda measures one GPU at one rank (the job has {}): run it without "
                   "mpirun or with -n 1; the communication between GPUs (NCCL) is not measured yet and comes from "
                   "--base",
                   size);
      if (args.base.empty())
        fail_input("tessera calibrate --device cuda needs --base FILE, a GPU machine file (such as "
                   "machines/perlmutter_class.yaml) for the nodes, the ranks per node and the communication, which "
                   "one GPU cannot measure; the GPU's compute, memory and kernel timings are measured");
    }
    if (measure && size < 2)
      fail_input("tessera calibrate measures communication between ranks and needs at least 2 ranks "
                 "(run it as 'mpirun -n 2 --bind-to none tessera calibrate ...'); to add kernel timings to an "
                 "existing machine file at 1 rank, pass --base FILE");
    if (args.output.empty()) fail_input("tessera calibrate: -o/--output FILE (the machine file to write) is required");
    const auto parent = std::filesystem::absolute(args.output).parent_path();
    if (!std::filesystem::is_directory(parent))
      fail_input("--output {}: the folder {} does not exist", args.output, parent.string());
    if (::access(parent.c_str(), W_OK) != 0) fail_input("--output {}: the folder is not writable", args.output);
    if (args.repeats < 1) fail_input("--repeats must be at least 1, got {}", args.repeats);
    if (args.ranks_per_node < 0) fail_input("--ranks-per-node must be at least 1, got {}", args.ranks_per_node);
    if (args.memory_per_rank < 0) fail_input("--memory-per-rank must be positive, got {}", args.memory_per_rank);
    if (measure) {
      // What is known before measuring; the rates are filled in below.
      machine.name = args.name.empty() ? "local-" + host_name() : args.name;
      machine.device = "cpu";
      machine.nodes = 1;
      machine.cores_per_node = cores;
      machine.ranks_per_node = args.ranks_per_node > 0 ? args.ranks_per_node : 4 * cores;
      const double physical =
          static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
      machine.memory_per_rank = args.memory_per_rank > 0 ? args.memory_per_rank : 0.8 * physical / cores;
    } else {
      machine = Machine::load(args.base);
      if (gpu && machine.device != "gpu")
        fail_input("--base {}: its device is {}, and --device cuda measures a GPU: it needs a GPU machine file "
                   "(device: gpu)",
                   args.base, machine.device);
      if (gpu && cuda::device_count() == 0)
        fail_input("tessera calibrate --device cuda: {}", cuda::unavailable_reason());
      if (!args.name.empty()) machine.name = args.name;
      if (args.memory_per_rank > 0) machine.memory_per_rank = args.memory_per_rank;
      if (args.model.empty() && size < 2 && !gpu)
        fail_input("--base {}: nothing to do at 1 rank without --model (with --base only kernel timings and, at 2 or "
                   "more ranks, the waiting at synchronisation points are measured)",
                   args.base);
    }
    if (!args.model.empty()) {
      if (args.batch < 1) fail_input("--model needs --batch N (the global batch to plan for), got {}", args.batch);
      model = std::make_unique<Model>(Model::load(args.model));
      rank_counts = parse_rank_list(args.ranks.empty() ? std::to_string(size) : args.ranks);
      // The planner's own checks of each rank count (e.g. more ranks than the machine holds).
      const PlannerGraph graph = model->planner_graph(args.batch);
      for (int ranks : rank_counts) (void)CostModel(graph, machine, PlannerOptions{.ranks = ranks});
    } else if (!args.ranks.empty() || args.batch > 0) {
      fail_input("--ranks and --batch choose the kernels to time and need --model");
    }
  });

  const bool quick = args.quick;
  const int repeats = args.repeats;
  std::unique_ptr<DnnBackend> backend;
  Device device = Device::host();
  int cpus_for_timing = 0;
  double busy = 0;
  on_rank0_alone(world, [&] {
    cpus_for_timing = widen_affinity(cores);
    if (gpu) {
      device = Device::cuda(cuda::select_device_for_local_rank(0));
      backend = make_cuda_backend();
      measure_gpu(machine, *backend, device, args);
      return;
    }
    backend = make_host_backend();
    busy = busy_cores(0.3);
    if (busy > 0.25)
      fmt::print("tessera calibrate: warning: other processes keep {:.1f} of the {} hardware threads busy; the "
                 "timings will be slower than on an idle machine\n", busy, cores);
  });

  // --- the node: compute, memory, communication -------------------------------------------
  std::vector<FlopsProbe> probes;
  double triad = 0;
  if (measure) {
    on_rank0_alone(world, [&] {
      set_backend_threads(cores);
      const Prober prober{*backend, device, repeats};
      if (quick) {
        probes.push_back(prober.conv(8, 16, 32, {28, 28}, 3));
        probes.push_back(prober.conv(2, 16, 16, {16, 16, 16}, 3));
        probes.push_back(prober.linear(256, 512, 512));
      } else {
        probes.push_back(prober.conv(32, 64, 64, {28, 28}, 3));
        probes.push_back(prober.conv(64, 32, 64, {14, 14}, 3));
        probes.push_back(prober.conv(4, 32, 32, {32, 32, 32}, 3));
        probes.push_back(prober.conv(4, 16, 32, {64, 64, 64}, 3, std::max(1, repeats / 2)));
        probes.push_back(prober.linear(1024, 1024, 1024));
      }
      std::vector<double> rates;
      for (const auto& p : probes) rates.push_back(p.rate());
      machine.flops = median(rates);
      // Dispatch cost of one layer call: a convolution too small to compute anything.
      auto tiny = Prober{*backend, device, std::max(repeats, 20)}.conv(1, 1, 1, {4, 4}, 1);
      machine.kernel_overhead = tiny.seconds / 2;
      triad = measure_triad(cores, quick ? (32u << 20) : (128u << 20), repeats);
      machine.memory_bandwidth = triad;
    });
    // Everybody needs the numbers measured on rank 0 (only rank 0 writes, but keep them equal).
    world.broadcast(&machine.flops, 1, DType::F64, 0);
    world.broadcast(&machine.kernel_overhead, 1, DType::F64, 0);
    world.broadcast(&machine.memory_bandwidth, 1, DType::F64, 0);

    const auto p2p = ping_pong(quick);
    const auto allreduce = allreduce_points(quick);
    const auto alltoall = alltoall_points(quick);
    const double p = size;
    const double ar_alpha = 2.0 * std::ceil(std::log2(p)), ar_beta = 2.0 * (p - 1) / p;
    if (world.rank() == 0) {
      machine.intra.p2p = fit_level(p2p, 1, 1);
      machine.intra.allreduce = fit_level(allreduce, ar_alpha, ar_beta);
      machine.intra.alltoall = fit_level(alltoall, p - 1, 1);
      machine.inter = machine.intra;
      machine.grad_overlap = 0;
      machine.source = fmt::format(
          "measured by tessera calibrate on {} ({}, {} ranks, {} hardware threads{}): flops = median fp32 rate of "
          "conv/linear forward+backward (oneDNN) at all threads; memory_bandwidth = triad at all threads; "
          "communication fitted over message sizes (p2p ping-pong ranks 0-1, allreduce and alltoallv over {} ranks). "
          "inter = intra (one node). grad_overlap = 0: host MPI without a progress thread hides little of the "
          "gradient allreduce. memory_per_rank = 80% of the node's memory / its cores.{}",
          host_name(), today(), size, cores,
          cpus_for_timing < cores ? fmt::format(", only {} usable by rank 0", cpus_for_timing) : "", size,
          busy > 0.25 ? fmt::format(" WARNING: other processes kept {:.1f} hardware threads busy meanwhile.", busy)
                      : "");
      fmt::print("tessera calibrate: {} ({} hardware threads, {} ranks{})\n", machine.name, cores, size,
                 quick ? ", quick" : "");
      if (cpus_for_timing < cores)
        fmt::print("  warning: rank 0 may use only {} of the {} hardware threads (CPU affinity); the compute rates "
                   "are those of {} threads\n", cpus_for_timing, cores, cpus_for_timing);
      fmt::print("  compute (fp32, forward + backward, {} threads):\n", cores);
      for (const auto& pr : probes)
        fmt::print("    {:<48} {:8.3f} ms  {:7.1f} GFLOP/s\n", pr.what, pr.seconds * 1e3, pr.rate() * 1e-9);
      fmt::print("  flops            {:.4g} FLOP/s (median)\n", machine.flops);
      fmt::print("  memory_bandwidth {:.4g} B/s (triad)\n", machine.memory_bandwidth);
      fmt::print("  kernel_overhead  {:.3g} us per call\n", machine.kernel_overhead * 1e6);
      fmt::print("  communication (within the node, {} ranks):\n", size);
      print_points("p2p", p2p, machine.intra.p2p, 1, 1);
      print_points("allreduce", allreduce, machine.intra.allreduce, ar_alpha, ar_beta);
      print_points("alltoall", alltoall, machine.intra.alltoall, p - 1, 1);
      std::fflush(stdout);
    }
  }

  // --- kernels ---------------------------------------------------------------------------------
  // A workload for this job's own rank count is timed on every rank at once, as training runs it
  // (the ranks contend for the node's cores, caches and memory bandwidth; the slowest counts). A
  // workload for another rank count is timed on rank 0 alone and scaled by the oversubscription
  // of that rank count (more ranks than cores).
  std::vector<KernelRow> rows;
  if (model) {
    const PlannerGraph graph = model->planner_graph(args.batch);
    if (graph.layers.size() != model->nodes().size())
      fail("calibrate: the planner graph has {} layers but the model {} (bug)", graph.layers.size(),
           model->nodes().size());
    std::map<std::string, KernelRow> timed;
    std::vector<std::pair<Workload, int>> together, alone;
    for (int ranks : rank_counts) {
      const CostModel cost(graph, machine, PlannerOptions{.ranks = ranks});
      for (const Workload& w : all_workloads(cost))
        if (!timed.count(w.key(graph))) {
          timed[w.key(graph)] = {};
          (ranks == size ? together : alone).emplace_back(w, ranks);
        }
    }
    // `repeats` rounds over the workloads (a fresh layer, a warm-up and one timed call each):
    // the median per workload. `barrier`: the ranks start each workload together.
    auto median_in_rounds = [&](const std::vector<std::pair<Workload, int>>& list, bool barrier) {
      std::vector<std::vector<double>> times(list.size());
      for (int round = 0; round < repeats; ++round)
        for (std::size_t k = 0; k < list.size(); ++k) {
          set_backend_threads(list[k].first.threads);
          Bench bench = workload_bench(*model, graph, list[k].first, device);
          if (barrier) MPI_Barrier(MPI_COMM_WORLD);
          times[k].push_back(time_once(bench, *backend));
        }
      std::vector<double> medians;
      for (auto& t : times) medians.push_back(median(std::move(t)));
      return medians;
    };
    const auto start = Clock::now();
    if (world.rank() == 0) {
      fmt::print("tessera calibrate: timing {} workloads of model '{}' (batch {}, ranks {}): {} on all {} ranks at "
                 "once, {} on rank 0 alone\n",
                 together.size() + alone.size(), graph.model, args.batch,
                 args.ranks.empty() ? std::to_string(size) : args.ranks, together.size(), size, alone.size());
      std::fflush(stdout);
    }
    collectively(world, [&] {
      if (!together.empty()) {
        widen_affinity(cores);
        if (!backend) backend = make_host_backend();
      }
      const std::vector<double> medians = median_in_rounds(together, /*barrier=*/true);
      for (std::size_t k = 0; k < together.size(); ++k) {
        const auto& [w, ranks] = together[k];
        const double seconds = world.allreduce_value(std::max(medians[k], 1e-9), ReduceOp::Max);
        machine.kernels[w.key(graph)] = seconds;
        rows.push_back({w.key(graph), graph.layers[static_cast<std::size_t>(w.layer)].name, ranks, seconds});
      }
    });
    on_rank0_alone(world, [&] {
      const std::vector<double> medians = median_in_rounds(alone, /*barrier=*/false);
      for (std::size_t k = 0; k < alone.size(); ++k) {
        const auto& [w, ranks] = alone[k];
        const double seconds = std::max(medians[k], 1e-9) * machine.oversubscription(ranks);
        machine.kernels[w.key(graph)] = seconds;
        rows.push_back({w.key(graph), graph.layers[static_cast<std::size_t>(w.layer)].name, ranks, seconds});
      }
      set_backend_threads(cores);
      fmt::print("  {:<60} {:>12}\n", "workload (model/layer|samples|output|filter,channel|threads|ranks on node)",
                 "fwd+bwd ms");
      for (const auto& r : rows) fmt::print("  {:<60} {:12.4f}\n", r.key, r.seconds * 1e3);
      fmt::print("  {} kernels timed in {:.1f} s\n", rows.size(), seconds_since(start));
      std::fflush(stdout);
    });
  }

  // --- waiting at synchronisation points, at this job's rank count ----------------------------
  if (size >= 2) {
    double wait = 0;
    collectively(world, [&] { wait = measure_sync_wait(world, machine, cores, repeats); });
    machine.sync_wait[machine.ranks_on_node(size)] = wait;
    if (world.rank() == 0) {
      fmt::print("  sync_wait        {:.3g} ms per blocking exchange with {} ranks on the node\n", wait * 1e3,
                 machine.ranks_on_node(size));
      std::fflush(stdout);
    }
  }

  // --- write -----------------------------------------------------------------------------------
  collectively(world, [&] {
    if (world.rank() != 0) return;
    const std::string text =
        "# Machine file written by `tessera calibrate` (see machines/README.md for the fields).\n" + machine.to_yaml();
    (void)Machine::parse(text, args.output);  // what we write must read back
    const std::string temp = args.output + ".tmp";
    {
      std::ofstream out(temp);
      out << text;
      if (!out) fail_input("--output {}: cannot write {}", args.output, temp);
    }
    std::filesystem::rename(temp, args.output);
    fmt::print("tessera calibrate: wrote {}{}\n", args.output,
               machine.kernels.empty() ? "" : fmt::format(" ({} kernel timings)", machine.kernels.size()));
    std::fflush(stdout);
  });
}

}  // namespace

std::function<void(Communicator&)> add_calibrate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("calibrate", "Measure this machine for the planner and write a machine file");
  auto args = std::make_shared<CalibrateArgs>();
  cmd->add_option("-o,--output", args->output, "Machine file to write (YAML)");
  cmd->add_option("--base", args->base,
                  "Start from this machine file instead of measuring the node (only kernel timings are added)");
  cmd->add_option("--model", args->model, "Model file whose layer workloads to time (kernels)");
  cmd->add_option("--batch", args->batch, "Global batch the workloads are for (with --model)");
  cmd->add_option("--ranks", args->ranks, "Rank counts to time the workloads for, e.g. 1,2,4 (default: this job's)");
  cmd->add_option("--repeats", args->repeats, "Timed repeats per measurement (the median is kept)")
      ->capture_default_str();
  cmd->add_option("--name", args->name, "Machine name (default: local-HOSTNAME)");
  cmd->add_option("--ranks-per-node", args->ranks_per_node,
                  "Most ranks the planner may put on this node (default: 4 x hardware threads; oversubscribed)");
  cmd->add_option("--memory-per-rank", args->memory_per_rank,
                  "Bytes one rank may use (default: 80% of the node's memory / hardware threads)");
  cmd->add_option("--device", args->device,
                  "host: measure this node's CPUs (needs 2+ ranks, or --base); cuda: measure one GPU at one rank "
                  "(its compute, memory and kernel timings) on top of --base, a GPU machine file that gives the nodes "
                  "and the communication")
      ->capture_default_str();
  cmd->add_flag("--quick", args->quick, "Smaller, faster measurements (for tests; less accurate)");
  return [cmd, args](Communicator& world) {
    if (!cmd->parsed()) return;
    run_calibrate(world, *args);
  };
}

}  // namespace tessera
