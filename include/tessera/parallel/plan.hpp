#pragma once
// Plan files: how each layer's work is split over the ranks. Pure code (no MPI): a plan can be
// parsed and checked for any rank count in one process.
//
//   ranks: 8
//   default: {sample: 8}
//   layers:
//     conv1: {sample: 2, spatial: [2, 2, 1]}   # D, H, W
//     fc1:   {sample: 2, filter: 4}
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tessera/parallel/sync.hpp"
#include "tessera/tensor/shape.hpp"

namespace tessera {

/// How one layer is split. The product of all parts is the plan's rank count.
struct LayerSplit {
  int sample = 1;
  int channel = 1;
  int filter = 1;
  /// Parts per spatial dimension, D/H/W order as written (empty: not split).
  std::vector<int> spatial;

  int product() const;
  int spatial_product() const;
  bool sample_only() const { return channel == 1 && filter == 1 && spatial_product() == 1; }
  bool operator==(const LayerSplit&) const = default;
  std::string to_string() const;
};

/// What the plan needs to know of a layer to check a split against it.
struct PlanLayerInfo {
  std::string name;
  std::string type;
  Shape output;  ///< global output shape, dimension 0 = global batch
  Shape input;   ///< global shape of the (first) input; empty when unknown
  /// Whether the layer can run on spatial tiles (convolution, pooling, batch norm, element-wise).
  bool spatially_splittable = false;
  /// Whether the layer can be split by filter and channel (convolution, linear).
  bool model_splittable = false;
  /// Whether the layer can be split by filter (the above, and batchnorm, dropout, relu, leaky_relu).
  bool filter_splittable = false;
};

/// Where rank `rank` of a job of `job_ranks` ranks sits when the job runs a plan as `groups`
/// replica groups (Plan::replicated puts the group outermost: group g is ranks [gP, (g + 1)P)).
struct ReplicaPlace {
  int group = 0;  ///< its replica group
  int rank = 0;   ///< its rank within the group, the plan's rank whose shard it holds
};
ReplicaPlace replica_place(int rank, int job_ranks, int groups);

class Plan {
 public:
  /// Every layer split by sample over `ranks`.
  static Plan sample_parallel(int ranks);
  /// Parses a plan file; errors are InputErrors naming the file and the entry.
  static Plan load(const std::string& path);
  static Plan parse(const std::string& yaml_text, const std::string& source_name);
  /// A plan from its parts (what the planner writes); `source` names it in messages.
  static Plan from_splits(int ranks, LayerSplit default_split, std::map<std::string, LayerSplit> layers,
                          std::string source);

  int ranks() const { return ranks_; }
  const LayerSplit& default_split() const { return default_; }
  /// The split of `layer` (its own entry, else the default).
  const LayerSplit& split_for(const std::string& layer) const;
  const std::map<std::string, LayerSplit>& layer_splits() const { return layers_; }
  /// How its replica groups synchronize (the plan file's `sync:` section; bsp by default).
  const SyncOptions& sync() const { return sync_; }

  /// Checks the plan against a job and a model: the rank count, every named layer exists, every
  /// split's product is the rank count and fits the layer's shape (no empty blocks), spatial
  /// splits only on layers that can take them, filter and channel splits only on convolution and
  /// linear layers and never more parts than channels/features. Throws InputError with one clear message.
  void validate(int job_ranks, const std::vector<PlanLayerInfo>& layers) const;

  std::string to_yaml() const;

  /// This plan run by `groups` replica groups, data parallel to each other: `groups` times the
  /// ranks, every split's sample parts times `groups` with the group outermost, so that rank q of
  /// every group holds the shard rank q holds under this plan, for the group's block of samples.
  Plan replicated(int groups) const;
  /// The plan a job of `job_ranks` ranks runs: this one, or replicated over job_ranks / ranks()
  /// replica groups; an InputError when job_ranks is not a multiple of ranks().
  Plan for_job(int job_ranks) const;

 private:
  /// parse() without its net for yaml-cpp's own exceptions.
  static Plan parse_unchecked(const std::string& yaml_text, const std::string& source_name);

  std::string source_ = "<plan>";
  int ranks_ = 1;
  LayerSplit default_;
  std::map<std::string, LayerSplit> layers_;
  SyncOptions sync_;
};

}  // namespace tessera
