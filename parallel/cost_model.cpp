// The planner's cost model: what one training step costs a rank under a plan (see planner.hpp):
// each layer's compute, its step terms and the plan's memory; the exchanges and the step's tensors
// are priced in cost_model_tiles.cpp.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <utility>

#include "parallel/cost_model_internal.hpp"
#include "tessera/core/error.hpp"
#include "tessera/parallel/planner.hpp"
#include "tessera/parallel/step_plan.hpp"
#include "tessera/parallel/tile_exchange.hpp"
#include "tessera/parallel/tile_geometry.hpp"
#include "tessera/tensor/box.hpp"
#include "tessera/tensor/grid.hpp"

namespace tessera {

using namespace cost_detail;

std::vector<PlanLayerInfo> PlannerGraph::plan_info() const {
  std::vector<PlanLayerInfo> info;
  for (const auto& l : layers)
    info.push_back({l.name, l.type, l.output, l.input, l.spatially_splittable, l.model_splittable,
                    l.filter_splittable});
  return info;
}

std::vector<std::vector<int>> PlannerGraph::inputs() const {
  std::vector<std::vector<int>> in;
  for (const auto& l : layers) in.push_back(l.inputs);
  return in;
}

std::vector<LayerTraits> PlannerGraph::traits() const {
  std::vector<LayerTraits> t;
  for (const auto& l : layers) t.push_back(l.traits);
  return t;
}

std::string Workload::key(const PlannerGraph& graph) const {
  std::string extents;
  for (auto e : output_extent) {
    if (!extents.empty()) extents.push_back('x');
    extents.append(std::to_string(e));
  }
  return fmt::format("{}|n{}|o{}|f{}c{}|t{}|r{}", graph.layers.at(static_cast<std::size_t>(layer)).signature, samples,
                     extents.empty() ? "-" : extents, filter_parts, channel_parts, threads, ranks_on_node);
}

CostModel::CostModel(const PlannerGraph& graph, const Machine& machine, PlannerOptions options)
    : graph_(graph), machine_(machine), options_(options), intra_(machine.intra_for(options.ranks)) {
  if (options_.ranks < 1) fail_input("the planner needs at least 1 rank, got {}", options_.ranks);
  const std::int64_t capacity = static_cast<std::int64_t>(machine_.nodes) * machine_.ranks_per_node;
  if (options_.ranks > capacity)
    fail_input("machine '{}' has {} nodes x {} ranks per node = {} ranks; cannot plan for {}", machine_.name,
               machine_.nodes, machine_.ranks_per_node, capacity, options_.ranks);
  const std::vector<std::vector<int>> inputs = graph_.inputs();
  const std::vector<LayerTraits> traits = graph_.traits();
  may_run_in_place_ = in_place_candidates(inputs, traits, graph_.output);
  may_write_into_window_ =
      window_writer_candidates(inputs, traits, graph_.output, step_options(), graph_.bf16_activations);
  fusion_ = fusion_candidates(inputs, traits, graph_.output, step_options());
}

Workload CostModel::workload(int layer, const LayerSplit& split) const {
  const auto& l = graph_.layers.at(static_cast<std::size_t>(layer));
  Workload w;
  w.layer = layer;
  w.samples = std::max<std::int64_t>(1, ceil_div(l.output[0], split.sample));
  const int dims = l.output.spatial_dims();
  const auto parts = spatial_parts(split, dims);
  for (int j = 0; j < dims; ++j)
    w.output_extent.push_back(ceil_div(l.output[j + 2], parts[static_cast<std::size_t>(j)]));
  w.filter_parts = split.filter;
  w.channel_parts = split.channel;
  w.threads = machine_.threads_per_rank(options_.ranks);
  w.ranks_on_node = machine_.ranks_on_node(options_.ranks);
  return w;
}

bool CostModel::gpu_bf16_convolution(const PlannerLayer& l) const {
  // bf16_flops: the machine has bf16 tensor cores (compute capability 8.0 and newer); without
  // them the executor runs bf16 convolutions Exact, at the fp32 rate.
  return machine_.device == "gpu" && machine_.bf16_flops > 0 && l.type == "conv" && l.precision == Precision::BF16;
}

bool CostModel::exact_on_tf32(const PlannerLayer& l) const {
  return gpu_bf16_convolution(l) && options_.exact_bf16_convolutions;
}

LayerEstimate CostModel::layer_cost(int layer, const LayerSplit& split) const {
  const auto& l = graph_.layers.at(static_cast<std::size_t>(layer));
  const int P = options_.ranks;
  LayerEstimate e;
  e.name = l.name;
  e.split = split;
  const Workload w = workload(layer, split);
  // Local output elements (the largest tile) and input elements read (window included).
  const std::int64_t filters = l.output.rank() > 1 ? l.output[1] : 1;
  const std::int64_t filter_block = ceil_div(filters, split.filter);
  double out_local = static_cast<double>(w.samples) * static_cast<double>(filter_block);
  double in_local = static_cast<double>(w.samples);
  double spatial_share = 1;  // local output positions / global output positions
  for (std::size_t j = 0; j < w.output_extent.size(); ++j) {
    out_local *= static_cast<double>(w.output_extent[j]);
    spatial_share *= static_cast<double>(w.output_extent[j]) / static_cast<double>(l.output[static_cast<int>(j) + 2]);
    // The window of the tile, at most the whole (padded) input.
    const auto& win = l.windows.at(j);
    std::int64_t window = (w.output_extent[j] - 1) * win.stride + win.kernel;
    const int d = static_cast<int>(j) + 2;
    if (l.input.rank() > d) window = std::min(window, l.input[d] + 2 * win.pad);
    in_local *= static_cast<double>(window);
  }
  const std::int64_t in_channels = l.input.rank() > 1 ? l.input[1] : 1;
  const double channels_read = static_cast<double>(l.model_splittable ? ceil_div(in_channels, split.channel)
                                                   : split.filter > 1 ? ceil_div(in_channels, split.filter)
                                                                      : in_channels);
  // The layer's block of its input (unpadded) and whether it reads more than that (halos, padding).
  double block = static_cast<double>(w.samples) * channels_read;
  in_local *= channels_read;
  // Input dimensions the output does not have (flatten): read whole.
  for (int d = 2 + static_cast<int>(w.output_extent.size()); d < l.input.rank(); ++d) {
    in_local *= static_cast<double>(l.input[d]);
    block *= static_cast<double>(l.input[d]);
  }
  const auto parts = spatial_parts(split, static_cast<int>(w.output_extent.size()));
  // Uneven blocks: a block's window is cut by its outputs, its producer's block by its inputs,
  // and the two part ways (a pooling layer's input blocks no longer line up) unless each output
  // reads its own position only (a point-wise layer's blocks are its producer's).
  bool uneven = false;
  for (std::size_t j = 0; j < w.output_extent.size(); ++j) {
    const int d = static_cast<int>(j) + 2;
    if (l.input.rank() <= d) continue;
    block *= static_cast<double>(ceil_div(l.input[d], parts[j]));
    const bool point_wise = j < l.windows.size() && l.windows[j] == SpatialWindow{};
    if (parts[j] > 1 && l.input[d] % parts[j] != 0 && !point_wise) uneven = true;
  }
  const bool tiled = split.spatial_product() > 1;
  // What the layer reads, and what a copy of its input holds when it makes one: a spatially split
  // layer's window (its block grown by the halo, padding included), else its block.
  const double read = tiled ? in_local : block;
  e.input_bytes = kBytes * read;
  e.halo = tiled && (in_local != block || uneven);
  e.gathers = gathers_channels(layer, split);
  // A channel-split layer computes a partial sum of its filter block (out_local) and keeps its
  // channel rank's sub-block of the reduced output.
  e.partial_bytes = split.channel > 1 ? kBytes * out_local : 0.0;
  e.output_bytes = kBytes * out_local / static_cast<double>(filter_block) *
                   static_cast<double>(ceil_div(filter_block, split.channel));

  // This rank's block of the weights (a bias follows the filter split only: every channel rank
  // of a channel split holds its filter block's).
  const std::int64_t bias_elements = l.has_bias ? filters : 0;
  const double params_local = static_cast<double>(l.parameters - bias_elements) / (split.filter * split.channel) +
                              static_cast<double>(bias_elements) / split.filter;

  // bf16 operands (conv and linear): what the executor's kernels round: the input as the layer
  // reads it, and the weights without the bias (filters x input channels x kernel volume, the
  // largest block).
  const bool rounds = l.precision == Precision::BF16 && (l.type == "conv" || l.type == "linear");
  const double rounded_weights =
      rounds ? static_cast<double>(l.parameters - bias_elements) / static_cast<double>(filters * in_channels) *
                   static_cast<double>(filter_block) * static_cast<double>(ceil_div(in_channels, split.channel))
             : 0.0;

  // Compute: a calibrated timing of exactly this workload, else the roofline. On GPUs a bf16
  // convolution is timed as it runs by default, on bf16 tensors (tessera calibrate --device
  // cuda): run exact (--bf16-convolutions exact), it takes the roofline at its own rate.
  const auto found = exact_on_tf32(l) ? machine_.kernels.end() : machine_.kernels.find(w.key(graph_));
  bool shares_cores = true;  // whether the largest tile's rank shares its cores with peers
  if (found != machine_.kernels.end()) {
    e.compute = found->second;
    e.measured = true;
    const int on_node = machine_.ranks_on_node(P);
    if (machine_.device == "cpu" && on_node > machine_.cores_per_node) {
      // Timed with every rank of the node running this (the largest) tile: on an oversubscribed
      // node the cores are shared, so when the tiles are uneven the step takes the node's total
      // work over its cores, or the largest tile on a core of its own, whichever is longer.
      double balance = 1;
      auto share = [&](std::int64_t extent, int n) {
        return static_cast<double>(extent) / n / static_cast<double>(std::max<std::int64_t>(1, ceil_div(extent, n)));
      };
      balance *= share(l.output[0], split.sample);
      if (l.output.rank() > 1) balance *= share(l.output[1], split.filter);
      for (std::size_t j = 0; j < w.output_extent.size(); ++j)
        balance *= share(l.output[static_cast<int>(j) + 2], parts[j]);
      const double own_core = static_cast<double>(machine_.cores_per_node) / on_node;
      e.compute *= std::max(own_core, balance);
      // The largest tile on a core of its own is the last to finish: no peer keeps it waiting.
      shares_cores = balance > own_core * (1 + 1e-9);
    }
  } else {
    const double sample_share = static_cast<double>(w.samples) / static_cast<double>(std::max<std::int64_t>(1, l.output[0]));
    // A layer reading only the model's input computes no input gradient: its backward is the
    // weight gradient alone.
    const bool reads_model_input = std::none_of(l.inputs.begin(), l.inputs.end(), input_has_gradient);
    const double backward_passes = reads_model_input ? 1.0 : 2.0;
    const double forward = l.forward_flops * sample_share * spatial_share / (split.filter * split.channel);
    const double flops = (1.0 + backward_passes) * forward;
    // Forward reads the input and writes the output; backward reads both and the output gradient
    // and writes the input gradient.
    const double bytes = kBytes * (2.0 * in_local + 3.0 * out_local);
    // Exact bf16 convolutions on GPUs run on TF32 tensor cores: half the bf16 rate.
    const double tf32 = exact_on_tf32(l) ? 0.5 : 1.0;
    // The machine file's efficiency of this kernel class, per pass, where it gives one; a
    // convolution reading the model's input (few channels: libraries reach a few per cent of the
    // peak there) has a class of its own, where the file names it.
    const std::string kernel_class = machine_.efficiency.empty() ? std::string()
                                     : l.type == "linear"            ? "gemm"
                                     : l.type == "conv" ? fmt::format("conv{}d{}", l.output.spatial_dims(),
                                                                      reads_model_input ? "_first" : "")
                                                        : std::string();
    const double forward_rate = machine_.class_flops(P, kernel_class, false, l.precision) * tf32;
    const double backward_rate = machine_.class_flops(P, kernel_class, true, l.precision) * tf32;
    const double seconds = forward_rate > 0 && backward_rate > 0
                               ? forward / forward_rate + backward_passes * forward / backward_rate
                               : flops / (machine_.rank_flops(P, l.precision) * tf32);
    e.compute = std::max(seconds, bytes / machine_.rank_memory_bandwidth(P)) + 2.0 * machine_.kernel_overhead;
    if (rounds) {
      // Passes of their own that round the operands (each element read and written): the input
      // twice (forward, weight gradient), the output gradient and the weights (forward, input
      // gradient).
      e.compute += 2.0 * kBytes * (2.0 * read + out_local + 2.0 * rounded_weights) /
                   machine_.rank_memory_bandwidth(P);
    }
  }

  // A leaky ReLU the step plan may fuse: those passes run inside its producer's and reader's.
  const auto i = static_cast<std::size_t>(layer);
  if (fusion_.forward[i]) e.fused_forward = kFusedForwardShare * e.compute;
  if (fusion_.backward[i]) e.fused_backward = (1.0 - kFusedForwardShare) * e.compute;
  e.compute -= e.fused_forward + e.fused_backward;
  // A max pooling whose forward and backward the convolution it reads may do.
  if (fusion_.pooled_by[i] >= 0) e.by_convolution = kPooledByConvolutionShare * e.compute;
  e.compute -= e.by_convolution;

  // Model-parallel communication of a channel split: the partial sums of the filter block are
  // reduce-scattered over the channel ranks (forward) and the output gradient gathered back
  // (backward), point to point within the channel group.
  const int rpn = machine_.ranks_on_node(P);
  if (split.channel > 1) {
    const int c = split.channel;
    const double partial = kBytes * out_local;
    // The channel group's ranks are adjacent in the grid unless spatial parts sit between them.
    const int stride = std::max(1, split.spatial_product());
    const AlphaBeta& ab = stride * c > rpn ? machine_.inter.p2p : intra_.p2p;
    // The partial sums' box is copied in and out; a run per sample and filter plane (per sample
    // for a dense layer's rows).
    const double runs = static_cast<double>(w.samples) * (w.output_extent.empty() ? 1.0 : static_cast<double>(filter_block));
    e.model_comm += 2.0 * ((c - 1) * ab.alpha + (c - 1.0) / c * partial * ab.beta +
                           machine_.box_copy_seconds(P, partial, runs) + machine_.sync_wait_for(P));
  }
  // Batch-norm statistics: an allreduce of 2 x channels values forward and one backward over the
  // sample x spatial group.
  if (l.batch_norm) {
    const int g = P / (split.filter * split.channel);
    const double bytes = kBytes * 2.0 * static_cast<double>(ceil_div(l.output[1], split.filter));
    const AlphaBeta& ab = P > rpn ? machine_.inter.allreduce : intra_.allreduce;
    if (g > 1) {
      e.model_comm += 2.0 * (allreduce_time(ab, g, bytes) + machine_.sync_wait_for(P));
    }
  }
  // Its work, waited for once at the next blocking exchange (its own, a later layer's, or the
  // step's closing loss allreduce): a descheduled peer is late by a share of it.
  if (P > 1 && shares_cores) e.wait = machine_.sync_wait_share_for(P) * e.compute;

  // Gradient allreduce of the weight blocks over the ranks with the same filter and channel
  // coordinates (sample x spatial); it spans nodes when the group's last rank is off node 0.
  {
    const int g = P / (split.filter * split.channel);
    const int span = (split.sample - 1) * split.filter * split.channel * split.spatial_product() +
                     (split.spatial_product() - 1) + 1;
    const AlphaBeta& ab = span > rpn ? machine_.inter.allreduce : intra_.allreduce;
    if (l.parameters > 0) e.grad_allreduce = allreduce_time(ab, g, kBytes * params_local);
  }

  // The optimizer reads weights, gradients and state and writes weights and state.
  e.optimizer = kBytes * params_local * (3.0 + 2.0 * options_.optimizer_state) / machine_.rank_memory_bandwidth(P);
  // Memory: weights, their gradients and optimizer state; the saved output and input window.
  e.memory = kBytes * params_local * (2.0 + options_.optimizer_state) + e.output_bytes + e.input_bytes;
  if (rounds) {
    // On GPUs with bf16 tensor cores convolutions keep the operands and results as bf16
    // (Bf16Convolutions::Native, the executor's default there): 2 bytes an element, where the
    // host (and Exact) keeps rounded fp32 copies.
    const bool native = gpu_bf16_convolution(l) && !options_.exact_bf16_convolutions;
    const double element = native ? 2.0 : kBytes;
    e.scratch_input = element * read;
    e.scratch_output = element * out_local;
    e.scratch_weights = element * rounded_weights;
    e.scratch_of_linear = l.type == "linear";
  }
  return e;
}

void CostModel::finish(PlanEstimate& estimate, const StepPlan* step) const {
  const int P = options_.ranks;
  estimate.compute = estimate.exchange = estimate.model_comm = estimate.wait = estimate.grad_allreduce = 0;
  double optimizer = 0, last_grad = 0;
  for (const auto& l : estimate.layers) {
    optimizer += l.optimizer;
    estimate.compute += l.compute;
    estimate.exchange += l.exchange;
    estimate.model_comm += l.model_comm;
    estimate.wait += l.wait;
    estimate.grad_allreduce += l.grad_allreduce;
    if (l.grad_allreduce > 0) last_grad = l.grad_allreduce;  // the first layer's: reduced last
  }
  // Backward (two thirds of the compute) hides grad_overlap of itself; the last bucket never hides.
  const double hideable = std::max(0.0, estimate.grad_allreduce - last_grad);
  const double hidden = std::min(hideable, machine_.grad_overlap * estimate.compute * 2.0 / 3.0);
  estimate.grad_exposed = estimate.grad_allreduce - hidden;
  // The loss allreduce, and the optimizer's pass over weights, gradients and state.
  const int rpn = machine_.ranks_on_node(P);
  // The loss allreduce and the wait for the last gradient bucket are blocking.
  const double waits = P > 1 ? machine_.sync_wait_for(P) * (estimate.grad_allreduce > 0 ? 2.0 : 1.0) : 0.0;
  estimate.other = allreduce_time(P > rpn ? machine_.inter.allreduce : intra_.allreduce, P, 16) + optimizer + waits;
  estimate.other += machine_.step_overhead_seconds();
  estimate.step_seconds =
      estimate.compute + estimate.exchange + estimate.model_comm + estimate.wait + estimate.grad_exposed + estimate.other;
  estimate.memory_bytes = memory_bytes(estimate, &estimate.scratch_bytes, step);
  estimate.fits = estimate.memory_bytes <= machine_.memory_per_rank;
}

double CostModel::memory_bytes(const PlanEstimate& estimate, double* scratch_bytes, const StepPlan* step) const {
  double memory = 0;
  double scratch_input[2] = {0, 0}, scratch_output[2] = {0, 0}, scratch_weights[2] = {0, 0};  // conv, linear
  for (const auto& l : estimate.layers) {
    const int kind = l.scratch_of_linear ? 1 : 0;
    scratch_input[kind] = std::max(scratch_input[kind], l.scratch_input);
    scratch_output[kind] = std::max(scratch_output[kind], l.scratch_output);
    scratch_weights[kind] = std::max(scratch_weights[kind], l.scratch_weights);
    memory += l.memory - l.output_bytes - l.input_bytes;  // weights, gradients, optimizer state
  }
  // Activations and their transient gradients; and the bf16 operands' scratch.
  double scratch = 0;
  for (int kind : {0, 1}) scratch += scratch_input[kind] + scratch_output[kind] + scratch_weights[kind];
  if (scratch_bytes) *scratch_bytes = scratch;
  return memory + activation_bytes(estimate, step) + scratch;
}

PlanEstimate CostModel::estimate(const Plan& plan) const {
  PlanEstimate e = estimate_as_set(plan);
  if (e.fits || !step_options().outputs_into_windows) return e;
  if (!without_windows_) {
    PlannerOptions apart = options_;
    apart.outputs_into_windows = false;
    without_windows_ = std::make_unique<CostModel>(graph_, machine_, apart);
  }
  PlanEstimate without = without_windows_->estimate_as_set(plan);
  without.outputs_into_windows = false;
  return without.fits || without.memory_bytes < e.memory_bytes ? without : e;
}

PlanEstimate CostModel::estimate_as_set(const Plan& plan) const {
  plan.validate(options_.ranks, graph_.plan_info());
  PlanEstimate e;
  for (std::size_t i = 0; i < graph_.layers.size(); ++i) {
    const auto& l = graph_.layers[i];
    LayerSplit split = plan.split_for(l.name);
    split.spatial = split.spatial_product() > 1 ? spatial_parts(split, l.output.spatial_dims()) : std::vector<int>{};
    LayerEstimate le = layer_cost(static_cast<int>(i), split);
    for (int input : l.inputs) {
      LayerSplit held;
      if (input >= 0) {
        held = plan.split_for(graph_.layers[static_cast<std::size_t>(input)].name);
        const int dims = graph_.layers[static_cast<std::size_t>(input)].output.spatial_dims();
        held.spatial = held.spatial_product() > 1 ? spatial_parts(held, dims) : std::vector<int>{};
      }
      le.exchange += exchange_cost(input, held, static_cast<int>(i), split);
    }
    e.layers.push_back(std::move(le));
  }
  // Exchanges priced with the producer's tile in the window where the step plan keeps it apart
  // (its arena would grow too much): priced again with the copy.
  const StepPlan step = step_plan(e);
  for (std::size_t i = 0; i < graph_.layers.size(); ++i) {
    const auto& inputs = graph_.layers[i].inputs;
    if (inputs.size() != 1 || inputs[0] < 0) continue;
    const auto j = static_cast<std::size_t>(inputs[0]);
    const LayerSplit& held = e.layers[j].split;
    const LayerSplit& split = e.layers[i].split;
    if (!into_window(inputs[0], held, static_cast<int>(i), split) || step.output_in_window[j] == static_cast<int>(i))
      continue;
    e.layers[i].exchange += exchange_cost(inputs[0], held, static_cast<int>(i), split, /*windows=*/false) -
                            exchange_cost(inputs[0], held, static_cast<int>(i), split);
  }
  // Fused work that the step plan does not fuse after all, back on its layer.
  for (std::size_t i = 0; i < graph_.layers.size(); ++i) {
    LayerEstimate& le = e.layers[i];
    if (!step.fused[i]) le.compute += std::exchange(le.fused_forward, 0.0);
    if (!step.backward_fused[i]) le.compute += std::exchange(le.fused_backward, 0.0);
    if (step.pooled_by[i] < 0) le.compute += std::exchange(le.by_convolution, 0.0);
  }
  finish(e, &step);
  return e;
}

std::string format_estimate(const PlanEstimate& e) {
  std::string s = fmt::format("{:<14} {:<34} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}\n", "layer", "split",
                              "compute ms", "exch. ms", "model ms", "wait ms", "grad ms", "mem MiB");
  for (const auto& l : e.layers)
    s += fmt::format("{:<14} {:<34} {:>9.3f}{} {:>10.3f} {:>10.3f} {:>10.3f} {:>10.3f} {:>10.1f}\n", l.name,
                     l.split.to_string(), 1e3 * l.compute, l.measured ? "m" : "r", 1e3 * l.exchange,
                     1e3 * l.model_comm, 1e3 * l.wait, 1e3 * l.grad_allreduce, l.memory / (1 << 20));
  s += fmt::format(
      "step {:.3f} ms = compute {:.3f} + exchange {:.3f} + model {:.3f} + waits for late peers {:.3f} + exposed "
      "gradient allreduce {:.3f} (of {:.3f}) + loss/optimizer {:.3f}; memory per rank {:.1f} MiB{}\n",
      1e3 * e.step_seconds, 1e3 * e.compute, 1e3 * e.exchange, 1e3 * e.model_comm, 1e3 * e.wait, 1e3 * e.grad_exposed,
      1e3 * e.grad_allreduce, 1e3 * e.other, e.memory_bytes / (1 << 20),
      !e.fits                  ? " (does NOT fit)"
      : e.outputs_into_windows ? ""
                               : " (fits only with no output written into a halo window: priced and run so)");
  s += "(compute: m = calibrated timing of this workload, r = roofline of the machine file; mem: the layer's "
       "weights, their gradients and optimizer state, its output and input while it runs; memory per rank counts "
       "each tensor once, the step's activations and gradients in one arena by their lifetimes)\n";
  return s;
}

}  // namespace tessera
