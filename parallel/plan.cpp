#include "tessera/parallel/plan.hpp"

#include <yaml-cpp/yaml.h>

#include <climits>
#include <set>

#include "tessera/core/error.hpp"
#include "tessera/parallel/yaml_file.hpp"

namespace tessera {
namespace {

int parse_parts(const YAML::Node& node, const std::string& where, const std::string& key) {
  int value = 0;
  try {
    value = node.as<int>();
  } catch (const YAML::Exception&) {
    fail_input("{}: '{}' must be a positive integer, got '{}'", where, key, node.Scalar());
  }
  if (value < 1) fail_input("{}: '{}' must be a positive integer, got {}", where, key, value);
  return value;
}

/// The `sync:` section: its keys are SyncOptions' (checked for the job by check_sync).
SyncOptions parse_sync(const YAML::Node& node, const std::string& where) {
  if (!node.IsMap()) fail_input("{}: expected a mapping such as {{mode: local_sgd, period: 4}}", where);
  SyncOptions s;
  const auto scalar = [&](const YAML::Node& v, const std::string& key) {
    if (!v.IsScalar()) fail_input("{}: '{}' must be a value, got a list or mapping", where, key);
    return v.Scalar();
  };
  const auto number = [&](const YAML::Node& v, const std::string& key) {
    try {
      return v.as<double>();
    } catch (const YAML::Exception&) {
      fail_input("{}: '{}' must be a number, got '{}'", where, key, scalar(v, key));
    }
  };
  for (const auto& item : node) {
    const auto key = item.first.as<std::string>();
    const YAML::Node& v = item.second;
    if (key == "mode") s.mode = scalar(v, key);
    else if (key == "period") s.period = parse_parts(v, where, key);
    else if (key == "start") {
      const double step = number(v, key);
      if (!(step >= 0 && step <= 1e9) || step != static_cast<double>(static_cast<int>(step)))
        fail_input("{}: 'start' must be a step, an integer 0 or more, got '{}'", where, scalar(v, key));
      s.start = static_cast<int>(step);
    } else if (key == "outer_optimizer") s.outer_optimizer = scalar(v, key);
    else if (key == "outer_lr") s.outer_lr = number(v, key);
    else if (key == "outer_momentum") s.outer_momentum = number(v, key);
    else if (key == "easgd_alpha") s.easgd_alpha = number(v, key);
    else if (key == "topology") s.topology = scalar(v, key);
    else if (key == "quorum") s.quorum = scalar(v, key);
    else if (key == "staleness") {
      const double bound = number(v, key);
      if (!(bound >= 0 && bound <= 1e6) || bound != static_cast<double>(static_cast<int>(bound)))
        fail_input("{}: 'staleness' must be a number of steps, an integer 0 or more, got '{}'", where, scalar(v, key));
      s.staleness = static_cast<int>(bound);
    } else if (key == "staleness_range") {
      parse_staleness_range(scalar(v, key), s);
    }
    else if (key == "optimizer_state") {
      const std::string text = scalar(v, key);
      if (text != "true" && text != "false") fail_input("{}: 'optimizer_state' must be true or false, got '{}'", where, text);
      s.optimizer_state = text == "true";
    } else
      fail_input("{}: unknown key '{}' (known: mode, period, start, optimizer_state, outer_optimizer, outer_lr, "
                 "outer_momentum, easgd_alpha, topology, staleness, staleness_range, quorum)", where, key);
  }
  return s;
}

LayerSplit parse_split(const YAML::Node& node, const std::string& where) {
  if (!node.IsMap()) fail_input("{}: expected a mapping like {{sample: 4}}", where);
  LayerSplit split;
  for (const auto& item : node) {
    const auto key = item.first.as<std::string>();
    if (key == "sample") split.sample = parse_parts(item.second, where, key);
    else if (key == "channel") split.channel = parse_parts(item.second, where, key);
    else if (key == "filter") split.filter = parse_parts(item.second, where, key);
    else if (key == "spatial") {
      if (!item.second.IsSequence() || item.second.size() == 0 || item.second.size() > 3)
        fail_input("{}: 'spatial' must be a list of 1 to 3 part counts (D, H, W), e.g. [2, 2, 1]", where);
      for (const auto& p : item.second) split.spatial.push_back(parse_parts(p, where, "spatial"));
    } else {
      fail_input("{}: unknown split '{}' (known: sample, channel, filter, spatial)", where, key);
    }
  }
  // LayerSplit::product() is an int: refuse what it cannot hold (found by fuzzing).
  int product = split.sample;
  bool overflow = __builtin_mul_overflow(product, split.channel, &product) ||
                  __builtin_mul_overflow(product, split.filter, &product);
  for (int p : split.spatial) overflow = overflow || __builtin_mul_overflow(product, p, &product);
  if (overflow) fail_input("{}: the splits multiply to more than {} ranks", where, INT_MAX);
  return split;
}

}  // namespace

int LayerSplit::spatial_product() const {
  int p = 1;
  for (int s : spatial) p *= s;
  return p;
}

int LayerSplit::product() const { return sample * channel * filter * spatial_product(); }

std::string LayerSplit::to_string() const {
  std::string s = "{sample: " + std::to_string(sample);
  if (channel != 1) s += ", channel: " + std::to_string(channel);
  if (filter != 1) s += ", filter: " + std::to_string(filter);
  if (!spatial.empty()) {
    s += ", spatial: [";
    for (std::size_t i = 0; i < spatial.size(); ++i) s += (i ? ", " : "") + std::to_string(spatial[i]);
    s += "]";
  }
  return s + "}";
}

Plan Plan::sample_parallel(int ranks) {
  TESSERA_CHECK(ranks >= 1, "Plan::sample_parallel: {} ranks", ranks);
  Plan plan;
  plan.source_ = "<sample-parallel plan>";
  plan.ranks_ = ranks;
  plan.default_.sample = ranks;
  return plan;
}

Plan Plan::load(const std::string& path) {
  return parse(read_input_file(path, "plan file"), path);
}

Plan Plan::parse(const std::string& yaml_text, const std::string& source_name) {
  // yaml-cpp throws its own exceptions for shapes the checks below do not expect (a key that is a
  // list, a name that is a mapping...): still the file's fault, so still an InputError.
  try {
    return parse_unchecked(yaml_text, source_name);
  } catch (const YAML::Exception& e) {
    fail_input("plan file '{}': unexpected YAML: {}", source_name, e.what());
  }
}

Plan Plan::parse_unchecked(const std::string& yaml_text, const std::string& source_name) {
  YAML::Node root = parse_yaml_mapping(yaml_text, fmt::format("plan file '{}'", source_name),
                                       "a mapping with 'ranks', 'default' and 'layers'");
  Plan plan;
  plan.source_ = source_name;
  bool has_ranks = false, has_default = false;
  for (const auto& item : root) {
    const auto key = item.first.as<std::string>();
    if (key == "ranks") {
      plan.ranks_ = parse_parts(item.second, "plan file '" + source_name + "'", "ranks");
      has_ranks = true;
    } else if (key == "default") {
      plan.default_ = parse_split(item.second, fmt::format("plan file '{}', default", source_name));
      has_default = true;
    } else if (key == "layers") {
      if (item.second.IsNull()) continue;
      if (!item.second.IsMap()) fail_input("plan file '{}': 'layers' must map layer names to splits", source_name);
      for (const auto& layer : item.second) {
        const auto name = layer.first.as<std::string>();
        if (plan.layers_.count(name)) fail_input("plan file '{}': layer '{}' is listed twice", source_name, name);
        plan.layers_[name] = parse_split(layer.second, fmt::format("plan file '{}', layer '{}'", source_name, name));
      }
    } else if (key == "sync") {
      plan.sync_ = parse_sync(item.second, fmt::format("plan file '{}', sync", source_name));
    } else {
      fail_input("plan file '{}': unknown key '{}' (known: ranks, default, layers, sync)", source_name, key);
    }
  }
  if (!has_ranks) fail_input("plan file '{}': missing 'ranks'", source_name);
  if (!has_default) plan.default_.sample = plan.ranks_;
  return plan;
}

Plan Plan::from_splits(int ranks, LayerSplit default_split, std::map<std::string, LayerSplit> layers,
                       std::string source) {
  Plan plan;
  plan.ranks_ = ranks;
  plan.default_ = std::move(default_split);
  plan.layers_ = std::move(layers);
  plan.source_ = std::move(source);
  return plan;
}

const LayerSplit& Plan::split_for(const std::string& layer) const {
  auto it = layers_.find(layer);
  return it == layers_.end() ? default_ : it->second;
}

namespace {
constexpr const char* kSpatialNames[3] = {"D", "H", "W"};
}  // namespace

Plan Plan::replicated(int groups) const {
  TESSERA_CHECK(groups >= 1, "Plan::replicated: {} groups", groups);
  Plan plan = *this;
  plan.ranks_ = ranks_ * groups;
  plan.default_.sample *= groups;
  for (auto& [name, split] : plan.layers_) split.sample *= groups;
  return plan;
}

ReplicaPlace replica_place(int rank, int job_ranks, int groups) {
  const int per_group = job_ranks / groups;
  return {rank / per_group, rank % per_group};
}

Plan Plan::for_job(int job_ranks) const {
  if (job_ranks < ranks_ || job_ranks % ranks_ != 0)
    fail_input("plan '{}' is for {} ranks but the job has {} ranks (a job runs a plan on its ranks, or on a "
               "multiple of them as replica groups)", source_, ranks_, job_ranks);
  return job_ranks == ranks_ ? *this : replicated(job_ranks / ranks_);
}

void Plan::validate(int job_ranks, const std::vector<PlanLayerInfo>& layers) const {
  if (ranks_ != job_ranks)
    fail_input("plan '{}' is for {} ranks but the job has {} ranks", source_, ranks_, job_ranks);
  std::set<std::string> known;
  for (const auto& l : layers) known.insert(l.name);
  for (const auto& [name, split] : layers_) {
    if (!known.count(name)) {
      std::string names;
      for (const auto& l : layers) names += (names.empty() ? "" : ", ") + l.name;
      fail_input("plan '{}' names layer '{}', which the model does not have (layers: {})", source_, name, names);
    }
  }
  auto check = [&](const std::string& who, const LayerSplit& split, const PlanLayerInfo* layer) {
    if (split.product() != ranks_)
      fail_input("plan '{}', {}: the splits {} multiply to {} ranks, but the plan has {} ranks", source_, who,
                 split.to_string(), split.product(), ranks_);
    if (!layer) return;
    const Shape& out = layer->output;
    const int spatial_dims = out.spatial_dims();
    if (!split.spatial.empty() && split.spatial_product() > 1) {
      if (spatial_dims == 0)
        fail_input("plan '{}', {}: a spatial split on a layer whose output {} has no spatial dimensions", source_,
                   who, out.to_string());
      if (static_cast<int>(split.spatial.size()) != spatial_dims &&
          !(spatial_dims == 2 && split.spatial.size() == 3 && split.spatial[0] == 1))
        fail_input("plan '{}', {}: 'spatial' has {} entries but the layer has {} spatial dimensions", source_, who,
                   split.spatial.size(), spatial_dims);
    }
    const Shape& in = layer->input;
    for (std::size_t i = 0; i < split.spatial.size() && spatial_dims > 0; ++i) {
      // Spatial dimensions follow N and C; a D/H/W list on a 2-D layer starts with D = 1.
      const int dim = out.rank() - static_cast<int>(split.spatial.size()) + static_cast<int>(i);
      if (dim < 2 || split.spatial[i] == 1) continue;
      if (split.spatial[i] > out[dim])
        fail_input("plan '{}', {}: {} parts along spatial dimension {} but the output {} has only {} there, so a "
                   "rank would get an empty block",
                   source_, who, split.spatial[i], kSpatialNames[spatial_dims == 3 ? i : i + 1], out.to_string(),
                   out[dim]);
      if (in.rank() == out.rank() && split.spatial[i] > in[dim])
        fail_input("plan '{}', {}: {} parts along spatial dimension {} but the input {} has only {} there, so a "
                   "rank would get an empty block",
                   source_, who, split.spatial[i], kSpatialNames[spatial_dims == 3 ? i : i + 1], in.to_string(),
                   in[dim]);
    }
    if (split.spatial_product() > 1 && !layer->spatially_splittable)
      fail_input("plan '{}', {}: a {} layer cannot be split spatially (it needs whole samples); split it by sample "
                 "and let the executor redistribute its input",
                 source_, who, layer->type);
    if ((split.channel > 1 && !layer->model_splittable) || (split.filter > 1 && !layer->filter_splittable))
      fail_input("plan '{}', {}: a {} layer cannot be split by {} (conv and linear layers can be split by channel "
                 "and filter; batchnorm, dropout, maxpool, avgpool, relu and leaky_relu by filter); split it by sample (and "
                 "spatially) and "
                 "let the executor "
                 "redistribute its input",
                 source_, who, layer->type, split.channel > 1 ? "channel" : "filter");
    if (split.filter > 1 && (out.rank() < 2 || split.filter > out[1]))
      fail_input("plan '{}', {}: {} filter parts but the layer has {} output channels/features, so a rank "
                 "would get no filter",
                 source_, who, split.filter, out.rank() < 2 ? 0 : out[1]);
    if (split.channel > 1 && in.rank() >= 2 && split.channel > in[1])
      fail_input("plan '{}', {}: {} channel parts but the layer has {} input channels/features, so a rank "
                 "would get no channel",
                 source_, who, split.channel, in[1]);
    if (split.channel > 1 && out.rank() >= 2) {
      // The partial sums of a filter block are reduce-scattered over the channel ranks by output
      // channel: every one needs at least one.
      const std::int64_t thinnest = out[1] / split.filter;
      if (split.channel > thinnest)
        fail_input("plan '{}', {}: {} channel parts, but the partial sums are scattered over the channel ranks by "
                   "output channel/feature and a filter block has only {} of the {} outputs; use at most {} channel "
                   "parts here",
                   source_, who, split.channel, thinnest, out[1], thinnest);
    }
  };
  // More sample parts than samples leaves some ranks without samples in that layer: they idle
  // there (e.g. one huge sample split spatially, then a dense tail split by sample). If every
  // layer has more sample parts than samples, rank 0 (sample block 0 everywhere, of extent
  // batch / parts = 0) holds no sample at all: a plan that wastes ranks, refused.
  if (!layers.empty()) {
    const std::int64_t batch = layers.front().output[0];
    bool some_layer_fits = false;
    for (const auto& l : layers) some_layer_fits = some_layer_fits || split_for(l.name).sample <= batch;
    if (!some_layer_fits) {
      const auto& l = layers.front();
      fail_input("plan '{}': rank 0 holds no sample in any layer: {} sample parts of layer '{}' for a global batch of {} "
                 "samples; use at most {} sample parts in some layer (or split the large layers spatially)",
                 source_, split_for(l.name).sample, l.name, batch, batch);
    }
  }
  for (const auto& l : layers) {
    auto it = layers_.find(l.name);
    check(it == layers_.end() ? fmt::format("layer '{}' (default split)", l.name) : fmt::format("layer '{}'", l.name),
          split_for(l.name), &l);
  }
  if (layers.empty()) check("default", default_, nullptr);
}

std::string Plan::to_yaml() const {
  std::string s = fmt::format("ranks: {}\ndefault: {}\nlayers:\n", ranks_, default_.to_string());
  for (const auto& [name, split] : layers_) s += fmt::format("  {}: {}\n", name, split.to_string());
  return s + sync_.to_yaml();
}

}  // namespace tessera
