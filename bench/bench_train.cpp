// Training-step throughput of a model under a plan (default: sample-parallel), on in-memory data
// (reading is not timed, as for the peer). Prints one JSON line: samples/s, step time, achieved
// GFLOP/s (forward + backward of the convolution and linear layers), the time spent in halo
// exchanges and redistributions outside compute (starting and finishing them, waiting included;
// what overlaps a layer's compute is not counted) as the most of any rank (exchange_ms: includes
// waiting for slower ranks) and on the critical rank (exchange_critical_ms: the rank with the most
// time outside communication, whom the others wait for), the halo exchanges' part of both (halo_ms,
// halo_critical_ms; the rest is redistributions), the layers whose halo exchange overlaps their
// compute, and peak memory per rank.
#include <mpi.h>
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/layers/runtime.hpp"
#include "tessera/parallel/mpi_communicator.hpp"
#include "tessera/train/executor.hpp"
#include "tessera/train/optimizer.hpp"

namespace {

/// Multiply-adds x 2 of one forward pass over `batch` samples, for conv and linear layers:
/// each output element costs one multiply-add per weight of its filter.
double forward_flops(tessera::Model& model, std::int64_t batch) {
  double flops = 0;
  for (auto& node : model.nodes()) {
    const auto type = node.layer->type();
    if (type != "conv" && type != "linear") continue;
    const auto params = node.layer->parameters();
    double weights = 1;  // the whole weight tensor, also when this rank holds a block of it
    for (auto d : params.at(0)->whole_shape()) weights *= static_cast<double>(d);
    const double outputs_per_filter = static_cast<double>(node.output.sample_numel()) / static_cast<double>(node.output[1]);
    flops += 2.0 * static_cast<double>(batch) * weights * outputs_per_filter;
  }
  return flops;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int code = 0;
  {
    auto world = tessera::MpiCommunicator::world();
    tessera::set_process_rank(world->rank());
    CLI::App app{"Tessera training-step benchmark"};
    std::string model_file;
    std::int64_t batch = 64;
    int steps = 200, warmup = 20, threads = 1;
    std::string plan_file;
    app.add_option("--model", model_file)->required();
    app.add_option("--plan", plan_file, "Plan file (default: every layer split by sample)");
    app.add_option("--batch", batch, "Global batch");
    app.add_option("--steps", steps);
    app.add_option("--warmup", warmup);
    app.add_option("--threads", threads, "Threads per rank");
    std::string halo_overlap = "auto";
    app.add_option("--halo-overlap", halo_overlap, "auto, always or never (see tessera train --help)")
        ->check(CLI::IsMember({"auto", "always", "never"}));
    int ranks_per_node = 0;
    app.add_option("--ranks-per-node", ranks_per_node,
                   "Treat blocks of this many consecutive ranks as one node (halo overlap's auto mode overlaps halos "
                   "from other nodes; 1: every rank its own node); 0: from the host names");
    std::string device_name = "host";
    app.add_option("--device", device_name,
                   "host, or cuda (a GPU per rank): where the layers run and the optimizer updates")
        ->check(CLI::IsMember({"host", "cuda"}));
    int gpu = tessera::ExecutorOptions::kNodeLocalGpu;
    app.add_option("--gpu", gpu, "with --device cuda: the GPU's index (default: the node-local rank's)");
    std::string gpu_comm = "auto";
    app.add_option("--gpu-comm", gpu_comm, "with --device cuda: auto, nccl or mpi (see tessera train --help)")
        ->check(CLI::IsMember({"auto", "nccl", "mpi"}));
    std::string bf16_convolutions = "native";
    app.add_option("--bf16-convolutions", bf16_convolutions,
                   "with --device cuda: native (bf16 tensors and results) or exact (fp32 results, TF32 tensor cores)")
        ->check(CLI::IsMember({"native", "exact"}));
    std::string precision;
    app.add_option("--precision", precision,
                   "fp32 or bf16 for the conv and linear layers (default: the model file's; bf16 also keeps the "
                   "activations that backward reads in bf16, unless the model file says 'activations: fp32')")
        ->check(CLI::IsMember({"fp32", "bf16"}));
    bool profile = false;
    app.add_flag("--profile", profile,
                 "Also print, per layer, forward, backward and exposed exchange ms per step and the CPU ms of the "
                 "rank's threads in both (the most of any rank) to stderr");
    // Switches of what a step shares or fuses, on by default as in tessera train (off: to measure
    // what each saves).
    const auto on_off = [&app](const char* name, bool& value, const char* help) {
      auto* option = app.add_option_function<std::string>(name, [&value](const std::string& v) { value = v == "on"; }, help);
      option->check(CLI::IsMember({"on", "off"}))->default_str("on");
    };
    bool in_place = true, fuse = true, into_windows = true, pooled_gradients = true;
    on_off("--in-place", in_place,
           "on: relu and leaky_relu run in place where they can (the default, as tessera train); off: every layer keeps "
           "its own output and gradient (to measure what running in place saves)");
    on_off("--fuse", fuse,
           "on: a convolution applies the leaky ReLU running in place over its output in its own pass, and max pooling "
           "does the backward of the activation running in place before it (the default, as tessera train); off: the "
           "activation runs its own passes");
    on_off("--into-windows", into_windows,
           "on: a layer whose one reader reads it through a halo window writes its output there (pooling on the host; "
           "the default, as tessera train); off: into its own tensor, which the exchange copies (to measure what "
           "writing there saves)");
    on_off("--pooled-gradients", pooled_gradients,
           "on: a convolution of the model's input computes its weight gradients from the gradient and maxima of the "
           "max pooling that reads it, whose backward is then skipped (the default with --fuse on, as tessera train); "
           "off: the pooling writes the convolution's output gradient");
    double lr = 0.01, momentum = 0.9;
    app.add_option("--momentum", momentum, "SGD momentum (0: plain SGD)");
    app.add_option("--lr", lr, "SGD learning rate (momentum 0.9); lower it for models that diverge on random data");
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      code = world->rank() == 0 ? app.exit(e) : e.get_exit_code();
      MPI_Finalize();
      return code;
    }
    try {
    tessera::LayersRuntime runtime(threads);
    tessera::ModelOptions model_options;
    if (!precision.empty()) model_options.precision = tessera::parse_precision(precision, "--precision");
    tessera::Model model = tessera::Model::load(model_file, model_options);
    model.init_parameters(1);
    tessera::ExecutorOptions options;
    options.global_batch = batch;
    options.halo_overlap = tessera::parse_halo_overlap(halo_overlap);
    options.ranks_per_node = ranks_per_node;
    options.device = device_name == "cuda" ? tessera::Device::cuda(gpu) : tessera::Device::host();
    if (gpu_comm != "auto" && device_name != "cuda")
      throw tessera::InputError("--gpu-comm " + gpu_comm + " is for --device cuda");
    options.gpu_comm = tessera::parse_gpu_comm(gpu_comm);
    if (bf16_convolutions != "native" && device_name != "cuda")
      throw tessera::InputError("--bf16-convolutions " + bf16_convolutions + " is for --device cuda");
    options.cuda.bf16_convolutions = tessera::parse_bf16_convolutions(bf16_convolutions);
    options.profile = profile;
    options.in_place = in_place;
    options.fuse = fuse;
    options.into_windows = into_windows;
    options.pooled_gradients = pooled_gradients;
    const tessera::Plan plan =
        plan_file.empty() ? tessera::Plan::sample_parallel(world->size()) : tessera::Plan::load(plan_file);
    tessera::Executor executor(model, plan, world, options);
    tessera::OptimizerConfig sgd;
    sgd.momentum = momentum;
    auto optimizer = tessera::create_optimizer(sgd);
    const auto params = model.parameters();

    const auto [begin, end] = executor.local_samples(batch);
    // This rank's tile of each sample (the whole sample unless the input layer is split spatially).
    std::vector<std::int64_t> dims{end - begin};
    for (auto d : executor.input_sample_box().extent) dims.push_back(d);
    // Class labels (softmax cross-entropy) or regression targets in [-1, 1] (mse), as the loss takes.
    std::vector<std::int64_t> target_dims{end - begin};
    for (auto d : model.target_shape().dims()) target_dims.push_back(d);
    const bool classes = model.target_shape().rank() == 0;
    tessera::Tensor inputs{tessera::Shape(dims)}, labels{tessera::Shape(target_dims)};
    for (std::int64_t i = 0; i < inputs.numel(); ++i) inputs.data()[i] = tessera::random_uniform(5, 1, static_cast<std::uint64_t>(i));
    for (std::int64_t n = 0; n < labels.numel(); ++n)
      labels.data()[n] = classes ? static_cast<float>((begin + n) % 10)
                                 : 2.0f * tessera::random_uniform(5, 2, static_cast<std::uint64_t>(n)) - 1.0f;
    // On a GPU the data stays there, as the peer's does (reading is not timed).
    inputs = inputs.to(executor.device());
    labels = labels.to(executor.device());

    using Clock = std::chrono::steady_clock;
    Clock::time_point start;
    double comm_wait = 0, exchange = 0, halo = 0;
    for (int s = 0; s < warmup + steps; ++s) {
      if (s == warmup) {
        if (!options.device.is_host()) tessera::cuda::synchronize();  // the warm-up's queued work is not timed
        world->barrier();
        start = Clock::now();
        comm_wait = 0;
        exchange = 0;
        halo = 0;
        executor.reset_layer_profile();
      }
      const tessera::BatchResult r = executor.train_step(inputs, labels, batch, s);
      comm_wait += r.comm_wait_seconds;
      exchange += r.exchange_seconds;
      halo += r.halo_seconds;
      optimizer->step(params, lr);
    }
    if (!options.device.is_host()) tessera::cuda::synchronize();  // the last optimizer update
    world->barrier();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    struct rusage usage {};
    getrusage(RUSAGE_SELF, &usage);
    const double peak_mib = world->allreduce_value(static_cast<double>(usage.ru_maxrss) / 1024.0, tessera::ReduceOp::Max);
    const double gpu_peak_gib = world->allreduce_value(
        static_cast<double>(tessera::cuda::allocator_stats().peak_bytes_in_use) / (1ull << 30), tessera::ReduceOp::Max);
    // The critical rank: the one with the most time outside communication, whom the others wait
    // for. Its exchange time is what exchanges add to the step; the others' includes waiting for it.
    const double busy = seconds - comm_wait - exchange;
    const double most_busy = world->allreduce_value(busy, tessera::ReduceOp::Max);
    const double critical_exchange =
        world->allreduce_value(busy == most_busy ? exchange : 1e300, tessera::ReduceOp::Min);
    const double critical_halo = world->allreduce_value(busy == most_busy ? halo : 1e300, tessera::ReduceOp::Min);
    halo = world->allreduce_value(halo, tessera::ReduceOp::Max);
    comm_wait = world->allreduce_value(comm_wait, tessera::ReduceOp::Max);
    exchange = world->allreduce_value(exchange, tessera::ReduceOp::Max);
    const double activation_mib = world->allreduce_value(static_cast<double>(executor.activation_bytes()) / (1 << 20),
                                                         tessera::ReduceOp::Max);
    const double scratch_mib = world->allreduce_value(static_cast<double>(executor.scratch_bytes()) / (1 << 20),
                                                      tessera::ReduceOp::Max);
    const double exchanged_mib = world->allreduce_value(
        static_cast<double>(executor.exchange_elements_per_step(batch)) * 4.0 / (1 << 20), tessera::ReduceOp::Max);
    const double overlapped = world->allreduce_value(static_cast<double>(executor.overlapped_layers(batch).size()),
                                                     tessera::ReduceOp::Max);
    const double bf16_kept = world->allreduce_value(static_cast<double>(executor.bf16_kept_layers(batch).size()),
                                                    tessera::ReduceOp::Max);
    const double window_outputs = world->allreduce_value(
        static_cast<double>(executor.window_output_layers(batch).size()), tessera::ReduceOp::Max);
    const double samples_per_s = static_cast<double>(steps * batch) / seconds;
    const double gflops = 3.0 * forward_flops(model, batch) * steps / seconds / 1e9;
    if (profile) {
      // Per layer, the most of any rank (the ranks of a split layer share its work).
      std::vector<double> times;
      for (const auto& t : executor.layer_profile())
        times.insert(times.end(), {t.forward_seconds, t.backward_seconds, t.exchange_seconds, t.cpu_seconds});
      world->allreduce(times.data(), times.size(), tessera::DType::F64, tessera::ReduceOp::Max);
      if (world->rank() == 0) {
        std::fprintf(stderr, "%-16s %12s %12s %12s %12s\n", "layer", "forward ms", "backward ms", "exchange ms",
                     "cpu ms");
        const auto& layers = executor.layer_profile();
        for (std::size_t i = 0; i < layers.size(); ++i)
          std::fprintf(stderr, "%-16s %12.2f %12.2f %12.2f %12.2f\n", layers[i].name.c_str(),
                       1e3 * times[4 * i] / steps, 1e3 * times[4 * i + 1] / steps, 1e3 * times[4 * i + 2] / steps,
                       1e3 * times[4 * i + 3] / steps);
      }
    }
    if (world->rank() == 0)
      std::printf(
          "{\"framework\": \"tessera\", \"device\": \"%s\", \"gpu_comm\": \"%s\", \"precision\": \"%s\", \"bf16_convolutions\": \"%s\", \"ranks\": %d, \"threads\": %d, \"batch\": %lld, \"samples_per_s\": %.1f, "
          "\"step_ms\": %.3f, \"comm_wait_ms\": %.3f, \"exchange_ms\": %.3f, \"exchange_critical_ms\": %.3f, \"halo_ms\": %.3f, \"halo_critical_ms\": %.3f, \"exchanged_mib\": %.2f, "
          "\"gflops\": %.2f, \"activation_mib\": %.1f, \"scratch_mib\": %.1f, \"peak_rss_mib\": %.1f, \"gpu_peak_gib\": %.2f, \"overlapped_layers\": %d, \"bf16_kept_layers\": %d, \"window_outputs\": %d}\n",
          executor.device().to_string().c_str(),
          options.device.is_host() ? "none" : executor.uses_nccl() ? "nccl" : "mpi",
          std::string(tessera::precision_name(model.precision())).c_str(),
          executor.backend().bf16_convolutions().c_str(),
          world->size(), threads, static_cast<long long>(batch), samples_per_s, 1e3 * seconds / steps,
          1e3 * comm_wait / steps, 1e3 * exchange / steps, 1e3 * critical_exchange / steps, 1e3 * halo / steps, 1e3 * critical_halo / steps, exchanged_mib, gflops, activation_mib, scratch_mib, peak_mib, gpu_peak_gib,
          static_cast<int>(overlapped), static_cast<int>(bf16_kept), static_cast<int>(window_outputs));
    } catch (const tessera::Error& e) {
      // Bad model or plan: every rank fails together (collectively); rank 0 says why.
      if (world->rank() == 0) std::fprintf(stderr, "bench_train: %s\n", e.what());
      code = 2;
    }
  }
  MPI_Finalize();
  return code;
}
