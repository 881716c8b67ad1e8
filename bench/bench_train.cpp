// Training-step throughput of a model under a sample-parallel plan, on in-memory data (reading is
// not timed, as for the peer). Prints one JSON line: samples/s, step time, achieved GFLOP/s
// (forward + backward of the convolution and linear layers) and peak memory per rank.
#include <mpi.h>
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

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
    const double weights = static_cast<double>(params.at(0)->value.numel());
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
    app.add_option("--model", model_file)->required();
    app.add_option("--batch", batch, "Global batch");
    app.add_option("--steps", steps);
    app.add_option("--warmup", warmup);
    app.add_option("--threads", threads, "Threads per rank");
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      code = world->rank() == 0 ? app.exit(e) : e.get_exit_code();
      MPI_Finalize();
      return code;
    }
    tessera::LayersRuntime runtime(threads);
    tessera::Model model = tessera::Model::load(model_file);
    model.init_parameters(1);
    tessera::ExecutorOptions options;
    options.global_batch = batch;
    tessera::Executor executor(model, tessera::Plan::sample_parallel(world->size()), world, options);
    tessera::OptimizerConfig sgd;
    sgd.momentum = 0.9;
    auto optimizer = tessera::create_optimizer(sgd);
    const auto params = model.parameters();

    const auto [begin, end] = executor.local_samples(batch);
    std::vector<std::int64_t> dims{end - begin};
    for (auto d : model.sample_shape().dims()) dims.push_back(d);
    tessera::Tensor inputs{tessera::Shape(dims)}, labels{tessera::Shape({end - begin})};
    for (std::int64_t i = 0; i < inputs.numel(); ++i) inputs.data()[i] = tessera::random_uniform(5, 1, static_cast<std::uint64_t>(i));
    for (std::int64_t n = 0; n < labels.numel(); ++n) labels.data()[n] = static_cast<float>((begin + n) % 10);

    using Clock = std::chrono::steady_clock;
    Clock::time_point start;
    double comm_wait = 0;
    for (int s = 0; s < warmup + steps; ++s) {
      if (s == warmup) {
        world->barrier();
        start = Clock::now();
        comm_wait = 0;
      }
      comm_wait += executor.train_step(inputs, labels, batch, s).comm_wait_seconds;
      optimizer->step(params, 0.01);
    }
    world->barrier();
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    struct rusage usage {};
    getrusage(RUSAGE_SELF, &usage);
    const double peak_mib = world->allreduce_value(static_cast<double>(usage.ru_maxrss) / 1024.0, tessera::ReduceOp::Max);
    comm_wait = world->allreduce_value(comm_wait, tessera::ReduceOp::Max);
    const double samples_per_s = static_cast<double>(steps * batch) / seconds;
    const double gflops = 3.0 * forward_flops(model, batch) * steps / seconds / 1e9;
    if (world->rank() == 0)
      std::printf(
          "{\"framework\": \"tessera\", \"ranks\": %d, \"threads\": %d, \"batch\": %lld, \"samples_per_s\": %.1f, "
          "\"step_ms\": %.3f, \"comm_wait_ms\": %.3f, \"gflops\": %.2f, \"peak_rss_mib\": %.1f}\n",
          world->size(), threads, static_cast<long long>(batch), samples_per_s, 1e3 * seconds / steps, 1e3 * comm_wait / steps, gflops, peak_mib);
  }
  MPI_Finalize();
  return code;
}
