#include "tessera/parallel/step_plan.hpp"

#include "tessera/core/error.hpp"
#include "tessera/parallel/tile_geometry.hpp"

namespace tessera {
namespace {

/// Per layer: how many layers read its output.
std::vector<int> reader_counts(const std::vector<std::vector<int>>& inputs) {
  std::vector<int> readers(inputs.size(), 0);
  for (const auto& in : inputs)
    for (int j : in)
      if (j >= 0) ++readers.at(static_cast<std::size_t>(j));
  return readers;
}

}  // namespace

std::vector<bool> in_place_candidates(const std::vector<std::vector<int>>& inputs,
                                      const std::vector<LayerTraits>& traits, int output) {
  const std::size_t n = inputs.size();
  TESSERA_CHECK(traits.size() == n, "in_place_candidates: {} layers but {} traits", n, traits.size());
  const std::vector<int> readers = reader_counts(inputs);
  std::vector<bool> candidate(n, false);
  for (std::size_t i = 0; i < n; ++i)
    candidate[i] = traits[i].runs_in_place && inputs[i].size() == 1 && inputs[i][0] >= 0 &&
                   readers[static_cast<std::size_t>(inputs[i][0])] == 1 && inputs[i][0] != output;
  return candidate;
}

std::vector<bool> window_writer_candidates(const std::vector<std::vector<int>>& inputs,
                                           const std::vector<LayerTraits>& traits, int output,
                                           const StepOptions& options, bool bf16_activations) {
  const std::size_t n = inputs.size();
  TESSERA_CHECK(traits.size() == n, "window_writer_candidates: {} layers but {} traits", n, traits.size());
  const std::vector<int> readers = reader_counts(inputs);
  std::vector<bool> candidate(n, false);
  if (!options.outputs_into_windows || bf16_activations) return candidate;
  for (std::size_t k = 0; k < n; ++k) {
    if (inputs[k].size() != 1 || inputs[k][0] < 0) continue;
    const auto j = static_cast<std::size_t>(inputs[k][0]);
    candidate[j] = traits[j].writes_into_window && !traits[j].runs_in_place && readers[j] == 1 &&
                   static_cast<int>(j) != output;
  }
  return candidate;
}

StepOptions default_step_options(bool gpu) {
  StepOptions options;
  options.fuses_zero_slope = gpu;       // the CUDA bias pass applies a plain ReLU too
  options.outputs_into_windows = !gpu;  // the GPU's pooling writes dense outputs
  options.pooled_gradients = !gpu;      // only the host's convolutions read a pooling's gradient
  return options;
}

FusionCandidates fusion_candidates(const std::vector<std::vector<int>>& inputs, const std::vector<LayerTraits>& traits,
                                   int output, const StepOptions& options) {
  const std::size_t n = inputs.size();
  FusionCandidates f{std::vector<bool>(n, false), std::vector<bool>(n, false), std::vector<int>(n, -1),
                     std::vector<int>(n, -1)};
  if (!options.fuse || !options.in_place) return f;
  const std::vector<bool> in_place = in_place_candidates(inputs, traits, output);
  const std::vector<int> readers = reader_counts(inputs);
  for (std::size_t r = 0; r < n; ++r)
    if (inputs[r].size() == 1 && inputs[r][0] >= 0 && readers[static_cast<std::size_t>(inputs[r][0])] == 1)
      f.reader[static_cast<std::size_t>(inputs[r][0])] = static_cast<int>(r);
  for (std::size_t i = 0; i < n; ++i) {
    const std::optional<float> slope = traits[i].leaky_relu_slope;
    if (!in_place[i] || !slope) continue;
    const LayerTraits& producer = traits[static_cast<std::size_t>(inputs[i][0])];
    f.forward[i] = producer.fuses_leaky_relu && (*slope != 0.0f || options.fuses_zero_slope);
    f.backward[i] = f.reader[i] >= 0 && traits[static_cast<std::size_t>(f.reader[i])].fuses_leaky_relu_backward;
  }
  if (!options.pooled_gradients) return f;
  for (std::size_t k = 0; k < n; ++k) {
    if (!traits[k].pools_in_pairs || inputs[k].size() != 1 || inputs[k][0] < 0) continue;
    int j = inputs[k][0];
    if (traits[static_cast<std::size_t>(j)].leaky_relu_slope) {  // the activation between
      if (!f.backward[static_cast<std::size_t>(j)] || f.reader[static_cast<std::size_t>(j)] != static_cast<int>(k))
        continue;
      j = inputs[static_cast<std::size_t>(j)][0];
    }
    const auto u = static_cast<std::size_t>(j);
    if (traits[u].reads_pooled_gradient && inputs[u].size() == 1 && !input_has_gradient(inputs[u][0]) &&
        readers[u] == 1 && j != output)
      f.pooled_by[k] = j;
  }
  return f;
}

bool halo_overlap_candidate(const LayerTraits& traits, const LayerSplit& split, const LayerSplit* producer) {
  if (!traits.computes_output_regions || split.spatial_product() <= 1 || split.channel > 1) return false;
  return !producer || (normalised(*producer) == normalised(split) && split.filter == 1);
}

StepPlan plan_step(const StepGraph& graph, const StepOptions& options) {
  const std::size_t n = graph.layers.size();
  std::vector<std::vector<int>> inputs;
  std::vector<LayerTraits> traits;
  for (const StepLayer& l : graph.layers) {
    TESSERA_CHECK(l.copies_input.size() == l.inputs.size() && l.input_copy_bytes.size() == l.inputs.size() &&
                      (l.copy_holds_tile.empty() || l.copy_holds_tile.size() == l.inputs.size()),
                  "plan_step: a layer with {} inputs but {} copy flags, {} copy sizes and {} tile flags",
                  l.inputs.size(), l.copies_input.size(), l.input_copy_bytes.size(), l.copy_holds_tile.size());
    inputs.push_back(l.inputs);
    traits.push_back(l.traits);
  }
  const auto reads_as_produced = [&](std::size_t i) {
    return inputs[i].size() == 1 && inputs[i][0] >= 0 && !graph.layers[i].copies_input[0];
  };

  StepPlan plan;
  // In place: a candidate that reads its input as produced and makes no partial sums.
  const std::vector<bool> candidate = in_place_candidates(inputs, traits, graph.output);
  plan.in_place.assign(n, false);
  for (std::size_t i = 0; i < n; ++i)
    plan.in_place[i] = options.in_place && candidate[i] && reads_as_produced(i) && !graph.layers[i].channel_split;

  // Fusion: a candidate running in place, its producer (forward) or its one reader (backward)
  // reading as produced and neither split by channel.
  const FusionCandidates fusion = fusion_candidates(inputs, traits, graph.output, options);
  plan.fused.assign(n, false);
  plan.leaky_relu_after.assign(n, std::nullopt);
  plan.backward_fused.assign(n, false);
  plan.leaky_relu_before.assign(n, std::nullopt);
  for (std::size_t i = 0; i < n; ++i) {
    if (!plan.in_place[i]) continue;
    const auto j = static_cast<std::size_t>(inputs[i][0]);
    if (fusion.forward[i] && !graph.layers[j].channel_split) {
      plan.fused[i] = true;
      plan.leaky_relu_after[j] = traits[i].leaky_relu_slope;
    }
    const int r = fusion.reader[i];
    if (fusion.backward[i] && reads_as_produced(static_cast<std::size_t>(r))) {
      plan.backward_fused[i] = true;
      plan.leaky_relu_before[static_cast<std::size_t>(r)] = traits[i].leaky_relu_slope;
    }
  }

  // A max pooling's backward by its convolution: every layer of the chain reads as produced, none
  // is split by channel, and the activation between (if any) is fused into the pooling's backward.
  plan.gradient_from_pooling.assign(n, -1);
  plan.pooled_by.assign(n, -1);
  for (std::size_t k = 0; k < n; ++k) {
    const int j = fusion.pooled_by[k];
    if (j < 0 || !reads_as_produced(k) || graph.layers[k].channel_split ||
        graph.layers[k].output_row < kPooledRowWindows || graph.layers[static_cast<std::size_t>(j)].channel_split)
      continue;
    const auto between = static_cast<std::size_t>(inputs[k][0]);
    if (static_cast<int>(between) != j && (!plan.backward_fused[between] || !plan.fused[between])) continue;
    plan.gradient_from_pooling[static_cast<std::size_t>(j)] = static_cast<int>(k);
    plan.pooled_by[k] = j;
  }

  // Outputs every reader copies are let go after the last reader's exchange, unless the loss or
  // the layer's own backward reads them.
  plan.release_after.assign(n, -1);
  std::vector<bool> copied_by_all(n, true);
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t a = 0; a < inputs[i].size(); ++a) {
      const int j = inputs[i][a];
      if (j < 0) continue;
      const auto u = static_cast<std::size_t>(j);
      copied_by_all[u] = copied_by_all[u] && graph.layers[i].copies_input[a];
      plan.release_after[u] = static_cast<int>(i);  // readers come later in model order
    }
  for (std::size_t j = 0; j < n; ++j)
    if (!copied_by_all[j] || static_cast<int>(j) == graph.output || plan.leaky_relu_before[j]) plan.release_after[j] = -1;

