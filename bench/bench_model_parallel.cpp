// Model parallelism vs batch parallelism on a model of wide linear layers (models/wide_mlp.yaml),
// every plan in the same run: step time, and the bytes each rank sends per training step next to
// the analytic volumes of Gholami et al., "Integrated Model, Batch, and Domain Parallelism in
// Training Neural Networks" (SPAA'18), per linear layer with weights |W| = d_out x d_in, global
// batch B, and a split of s sample x f filter x c channel parts (words per rank, ring collectives):
//   batch:      gradient all-reduce          2 (s-1)/s |W|/(f c)
//   model (f):  forward all-gather of X      (f-1)/f (B/s) d_in
//               backward all-reduce of dX    2 (f-1)/f (B/s) d_in
//   model (c):  all-reduce of partial Y      2 (c-1)/c (B/s) d_out   (the 2-D extension)
// Measured: the executor's exchanges (halo/redistribution/reduce-scatter messages, exact) plus the
// gradient all-reduces as a ring sends them (2 (g-1)/g of each replica group's buffer). Memory: the
// weights and optimizer state this rank holds, and its peak resident size (VmHWM, the process's
// peak so far: bench/model_memory_bench.py runs one plan per process) against its share of the
// whole state (weights, gradients and optimizer state over the ranks). Prints one JSON line per plan
// and a table on rank 0. A benchmark, not a test.
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tessera/core/error.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/layers/runtime.hpp"
#include "tessera/parallel/mpi_communicator.hpp"
#include "tessera/train/executor.hpp"
#include "tessera/train/optimizer.hpp"

namespace {

using tessera::LayerSplit;

struct PlanCase {
  std::string name;
  std::string yaml;
};

/// The plans compared: pure batch, and model-parallel splits of every wide linear layer (and of
/// the point-wise layers between them) with the classifier by sample.
std::vector<PlanCase> plans_for(const tessera::Model& model, int p, const std::string& wanted) {
  std::vector<std::string> linear, pointwise;
  const auto out = static_cast<std::size_t>(model.output_node());
  for (std::size_t i = 0; i < model.nodes().size(); ++i) {
    const auto& layer = *model.nodes()[i].layer;
    if (i == out) continue;
    if (layer.model_splittable()) linear.push_back(layer.name());
    else if (layer.filter_splittable()) pointwise.push_back(layer.name());
  }
  auto make = [&](const std::string& name, auto split_of_linear, const std::string& pointwise_split) {
    std::string text = fmt::format("ranks: {}\ndefault: {{sample: {}}}\nlayers:\n", p, p);
    for (std::size_t k = 0; k < linear.size(); ++k) text += fmt::format("  {}: {}\n", linear[k], split_of_linear(k));
    for (const auto& l : pointwise) text += fmt::format("  {}: {}\n", l, pointwise_split);
    return PlanCase{name, text};
  };
  std::vector<PlanCase> all;
  all.push_back({"batch", fmt::format("ranks: {}\ndefault: {{sample: {}}}\n", p, p)});
  const std::string filter = fmt::format("{{sample: 1, filter: {}}}", p);
  const std::string channel = fmt::format("{{sample: 1, channel: {}}}", p);
  all.push_back(make("filter", [&](std::size_t) { return filter; }, filter));
  // Filter and channel splits alternate: a channel-split layer reads exactly the feature block
  // the filter-split layer before it wrote (no gather), and reduce-scatters its partial sums.
  all.push_back(make("filter+channel", [&](std::size_t k) { return k % 2 ? channel : filter; }, filter));
  if (p % 2 == 0 && p >= 4) {
    const std::string two_d = fmt::format("{{sample: 1, filter: 2, channel: {}}}", p / 2);
    all.push_back(make("2-D", [&](std::size_t) { return two_d; }, fmt::format("{{sample: {}}}", p)));
    const std::string hybrid = fmt::format("{{sample: 2, filter: {}}}", p / 2);
    all.push_back(make("sample x filter", [&](std::size_t) { return hybrid; }, hybrid));
  }
  if (wanted.empty()) return all;
  std::vector<PlanCase> chosen;
  for (auto& c : all)
    if (("," + wanted + ",").find("," + c.name + ",") != std::string::npos) chosen.push_back(c);
  return chosen;
}

/// This process's peak resident bytes so far (VmHWM of /proc/self/status; 0 where there is none).
double peak_resident_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return 1024.0 * std::stod(line.substr(6));
  return 0;
}

