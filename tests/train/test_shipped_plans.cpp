// Every plan file shipped in plans/ validates against the model it is written for, at its rank
// count and a batch it is meant for, and every plan file there is listed here (a new plan must
// say which model it belongs to). Every model file in models/ loads.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <set>
#include <string>

#include "tessera/parallel/plan.hpp"
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

}  // namespace
}  // namespace tessera
