// Every plan file shipped in plans/ validates against the model it is written for, at its rank
// count and a batch it is meant for, and every plan file there is listed here (a new plan must
// say which model it belongs to). Every model file in models/ loads.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>

#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/planner.hpp"
#include "tessera/train/model.hpp"

namespace tessera {
namespace {

/// A model read the way tessera train reads it: shapes, no weights allocated.
ModelOptions shapes_only() {
  ModelOptions options;
  options.allocate_parameters = false;
  return options;
}

struct Use {
  std::string model;
  std::int64_t batch;
};

const std::multimap<std::string, Use> kUses = {
    {"cosmoflow_hybrid4.yaml", {"cosmoflow.yaml", 4}},
    {"cosmoflow_hybrid4.yaml", {"cosmoflow_128.yaml", 4}},
    {"cosmoflow_spatial2.yaml", {"cosmoflow.yaml", 4}},
    {"cosmoflow_spatial2.yaml", {"cosmoflow_128.yaml", 1}},
    {"cosmoflow_spatial2_deep.yaml", {"cosmoflow.yaml", 4}},
    {"cosmoflow_spatial2_deep.yaml", {"cosmoflow_128.yaml", 1}},
    {"cosmoflow_spatial4.yaml", {"cosmoflow.yaml", 4}},
    {"cosmoflow_spatial4.yaml", {"cosmoflow_128.yaml", 4}},
    {"cosmoflow_spatial4_deep.yaml", {"cosmoflow.yaml", 4}},
    {"cosmoflow_spatial4_deep.yaml", {"cosmoflow_128.yaml", 1}},
    {"fashion_2ranks.yaml", {"fashion_cnn.yaml", 64}},
    {"fashion_4ranks.yaml", {"fashion_cnn.yaml", 64}},
    {"wide_mlp_2d4.yaml", {"wide_mlp.yaml", 64}},
    {"wide_mlp_filter_channel2.yaml", {"wide_mlp.yaml", 64}},
};

TEST(ShippedPlans, EachValidatesAgainstItsModel) {
  const std::filesystem::path root(TESSERA_SOURCE_DIR);
  std::set<std::string> listed;
  for (const auto& [plan_file, use] : kUses) {
    SCOPED_TRACE(plan_file + " with " + use.model);
    listed.insert(plan_file);
    const Plan plan = Plan::load((root / "plans" / plan_file).string());
    const Model model = Model::load((root / "models" / use.model).string(), shapes_only());
    EXPECT_NO_THROW(plan.validate(plan.ranks(), model.plan_info(use.batch)));
  }
  for (const auto& entry : std::filesystem::directory_iterator(root / "plans"))
    EXPECT_TRUE(listed.count(entry.path().filename().string())) << entry.path() << " is not listed in kUses";
}

TEST(ShippedModels, EachLoads) {  // as tessera train reads them
  const std::filesystem::path root(TESSERA_SOURCE_DIR);
  int models = 0;
  for (const auto& entry : std::filesystem::directory_iterator(root / "models")) {
    SCOPED_TRACE(entry.path().string());
    EXPECT_NO_THROW(Model::load(entry.path().string(), shapes_only()));
    ++models;
  }
  EXPECT_GE(models, 7);
}

/// models/cosmoflow_128.yaml with two input channels: its first convolution makes neither its
/// pooling's output nor its gradient (those need one input channel), and pooling writing into the
/// convolutions' halo windows grows its arena a little on 2 ranks along D.
Model two_channel_cosmoflow_128() {
  std::ifstream file(std::filesystem::path(TESSERA_SOURCE_DIR) / "models" / "cosmoflow_128.yaml");
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const std::string one = "shape: [1, 128, 128, 128]";
  text.replace(text.find(one), one.size(), "shape: [2, 128, 128, 128]");
  return Model::parse(text, "cosmoflow_128 (2 channels)", shapes_only());
}

// Where the rank holds the plan only without those windows, the estimate is the one without them
// (priced and run so); where it holds neither, the least the plan needs.
TEST(ShippedPlans, APlanThatFitsOnlyWithoutHaloWindowsIsPricedWithoutThem) {
  const std::filesystem::path root(TESSERA_SOURCE_DIR);
  const Plan plan = Plan::load((root / "plans" / "cosmoflow_spatial2_deep.yaml").string());
  const PlannerGraph graph = two_channel_cosmoflow_128().planner_graph(1);
  Machine machine;
  machine.ranks_per_node = 2;
  const PlanEstimate with = CostModel(graph, machine, {.ranks = 2}).estimate(plan);
  const PlanEstimate without =
      CostModel(graph, machine, {.ranks = 2, .outputs_into_windows = false}).estimate(plan);
  ASSERT_TRUE(with.outputs_into_windows);
  ASSERT_LT(without.memory_bytes, with.memory_bytes) << "the windows no longer grow this plan's arena";
  machine.memory_per_rank = (with.memory_bytes + without.memory_bytes) / 2;
  const PlanEstimate between = CostModel(graph, machine, {.ranks = 2}).estimate(plan);
  EXPECT_TRUE(between.fits);
  EXPECT_FALSE(between.outputs_into_windows);
  EXPECT_EQ(between.memory_bytes, without.memory_bytes);
  EXPECT_GT(between.exchange, with.exchange);  // the exchanges copy the whole tiles again
  machine.memory_per_rank = 0.99 * without.memory_bytes;
  const PlanEstimate neither = CostModel(graph, machine, {.ranks = 2}).estimate(plan);
  EXPECT_FALSE(neither.fits);
  EXPECT_EQ(neither.memory_bytes, without.memory_bytes);
}

}  // namespace
}  // namespace tessera
