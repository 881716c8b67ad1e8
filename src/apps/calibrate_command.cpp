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
// - copy_bandwidth and copy_run: box copies as the exchanges make them, every rank copying at
//   once with its caches cold, fitted over two row lengths (with --base too; only with one rank
//   per hardware thread, the node's every core copying);
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
//
//   tessera calibrate --merge a.yaml b.yaml c.yaml -o machines/local.yaml
//
// --merge measures nothing: it writes the median of calibrations of this machine taken at
// different times (a VM's speed drifts over minutes; one calibration is a sample of one moment).
//
// The probes are libraries: parallel/calibration.hpp (communication, the fits) and
// train/kernel_probes.hpp (compute, memory); this file parses the arguments and runs them.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "commands.hpp"
#include "tessera/core/clock.hpp"
#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/layers/dnn_backend.hpp"
#include "tessera/layers/runtime.hpp"
#include "tessera/parallel/calibration.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/parallel/machine.hpp"
#include "tessera/parallel/planner.hpp"
#include "tessera/train/kernel_probes.hpp"
#include "tessera/train/model.hpp"

namespace tessera {
namespace {

struct CalibrateArgs {
  std::string output, base, model, ranks, name;
  std::vector<std::string> merge;
  std::string device = "host";
  std::int64_t batch = 0;
  int repeats = 5;
  int ranks_per_node = 0;
  double memory_per_rank = 0;
  bool quick = false;
};

/// This node's name, for the machine's name and source.
std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

/// Today's date (YYYY-MM-DD), for the machine's source.
std::string today() {
  const std::time_t now = std::time(nullptr);
  char text[32] = {};
  std::strftime(text, sizeof(text), "%Y-%m-%d", std::localtime(&now));
  return text;
}

/// The rank counts of --ranks ("1,2,4"), without repeats.
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

/// One timed workload, as printed.
struct KernelRow {
  std::string key;
  std::string layer;
  int ranks = 0;
  double seconds = 0;
};

/// Writes what one GPU measured into `machine` (on top of --base) and prints it.
void record_gpu(Machine& machine, const GpuMeasures& measured, const CalibrateArgs& args) {
  const bool quick = args.quick;
  const bool bf16_tensor_cores = measured.bf16_tensor_cores;
  const std::vector<FlopsProbe>& fp32 = measured.fp32;
  const std::vector<FlopsProbe>& bf16 = measured.bf16;
  const double memory = measured.memory_bytes;
  const std::string& gpu = measured.description;
  // bf16_flops > 0 tells the planner that bf16 convolutions run on bf16 tensor cores; a GPU that
  // runs them exact has no faster bf16 path: 0, as `flops`.
  machine.device = "gpu";
  machine.flops = median_rate(fp32);
  machine.bf16_flops = bf16_tensor_cores ? median_rate(bf16) : 0;
  machine.memory_bandwidth = measured.memory_bandwidth;
  machine.kernel_overhead = measured.kernel_overhead;
  if (args.memory_per_rank == 0) machine.memory_per_rank = 0.9 * memory;
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

/// Prints a fitted level and its measured points beside the model's.
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

/// Checks the arguments (on every rank together) and fills what is known before measuring: the machine, the model and
/// its rank counts.
void check_and_start(Communicator& world, const CalibrateArgs& args, int cores, Machine& machine,
                     std::unique_ptr<Model>& model, std::vector<int>& rank_counts) {
  const int size = world.size();
  const bool gpu = args.device == "cuda";
  const bool measure = args.base.empty();  // the node (host) from scratch
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
      ModelOptions shapes_only;  // the kernels are timed on fresh layers: no weights of the model itself
      shapes_only.allocate_parameters = false;
      model = std::make_unique<Model>(Model::load(args.model, shapes_only));
      rank_counts = parse_rank_list(args.ranks.empty() ? std::to_string(size) : args.ranks);
      // The planner's own checks of each rank count (e.g. more ranks than the machine holds).
      const PlannerGraph graph = model->planner_graph(args.batch);
      for (int ranks : rank_counts) (void)CostModel(graph, machine, PlannerOptions{.ranks = ranks});
    } else if (!args.ranks.empty() || args.batch > 0) {
      fail_input("--ranks and --batch choose the kernels to time and need --model");
    }
  });
}

