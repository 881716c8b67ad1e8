#pragma once
// What `tessera calibrate` measures on one rank: forward + backward times of layers through a
// DnnBackend (flop rates, call overhead, the local workloads of a model), memory bandwidth, and
// the CPU affinity and load the timings depend on. The communication probes and the fits are in
// parallel/calibration.hpp.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/core/device.hpp"
#include "tessera/core/precision.hpp"
#include "tessera/layers/dnn_backend.hpp"
#include "tessera/layers/layer.hpp"
#include "tessera/parallel/planner.hpp"
#include "tessera/tensor/shape.hpp"
#include "tessera/tensor/tensor.hpp"
#include "tessera/train/model.hpp"

namespace tessera {

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
  /// The leaky ReLUs the step plan fuses into its forward and backward (LayerContext).
  std::optional<float> leaky_relu_after, leaky_relu_before;

  /// Seconds of one forward + backward.
  double run(DnnBackend& backend);
};

/// Seconds of one forward + backward after one warm-up call.
double time_once(Bench& bench, DnnBackend& backend);

/// Mean seconds of forward + backward over as many calls as fill `span` seconds (after a warm-up
/// and a first call that sizes it): on an oversubscribed node a single call is either never or
/// wholly preempted, while training sees the sustained rate.
double time_sustained(Bench& bench, DnnBackend& backend, double span);

/// Median seconds of forward + backward after one warm-up call.
double time_bench(Bench& bench, DnnBackend& backend, int repeats);

/// One timed layer: its forward + backward work and time.
struct FlopsProbe {
  std::string what;
  double flops = 0;  ///< forward + backward
  double seconds = 0;
  double rate() const { return flops / seconds; }
};

/// The median rate of `probes` (FLOP/s).
double median_rate(const std::vector<FlopsProbe>& probes);

/// Where and how the compute probes run: backend, device, timed repeats and operand precision.
struct Prober {
  DnnBackend& backend;
  Device device;
  int repeats = 1;
  Precision precision = Precision::F32;

  /// Times `layer` on a random `input`, `flops` giving its work from the output shape.
  FlopsProbe layer(std::unique_ptr<Layer> layer, const Shape& input, std::uint64_t stream, std::string what,
                   const std::function<double(const Shape&)>& flops, int times) const;
  /// `layer` set up on a random `input` on the device.
  Bench bench_of(std::unique_ptr<Layer> layer, const Shape& input, std::uint64_t stream) const;
  /// Times a convolution (`times` repeats, 0: `repeats`).
  FlopsProbe conv(std::int64_t batch, std::int64_t channels, std::int64_t filters, std::vector<std::int64_t> size,
                  std::int64_t kernel, int times = 0) const;
  /// Times a linear layer.
  FlopsProbe linear(std::int64_t batch, std::int64_t in, std::int64_t out) const;
};

/// The convolutions and matrix product whose median rate is a host's `flops`.
std::vector<FlopsProbe> measure_host_flops(const Prober& prober, bool quick);

/// A fresh copy of model node `w.layer` set up on the local workload `w` (see planner.hpp).
Bench workload_bench(const Model& model, const PlannerGraph& graph, const Workload& w, Device device);

/// Best triad bandwidth (bytes/s) with `threads` threads over `bytes_per_array` bytes per array.
double measure_triad(int threads, std::size_t bytes_per_array, int repeats);

/// Best device-to-device copy bandwidth (bytes/s, read + write) over buffers of `bytes` bytes.
double measure_device_copy(Device device, std::size_t bytes, int repeats);

/// Seconds per layer call when tiny calls are queued back to back (`calls` forward + backward).
double measure_call_overhead(const Prober& prober, int calls);

/// What one GPU measured (tessera calibrate --device cuda).
struct GpuMeasures {
  std::vector<FlopsProbe> fp32;  ///< strict fp32
  std::vector<FlopsProbe> bf16;  ///< bf16 operands; empty without bf16 tensor cores
  bool bf16_tensor_cores = false;
  double memory_bandwidth = 0;  ///< device-to-device copy
  double kernel_overhead = 0;   ///< per call, queued back to back
  double memory_bytes = 0;      ///< the GPU's memory
  std::string description;      ///< cuda::describe_device
};

/// Measures the GPU of `device`: flop rates in fp32 and bf16, copy bandwidth and call overhead.
GpuMeasures measure_gpu(DnnBackend& backend, Device device, int repeats, bool quick);

/// CPUs this process may run on.
int allowed_cpus();

/// Lets this thread (and the threads it starts) run on CPUs 0..cpus-1; returns the CPUs allowed now.
int widen_affinity(int cpus);

/// Cores' worth of CPU time other processes use over `seconds` (/proc/stat); -1 when unknown.
double busy_cores(double seconds);

}  // namespace tessera