/// SPAA'18 analytic bytes per rank per step for the plan (linear layers only).
double analytic_bytes(const tessera::Model& model, const tessera::Plan& plan, std::int64_t batch) {
  double words = 0;
  for (const auto& node : model.nodes()) {
    const auto& layer = *node.layer;
    if (layer.type() != "linear") continue;
    const LayerSplit& s = plan.split_for(layer.name());
    const double d_out = static_cast<double>(node.output[1]);
    double weights = 1;
    for (auto* param : const_cast<tessera::Layer&>(layer).parameters()) {
      double n = 1;
      for (auto d : param->whole_shape()) n *= static_cast<double>(d);
      if (param->whole_shape().size() == 2) weights = n;
    }
    const double d_in = weights / d_out;
    const double b = static_cast<double>(batch) / s.sample;
    words += 2.0 * (s.sample - 1) / s.sample * weights / (s.filter * s.channel);
    words += 3.0 * (s.filter - 1) / s.filter * b * d_in;
    words += 2.0 * (s.channel - 1) / s.channel * b * d_out;
  }
  return 4.0 * words;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int code = 0;
  try {
    auto world = tessera::MpiCommunicator::world();
    tessera::set_process_rank(world->rank());
    CLI::App app{"Tessera model-parallel vs batch-parallel benchmark"};
    std::string model_file = std::string(TESSERA_SOURCE_DIR) + "/models/wide_mlp.yaml";
    std::string wanted;
    std::int64_t batch = 32;
    int steps = 5, warmup = 2, threads = 1;
    std::string optimizer_type = "sgd";
    app.add_option("--model", model_file);
    app.add_option("--plans", wanted, "Comma-separated plan names (default: all): batch, filter, filter+channel, 2-D, "
                                      "sample x filter");
    app.add_option("--batch", batch, "Global batch");
    app.add_option("--steps", steps);
    app.add_option("--warmup", warmup);
    app.add_option("--threads", threads, "Threads per rank");
    app.add_option("--optimizer", optimizer_type, "sgd (momentum 0.9) or adam");
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      code = world->rank() == 0 ? app.exit(e) : e.get_exit_code();
      MPI_Finalize();
      return code;
    }
    tessera::LayersRuntime runtime(threads);
    const int p = world->size();
    struct Row {
      std::string name;
      double step_ms, exchange_mib, grad_mib, analytic_mib, state_mib, peak_mib, share_mib;
    };
    std::vector<Row> rows;
    // Shapes only: each rank allocates and initialises its blocks after the split, as tessera train does.
    tessera::ModelOptions deferred;
    deferred.allocate_parameters = false;
    const tessera::Model probe = tessera::Model::load(model_file, deferred);
    for (const PlanCase& c : plans_for(probe, p, wanted)) {
      tessera::Model model = tessera::Model::load(model_file, deferred);
      tessera::ExecutorOptions options;
      options.init_seed = 1;
      options.global_batch = batch;
      const tessera::Plan plan = tessera::Plan::parse(c.yaml, c.name);
      tessera::Executor executor(model, plan, world, options);
      tessera::OptimizerConfig config;
      config.type = optimizer_type;
      if (optimizer_type == "sgd") config.momentum = 0.9;
      auto optimizer = tessera::create_optimizer(config);
      const auto params = model.parameters();
      const auto [begin, end] = executor.local_samples(batch);
      std::vector<std::int64_t> dims{end - begin};
      for (auto d : executor.input_sample_box().extent) dims.push_back(d);
      tessera::Tensor inputs{tessera::Shape(dims)}, labels{tessera::Shape({end - begin})};
      for (std::int64_t i = 0; i < inputs.numel(); ++i)
        inputs.data()[i] = tessera::random_uniform(5, 1, static_cast<std::uint64_t>(i));
      for (std::int64_t n = 0; n < labels.numel(); ++n) labels.data()[n] = static_cast<float>((begin + n) % 10);
      using Clock = std::chrono::steady_clock;
      Clock::time_point start;
      for (int s = 0; s < warmup + steps; ++s) {
        if (s == warmup) {
          world->barrier();
          start = Clock::now();
        }
        executor.train_step(inputs, labels, batch, s);
        optimizer->step(params, 1e-4);
      }
      world->barrier();
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      // Gradient all-reduces as a ring sends them: 2 (g-1)/g of each buffer.
      double grad_bytes = 0, state_bytes = static_cast<double>(optimizer->state_bytes()), whole_weights = 0;
      auto& nodes = model.nodes();
      for (std::size_t k = 0; k < nodes.size(); ++k)
        for (auto* param : nodes[k].layer->parameters()) {
          const double g = executor.replica_group(k, *param).size();
          grad_bytes += 2.0 * (g - 1) / g * static_cast<double>(param->grad.numel()) * 4.0;
          state_bytes += static_cast<double>(param->value.allocated_bytes());
          double n = 4.0;
          for (auto d : param->whole_shape()) n *= static_cast<double>(d);
          whole_weights += n;
        }
      // The whole state: weights, gradients and the optimizer's state (momentum: 1 copy; adam: 2).
      const double copies = 2.0 + (optimizer_type == "adam" ? 2.0 : 1.0);
      const double share = copies * whole_weights / p;
      const double mib = 1 << 20;
      Row row{c.name,
              1e3 * seconds / steps,
              world->allreduce_value(static_cast<double>(executor.exchange_elements_per_step(batch)) * 4.0,
                                     tessera::ReduceOp::Max) / mib,
              world->allreduce_value(grad_bytes, tessera::ReduceOp::Max) / mib,
              analytic_bytes(model, plan, batch) / mib,
              world->allreduce_value(state_bytes, tessera::ReduceOp::Max) / mib,
              world->allreduce_value(peak_resident_bytes(), tessera::ReduceOp::Max) / mib,
              share / mib};
      if (world->rank() == 0)
        std::printf("{\"plan\": \"%s\", \"ranks\": %d, \"batch\": %lld, \"step_ms\": %.1f, \"exchange_mib\": %.2f, "
                    "\"grad_allreduce_mib\": %.2f, \"measured_mib\": %.2f, \"spaa18_mib\": %.2f, "
                    "\"weights_and_state_mib\": %.1f, \"peak_rss_mib\": %.1f, \"state_share_mib\": %.1f}\n",
                    row.name.c_str(), p, static_cast<long long>(batch), row.step_ms, row.exchange_mib, row.grad_mib,
                    row.exchange_mib + row.grad_mib, row.analytic_mib, row.state_mib, row.peak_mib, row.share_mib);
      std::fflush(stdout);
      rows.push_back(row);
    }
    if (world->rank() == 0) {
      std::printf("\n%-16s %10s %14s %14s %14s %14s %18s %14s\n", "plan", "step ms", "exchange MiB", "grad-AR MiB",
                  "measured MiB", "SPAA'18 MiB", "weights+state MiB", "peak RSS MiB");
      for (const auto& r : rows)
        std::printf("%-16s %10.1f %14.2f %14.2f %14.2f %14.2f %18.1f %14.1f\n", r.name.c_str(), r.step_ms,
                    r.exchange_mib, r.grad_mib, r.exchange_mib + r.grad_mib, r.analytic_mib, r.state_mib, r.peak_mib);
      std::printf("(per rank per training step; %d ranks, global batch %lld)\n", p, static_cast<long long>(batch));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_model_parallel: %s\n", e.what());
    code = 1;
  }
  MPI_Finalize();
  return code;
}