  // Outputs written into their one reader's window: a candidate, not summed from partial sums,
  // whose reader reads it through a halo window holding its whole tile.
  const std::vector<bool> writer =
      window_writer_candidates(inputs, traits, graph.output, options, graph.bf16_activations);
  std::vector<int> into_window(n, -1);
  bool any_into_window = false;
  for (std::size_t k = 0; k < n; ++k) {
    const StepLayer& reader = graph.layers[k];
    if (inputs[k].size() != 1 || inputs[k][0] < 0 || !writer[static_cast<std::size_t>(inputs[k][0])] ||
        !reader.copies_input[0] || reader.copy_holds_tile.empty() || !reader.copy_holds_tile[0] ||
        graph.layers[static_cast<std::size_t>(inputs[k][0])].channel_split)
      continue;
    into_window[static_cast<std::size_t>(inputs[k][0])] = static_cast<int>(k);
    any_into_window = true;
  }

  // The arena of the step's tensors, with the outputs in their readers' windows or apart.
  const auto arena_with = [&](const std::vector<int>& in_window, const std::vector<int>& release_after) {
    TransientGraph tensors;
    tensors.output = graph.output;
    tensors.bf16_stash = graph.bf16_activations;
    tensors.inputs = inputs;
    tensors.in_place = plan.in_place;
    for (std::size_t i = 0; i < n; ++i) {
      const StepLayer& l = graph.layers[i];
      tensors.output_bytes.push_back(l.output_bytes);
      tensors.released.push_back(release_after[i] >= 0);
      tensors.input_copy_bytes.push_back(l.input_copy_bytes);
      tensors.partial_bytes.push_back(l.partial_bytes);
      tensors.backward_reads.emplace_back(l.inputs.size(), !plan.backward_fused[i] && l.traits.backward_reads_inputs);
      tensors.reads_own_output.push_back(plan.leaky_relu_before[i].has_value());
      tensors.backward_reads_fp32.push_back(l.traits.backward_reads_fp32);
      tensors.output_in_copy.push_back(in_window[i]);
      tensors.pooled_by.push_back(plan.pooled_by[i]);
    }
    return transient_arena(tensors);
  };
  plan.output_in_window.assign(n, -1);
  plan.arena = arena_with(plan.output_in_window, plan.release_after);
  if (!any_into_window) return plan;
  // A window outlives the tile it replaces (from the producer's forward) and its gradient the
  // held one (to the producer's backward, halos and all): windows are kept while the arena grows
  // by kWindowArenaGrowth at most. All of them where that holds; else one by one, the last
  // layers' first (their tiles are small beside the early layers' gradients).
  const double bound = (1.0 + kWindowArenaGrowth) * static_cast<double>(plan.arena.layout.size);
  const auto try_windows = [&](const std::vector<int>& in_window) {
    std::vector<int> release_after = plan.release_after;
    for (std::size_t j = 0; j < n; ++j)
      if (in_window[j] >= 0) release_after[j] = -1;
    TransientArena arena = arena_with(in_window, release_after);
    if (static_cast<double>(arena.layout.size) > bound) return false;
    plan.arena = std::move(arena);
    plan.output_in_window = in_window;
    plan.release_after = std::move(release_after);
    return true;
  };
  if (try_windows(into_window)) return plan;
  std::vector<int> kept = plan.output_in_window;
  for (std::size_t j = n; j-- > 0;) {
    if (into_window[j] < 0) continue;
    kept[j] = into_window[j];
    if (!try_windows(kept)) kept[j] = -1;
  }
  return plan;
}

}  // namespace tessera