/// Measures the node's compute and memory on rank 0 and its communication over all ranks, and fits them into
/// `machine` (printed on rank 0).
void measure_node(Communicator& world, const CalibrateArgs& args, int cores, const std::unique_ptr<DnnBackend>& backend,
                  const Device& device, int cpus_for_timing, double busy, Machine& machine) {
  const int size = world.size();
  const bool quick = args.quick;
  const int repeats = args.repeats;
  std::vector<FlopsProbe> probes;
  double triad = 0;
  on_rank0_alone(world, [&] {
    set_backend_threads(cores);
    const Prober prober{*backend, device, repeats};
    probes = measure_host_flops(prober, quick);
    machine.flops = median_rate(probes);
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

  const auto p2p = ping_pong(world, quick);
  const auto allreduce = allreduce_points(world, quick);
  const auto alltoall = alltoall_points(world, quick);
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

/// Times the model's workloads for the rank counts of --ranks into `machine.kernels` (printed on rank 0).
void time_kernels(Communicator& world, const CalibrateArgs& args, const Model& model,
                  const std::vector<int>& rank_counts, int cores, std::unique_ptr<DnnBackend>& backend,
                  const Device& device, Machine& machine) {
  // A workload for this job's own rank count is timed on every rank at once, as training runs it
  // (the ranks contend for the node's cores, caches and memory bandwidth; the slowest counts). A
  // workload for another rank count is timed on rank 0 alone and scaled by the oversubscription
  // of that rank count (more ranks than cores).
  const int size = world.size();
  const int repeats = args.repeats;
  std::vector<KernelRow> rows;
  const PlannerGraph graph = model.planner_graph(args.batch);
  if (graph.layers.size() != model.nodes().size())
    fail("calibrate: the planner graph has {} layers but the model {} (bug)", graph.layers.size(),
         model.nodes().size());
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
  // `repeats` rounds over the workloads (a fresh layer, a warm-up and one timed call each; on all
  // ranks at once, the mean of calls filling 0.1 s (--quick: 5 ms), what time-slicing shares out): the median
  // per workload. `barrier`: the ranks start each workload together.
  auto median_in_rounds = [&](const std::vector<std::pair<Workload, int>>& list, bool barrier) {
    std::vector<std::vector<double>> times(list.size());
    for (int round = 0; round < repeats; ++round)
      for (std::size_t k = 0; k < list.size(); ++k) {
        set_backend_threads(list[k].first.threads);
        set_ranks_on_node(machine.ranks_on_node(list[k].second));  // as the executor sets it
        Bench bench = workload_bench(model, graph, list[k].first, device);
        if (barrier) world.barrier();
        times[k].push_back(barrier ? time_sustained(bench, *backend, args.quick ? 0.005 : 0.1) : time_once(bench, *backend));
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

/// Measures the waiting at synchronisation points at this job's rank count into `machine.sync_wait`
/// and `sync_wait_share` (2 or more ranks).
void measure_sync(Communicator& world, int repeats, Machine& machine) {
  const int size = world.size();
  SyncWait wait;
  collectively(world, [&] { wait = measure_sync_wait(world, machine, repeats); });
  machine.sync_wait[machine.ranks_on_node(size)] = wait.seconds;
  machine.sync_wait_share[machine.ranks_on_node(size)] = wait.share;
  if (world.rank() == 0) {
    fmt::print("  sync_wait        {:.3g} ms + {:.3g} x the work before it, per blocking exchange with {} ranks on the "
               "node\n", wait.seconds * 1e3, wait.share, machine.ranks_on_node(size));
    std::fflush(stdout);
  }
}

/// Measures box copies as the exchanges make them into `machine.copy_bandwidth` and `copy_run`
/// (a cpu node with one rank per core: every core copying, as every rank assembles its window).
void measure_copies(Communicator& world, const CalibrateArgs& args, Machine& machine) {
  BoxCopyRate rate;
  collectively(world, [&] { rate = measure_box_copies(world, args.repeats, (args.quick ? 64u : 256u) << 20); });
  machine.copy_bandwidth = rate.bandwidth;
  machine.copy_run = rate.run_seconds;
  // The source names the probe once (a file calibrated again on its own base keeps one mention).
  if (machine.source.find("copy_bandwidth") == std::string::npos)
    machine.source += fmt::format(" copy_bandwidth, copy_run: box copies by tessera calibrate on {} ({}), {} ranks "
                                  "copying at once, caches cold.", host_name(), today(), world.size());
  if (world.rank() == 0) {
    fmt::print("  copy_bandwidth   {:.4g} B/s per rank, copy_run {:.3g} ns per contiguous run (box copies, caches cold, "
               "{} ranks copying)\n", rate.bandwidth, rate.run_seconds * 1e9, world.size());
    std::fflush(stdout);
  }
}

/// Writes the machine file on rank 0 (every rank takes part in agreeing on its failure).
void write_machine(Communicator& world, const CalibrateArgs& args, const Machine& machine) {
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

/// --merge: several calibrations of this machine as one file (merge_calibrations), measuring nothing.
void merge_files(Communicator& world, const CalibrateArgs& args) {
  Machine merged;
  collectively(world, [&] {
    if (!args.base.empty() || !args.model.empty() || args.device != "host" || !args.ranks.empty() || args.batch > 0)
      fail_input(
          "--merge combines finished calibrations and measures nothing: it takes no --base, --model, --ranks, "
          "--batch or --device");
    if (args.output.empty()) fail_input("tessera calibrate: -o/--output FILE (the machine file to write) is required");
    std::vector<Machine> machines;
    for (const auto& file : args.merge) machines.push_back(Machine::load(file));
    merged = merge_calibrations(machines, args.merge);
    if (!args.name.empty()) merged.name = args.name;
  });
  write_machine(world, args, merged);
  if (world.rank() == 0) {
    fmt::print("  the median of {} calibrations: flops {:.4g} FLOP/s, memory_bandwidth {:.4g} B/s, {} kernel timings\n",
               args.merge.size(), merged.flops, merged.memory_bandwidth, merged.kernels.size());
    std::fflush(stdout);
  }
}

/// Checks the arguments, measures (every rank takes part) and writes the machine file on rank 0.
void run_calibrate(Communicator& world, const CalibrateArgs& args) {
  if (!args.merge.empty()) return merge_files(world, args);
  const int size = world.size();
  const bool gpu = args.device == "cuda";
  const bool measure = args.base.empty();  // the node (host) from scratch
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  Machine machine;
  std::unique_ptr<Model> model;
  std::vector<int> rank_counts;
  check_and_start(world, args, cores, machine, model, rank_counts);

  std::unique_ptr<DnnBackend> backend;
  Device device = Device::host();
  int cpus_for_timing = 0;
  double busy = 0;
  on_rank0_alone(world, [&] {
    cpus_for_timing = widen_affinity(cores);
    if (gpu) {
      device = Device::cuda(cuda::select_device_for_local_rank(0));
      backend = make_cuda_backend();
      record_gpu(machine, measure_gpu(*backend, device, args.repeats, args.quick), args);
      return;
    }
    backend = make_host_backend();
    busy = busy_cores(0.3);
    if (busy > 0.25)
      fmt::print("tessera calibrate: warning: other processes keep {:.1f} of the {} hardware threads busy; the "
                 "timings will be slower than on an idle machine\n", busy, cores);
  });

  if (measure) measure_node(world, args, cores, backend, device, cpus_for_timing, busy, machine);
  if (model) time_kernels(world, args, *model, rank_counts, cores, backend, device, machine);
  if (!gpu && size == cores) measure_copies(world, args, machine);
  if (size >= 2) measure_sync(world, args.repeats, machine);
  write_machine(world, args, machine);
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
  cmd->add_option("--merge", args->merge,
                  "Measure nothing: write the median of these calibrations of this machine (taken at different "
                  "times) as one machine file, each measured number over the files that have it");
  return [cmd, args](Communicator& world) {
    if (!cmd->parsed()) return;
    run_calibrate(world, *args);
  };
}

}  // namespace tessera
