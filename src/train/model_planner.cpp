// Model -> PlannerGraph: the shapes, FLOPs, weights and spatial windows of every layer, as the
// planner (parallel/planner.hpp) sees them.
#include "tessera/train/model.hpp"

namespace tessera {

PlannerGraph Model::planner_graph(std::int64_t global_batch) const {
  PlannerGraph graph;
  graph.model = name_;
  graph.batch = global_batch;
  graph.output = output_;
  graph.bf16_activations = activations_ == Precision::BF16;
  const auto info = plan_info(global_batch);
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    const auto& n = nodes_[i];
    Layer& layer = *n.layer;
    PlannerLayer l;
    l.name = info[i].name;
    l.type = info[i].type;
    l.inputs = n.inputs;
    l.output = info[i].output;
    l.input = info[i].input;
    l.spatially_splittable = info[i].spatially_splittable;
    l.model_splittable = info[i].model_splittable;
    l.filter_splittable = info[i].filter_splittable;
    l.batch_norm = l.type == "batchnorm";
    l.traits = layer.traits();
    l.precision = layer.precision();
    l.signature = name_ + "/" + l.name + (l.precision == Precision::BF16 ? "@bf16" : "");
    for (Parameter* p : layer.parameters()) {
      std::int64_t count = 1;
      for (auto d : p->whole_shape()) count *= d;
      l.parameters += count;
    }
    l.windows = layer.spatial_windows(l.output.spatial_dims());
    if (l.type == "conv" || l.type == "linear") {
      // 2 x multiply-adds: every output element costs one multiply-add per weight of its filter.
      const auto params = layer.parameters();
      std::int64_t weights = 1;
      for (auto d : params.at(0)->whole_shape()) weights *= d;
      const double outputs_per_filter = static_cast<double>(l.output.sample_numel()) / static_cast<double>(l.output[1]);
      l.forward_flops = 2.0 * static_cast<double>(global_batch) * static_cast<double>(weights) * outputs_per_filter;
      l.has_bias = params.size() > 1;
    }
    graph.layers.push_back(std::move(l));
  }
  return graph;
}

}  // namespace tessera
