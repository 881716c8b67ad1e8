// Plan files, in one process: parsing (valid files and every error with its message), validation
// against a job and a model, and the YAML round trip.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <functional>
#include <ostream>
#include <string>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/tile_geometry.hpp"
#include "tessera/tensor/grid.hpp"
#include "expect_input_error.hpp"

namespace tessera {

// Readable failures for EXPECT_EQ on splits (found by argument-dependent lookup).
void PrintTo(const LayerSplit& split, std::ostream* os) { *os << split.to_string(); }

namespace {

void expect_parse_error(const std::string& yaml, const std::vector<std::string>& needles) {
  SCOPED_TRACE(yaml);
  expect_input_error([&] { (void)Plan::parse(yaml, "test.yaml"); }, needles);
}

LayerSplit split(int sample, int channel = 1, int filter = 1, std::vector<int> spatial = {}) {
  LayerSplit s;
  s.sample = sample;
  s.channel = channel;
  s.filter = filter;
  s.spatial = std::move(spatial);
  return s;
}

const char* kHybridPlan = R"(# The example of DESIGN.md
ranks: 8
default: {sample: 8}
layers:
  conv1: {sample: 2, spatial: [2, 2, 1]}   # D, H, W
  conv2:
    sample: 2
    spatial: [2, 2, 1]
  fc1:   {sample: 2, filter: 4}
  fc2:   {sample: 2, channel: 2, filter: 2}
)";

// ---------------------------------------------------------------------------------------------
// Parsing valid files

TEST(PlanParse, HybridPlan) {
  const Plan plan = Plan::parse(kHybridPlan, "hybrid.yaml");
  EXPECT_EQ(plan.ranks(), 8);
  EXPECT_EQ(plan.default_split(), split(8));
  ASSERT_EQ(plan.layer_splits().size(), 4u);
  EXPECT_EQ(plan.split_for("conv1"), split(2, 1, 1, {2, 2, 1}));
  EXPECT_EQ(plan.split_for("conv2"), split(2, 1, 1, {2, 2, 1}));
  EXPECT_EQ(plan.split_for("fc1"), split(2, 1, 4));
  EXPECT_EQ(plan.split_for("fc2"), split(2, 2, 2));
  EXPECT_EQ(plan.split_for("pool1"), split(8));  // not listed: the default
  EXPECT_EQ(plan.split_for("conv1").product(), 8);
  EXPECT_EQ(plan.split_for("conv1").spatial_product(), 4);
  EXPECT_FALSE(plan.split_for("conv1").sample_only());
  EXPECT_TRUE(plan.split_for("pool1").sample_only());
}

TEST(PlanParse, DefaultOmittedMeansSampleOverAllRanks) {
  const Plan plan = Plan::parse("ranks: 6\nlayers:\n  fc1: {sample: 3, filter: 2}\n", "p.yaml");
  EXPECT_EQ(plan.ranks(), 6);
  EXPECT_EQ(plan.default_split(), split(6));
  EXPECT_EQ(plan.split_for("fc1"), split(3, 1, 2));
}

TEST(PlanParse, MinimalAndEmptyLayers) {
  const Plan a = Plan::parse("ranks: 3\n", "a.yaml");
  EXPECT_EQ(a.ranks(), 3);
  EXPECT_EQ(a.default_split(), split(3));
  EXPECT_TRUE(a.layer_splits().empty());
  const Plan b = Plan::parse("ranks: 2\ndefault: {sample: 2}\nlayers:\n", "b.yaml");
  EXPECT_TRUE(b.layer_splits().empty());
  EXPECT_EQ(b.default_split(), split(2));
}

TEST(PlanParse, SpatialListsOfOneToThree) {
  const Plan plan = Plan::parse("ranks: 4\nlayers:\n  a: {spatial: [4]}\n  b: {spatial: [2, 2]}\n"
                                "  c: {sample: 1, spatial: [1, 2, 2]}\n",
                                "s.yaml");
  EXPECT_EQ(plan.split_for("a").spatial, (std::vector<int>{4}));
  EXPECT_EQ(plan.split_for("a").sample, 1);  // omitted keys are 1
  EXPECT_EQ(plan.split_for("b").spatial, (std::vector<int>{2, 2}));
  EXPECT_EQ(plan.split_for("c").spatial, (std::vector<int>{1, 2, 2}));
  EXPECT_EQ(plan.split_for("c").product(), 4);
}

TEST(PlanParse, SampleParallel) {
  const Plan plan = Plan::sample_parallel(5);
  EXPECT_EQ(plan.ranks(), 5);
  EXPECT_EQ(plan.default_split(), split(5));
  EXPECT_TRUE(plan.layer_splits().empty());
  EXPECT_THROW((void)Plan::sample_parallel(0), Error);
}

TEST(PlanParse, LoadsTheShippedPlans) {
  const Plan plan = Plan::load(std::string(TESSERA_SOURCE_DIR) + "/plans/fashion_4ranks.yaml");
  EXPECT_EQ(plan.ranks(), 4);
  EXPECT_EQ(plan.default_split(), split(4));
  EXPECT_EQ(plan.split_for("conv1"), split(4));
  expect_input_error([] { (void)Plan::load("/nonexistent/plan.yaml"); },
                     {"cannot open plan file '/nonexistent/plan.yaml'"});
}

// ---------------------------------------------------------------------------------------------
// Parse errors

TEST(PlanParseErrors, NotYaml) {
  expect_parse_error("ranks: [1, 2\n", {"plan file 'test.yaml' is not valid YAML"});
  expect_parse_error("ranks: 2\n  default: {sample: 2\n", {"not valid YAML"});
}

TEST(PlanParseErrors, NotAMapping) {
  expect_parse_error("- ranks\n- 2\n", {"plan file 'test.yaml'", "expected a mapping"});
  expect_parse_error("", {"expected a mapping"});
  expect_parse_error("ranks: 2\ndefault: [2]\n", {"default", "expected a mapping like {sample: 4}"});
  expect_parse_error("ranks: 2\nlayers: [conv1]\n", {"'layers' must map layer names to splits"});
  expect_parse_error("ranks: 2\nlayers:\n  conv1: 2\n", {"layer 'conv1'", "expected a mapping"});
}

TEST(PlanParseErrors, UnknownTopKey) {
  expect_parse_error("ranks: 2\nlayer:\n  conv1: {sample: 2}\n",
                     {"plan file 'test.yaml'", "unknown key 'layer'", "(known: ranks, default, layers, sync)"});
}

TEST(PlanParseErrors, UnknownSplitKey) {
  expect_parse_error("ranks: 2\ndefault: {samples: 2}\n",
                     {"plan file 'test.yaml', default", "unknown split 'samples'",
                      "(known: sample, channel, filter, spatial)"});
  expect_parse_error("ranks: 2\nlayers:\n  fc1: {sample: 1, height: 2}\n",
                     {"layer 'fc1'", "unknown split 'height'"});
}

TEST(PlanParseErrors, NonPositiveParts) {
  expect_parse_error("ranks: 0\n", {"'ranks' must be a positive integer, got 0"});
  expect_parse_error("ranks: -4\n", {"'ranks' must be a positive integer, got -4"});
  expect_parse_error("ranks: four\n", {"'ranks' must be a positive integer, got 'four'"});
  expect_parse_error("ranks: 2\ndefault: {sample: 0}\n", {"default", "'sample' must be a positive integer, got 0"});
  expect_parse_error("ranks: 2\nlayers:\n  fc1: {sample: 1, filter: -2}\n",
                     {"layer 'fc1'", "'filter' must be a positive integer, got -2"});
  expect_parse_error("ranks: 2\nlayers:\n  c: {channel: 1.5}\n", {"'channel' must be a positive integer, got '1.5'"});
  expect_parse_error("ranks: 2\nlayers:\n  conv1: {spatial: [2, 0]}\n",
                     {"layer 'conv1'", "'spatial' must be a positive integer, got 0"});
}

TEST(PlanParseErrors, BadSpatialLists) {
  const std::string expected = "'spatial' must be a list of 1 to 3 part counts";
  expect_parse_error("ranks: 2\nlayers:\n  conv1: {spatial: 2}\n", {"layer 'conv1'", expected});
  expect_parse_error("ranks: 2\nlayers:\n  conv1: {spatial: []}\n", {expected});
  expect_parse_error("ranks: 2\nlayers:\n  conv1: {spatial: [1, 1, 1, 2]}\n", {expected});
}

// Found by fuzzing (tests/fuzz/fuzz_plan.cpp): yaml-cpp's conversion errors escaped as
// YAML::TypedBadConversion, and products beyond an int overflowed (a UBSan report).
TEST(PlanParseErrors, KeysAndNamesThatAreNotWords) {
  expect_parse_error("[ranks]: 2\n", {"plan file 'test.yaml': unexpected YAML", "bad conversion"});
  expect_parse_error("ranks: 2\nlayers:\n  {a: 1}: {sample: 2}\n", {"unexpected YAML"});
  expect_parse_error("ranks: 2\ndefault: {[sample]: 2}\n", {"unexpected YAML"});
}

TEST(PlanParseErrors, SplitsBeyondAnyRankCount) {
  expect_parse_error("ranks: 2\ndefault: {sample: 65536, channel: 65536}\n",
                     {"default", "the splits multiply to more than 2147483647 ranks"});
  expect_parse_error("ranks: 2\nlayers:\n  c: {spatial: [2000, 2000, 2000]}\n", {"layer 'c'", "more than"});
}

TEST(PlanParseErrors, MissingRanks) {
  expect_parse_error("default: {sample: 2}\n", {"plan file 'test.yaml': missing 'ranks'"});
  expect_parse_error("layers:\n  fc1: {sample: 2}\n", {"missing 'ranks'"});
}

// ---------------------------------------------------------------------------------------------
// Validation against a job and a model

std::vector<PlanLayerInfo> small_cnn(std::int64_t batch = 32) {
  return {
      {"conv1", "conv", Shape::image(batch, 8, {28, 28}), Shape::image(batch, 1, {28, 28}), true, true, true},
      {"pool1", "maxpool", Shape::image(batch, 8, {14, 14}), Shape::image(batch, 8, {28, 28}), true, false, true},
      {"fc1", "linear", Shape::flat(batch, 10), Shape::flat(batch, 1568), false, true, true},
  };
}

void expect_validate_error(const std::string& yaml, int job_ranks, const std::vector<PlanLayerInfo>& layers,
                           const std::vector<std::string>& needles) {
  SCOPED_TRACE(yaml);
  const Plan plan = Plan::parse(yaml, "v.yaml");
  expect_input_error([&] { plan.validate(job_ranks, layers); }, needles);
}

TEST(PlanValidate, SampleParallelPlansPass) {
  EXPECT_NO_THROW(Plan::parse("ranks: 4\n", "v.yaml").validate(4, small_cnn()));
  EXPECT_NO_THROW(Plan::parse("ranks: 4\nlayers:\n  conv1: {sample: 4}\n  fc1: {sample: 4, spatial: [1]}\n", "v.yaml")
                      .validate(4, small_cnn()));
  EXPECT_NO_THROW(Plan::sample_parallel(32).validate(32, small_cnn()));
  EXPECT_NO_THROW(Plan::sample_parallel(3).validate(3, {}));
}

TEST(PlanValidate, RankCountMismatch) {
  expect_validate_error("ranks: 4\n", 2, small_cnn(), {"plan 'v.yaml' is for 4 ranks but the job has 2"});
}

TEST(PlanValidate, UnknownLayerListsTheLayers) {
  expect_validate_error("ranks: 2\nlayers:\n  conv9: {sample: 2}\n", 2, small_cnn(),
                        {"names layer 'conv9', which the model does not have", "(layers: conv1, pool1, fc1)"});
}

TEST(PlanValidate, ProductMismatch) {
  expect_validate_error("ranks: 4\nlayers:\n  fc1: {sample: 2}\n", 4, small_cnn(),
                        {"layer 'fc1'", "the splits {sample: 2} multiply to 2 ranks, but the plan has 4 ranks"});
  expect_validate_error("ranks: 4\ndefault: {sample: 8}\n", 4, small_cnn(),
                        {"layer 'conv1' (default split)", "multiply to 8 ranks"});
  // Without layers, the default alone is checked.
  expect_validate_error("ranks: 4\ndefault: {sample: 2}\n", 4, {}, {"default", "multiply to 2 ranks"});
}

TEST(PlanValidate, RanksWithoutAnySampleAreRefused) {
  // Batch 2 over 4 sample parts everywhere: ranks 0 and 2 would never hold a sample.
  expect_validate_error("ranks: 4\n", 4, small_cnn(2),
                        {"rank 0 holds no sample in any layer", "4 sample parts of layer 'conv1'",
                         "global batch of 2 samples", "use at most 2 sample parts in some layer"});
}

TEST(PlanValidate, MoreSamplePartsThanSamplesInSomeLayersIsAllowed) {
  // One sample split spatially, then a classifier split by sample: rank 1 idles in fc1.
  EXPECT_NO_THROW(Plan::parse("ranks: 2\ndefault: {sample: 2}\nlayers:\n  conv1: {sample: 1, spatial: [2, 1]}\n"
                              "  pool1: {sample: 1, spatial: [2, 1]}\n",
                              "v.yaml")
                      .validate(2, small_cnn(1)));
}

TEST(PlanValidate, SpatialSplitOnALayerWithoutSpatialDimensions) {
  expect_validate_error("ranks: 4\nlayers:\n  fc1: {sample: 2, spatial: [2]}\n", 4, small_cnn(),
                        {"layer 'fc1'", "a spatial split on a layer whose output [32, 10] has no spatial dimensions"});
}

TEST(PlanValidate, SpatialListLengthMismatch) {
  expect_validate_error("ranks: 4\nlayers:\n  conv1: {spatial: [4]}\n", 4, small_cnn(),
                        {"layer 'conv1'", "'spatial' has 1 entries but the layer has 2 spatial dimensions"});
  const std::vector<PlanLayerInfo> volume{
      {"conv3d", "convolution", Shape::image(8, 4, {16, 16, 16}), Shape::image(8, 1, {16, 16, 16})}};
  expect_validate_error("ranks: 4\nlayers:\n  conv3d: {spatial: [2, 2]}\n", 4, volume,
                        {"'spatial' has 2 entries but the layer has 3 spatial dimensions"});
  // A 2-D layer accepts D/H/W written with D = 1.
  EXPECT_NO_THROW(Plan::parse("ranks: 4\nlayers:\n  conv1: {spatial: [1, 2, 2]}\n  pool1: {spatial: [2, 2]}\n",
                              "v.yaml")
                      .validate(4, small_cnn()));
}

TEST(PlanValidate, SpatialAndSampleSplitsCombine) {
  EXPECT_NO_THROW(Plan::parse("ranks: 4\nlayers:\n  conv1: {sample: 2, spatial: [2, 1]}\n  pool1: {sample: 2, "
                              "spatial: [1, 2]}\n",
                              "v.yaml")
                      .validate(4, small_cnn()));
}

TEST(PlanValidate, SpatialSplitsOnlyWhereTheLayerTakesThem) {
  std::vector<PlanLayerInfo> layers = small_cnn();
  layers.push_back({"flatten", "flatten", Shape::flat(32, 1568), Shape::image(32, 8, {14, 14}), false});
  layers.back().output = Shape::image(32, 8, {14, 14});  // pretend it kept its image shape
  expect_validate_error("ranks: 2\nlayers:\n  flatten: {sample: 1, spatial: [2, 1]}\n", 2, layers,
                        {"layer 'flatten'", "a flatten layer cannot be split spatially"});
}

TEST(PlanValidate, ModelParallelSplitsOnConvAndLinearPass) {
  EXPECT_NO_THROW(Plan::parse("ranks: 4\nlayers:\n  fc1: {sample: 2, filter: 2}\n", "v.yaml").validate(4, small_cnn()));
  EXPECT_NO_THROW(Plan::parse("ranks: 4\nlayers:\n  fc1: {channel: 2, filter: 2}\n  conv1: {channel: 1, filter: 4}\n",
                              "v.yaml")
                      .validate(4, small_cnn()));
  EXPECT_NO_THROW(Plan::parse("ranks: 4\nlayers:\n  conv1: {sample: 2, filter: 2}\n  fc1: {sample: 1, channel: 4}\n",
                              "v.yaml")
                      .validate(4, small_cnn()));
}

TEST(PlanValidate, ModelParallelSplitsOnlyOnConvAndLinear) {
  expect_validate_error("ranks: 4\nlayers:\n  pool1: {sample: 2, channel: 2}\n", 4, small_cnn(),
                        {"layer 'pool1'", "a maxpool layer cannot be split by channel",
                         "conv and linear layers can be split by channel and filter; batchnorm, dropout, maxpool, "
                         "avgpool, relu and leaky_relu by filter"});
  std::vector<PlanLayerInfo> layers = small_cnn();
  layers.push_back({"flatten", "flatten", Shape::flat(32, 1568), Shape::image(32, 8, {14, 14}), false, false, false});
  expect_validate_error("ranks: 4\ndefault: {sample: 2, filter: 2}\n", 4, layers,
                        {"layer 'flatten' (default split)", "a flatten layer cannot be split by filter"});
}

TEST(PlanValidate, ChannelPartsNeedAnOutputEachForTheReduceScatter) {
  // fc1: 10 outputs in 4 filter blocks of 2 or 3: 3 channel parts leave a rank without an output.
  expect_validate_error("ranks: 12\nlayers:\n  conv1: {sample: 12}\n  pool1: {sample: 12}\n  fc1: {sample: 1, "
                        "filter: 4, channel: 3}\n",
                        12, small_cnn(), {"layer 'fc1'", "3 channel parts", "a filter block has only 2 of the 10",
                                          "use at most 2 channel parts"});
}

TEST(PlanValidate, SplitsLargerThanTheTensorAreExplained) {
  std::vector<PlanLayerInfo> layers = small_cnn();
  layers[2].input = Shape::flat(32, 6);  // fc1 takes 6 features
  expect_validate_error("ranks: 32\nlayers:\n  conv1: {spatial: [1, 32]}\n", 32, layers,
                        {"layer 'conv1'", "32 parts along spatial dimension W but the output [32, 8, 28, 28] has only 28",
                         "empty block"});
  expect_validate_error("ranks: 16\nlayers:\n  pool1: {spatial: [16, 1]}\n", 16, layers,
                        {"layer 'pool1'", "16 parts along spatial dimension H but the output [32, 8, 14, 14]"});
  expect_validate_error("ranks: 16\nlayers:\n  fc1: {sample: 1, filter: 16}\n", 16, layers,
                        {"layer 'fc1'", "16 filter parts but the layer has 10 output channels/features"});
  expect_validate_error("ranks: 8\nlayers:\n  fc1: {sample: 1, channel: 8}\n", 8, layers,
                        {"layer 'fc1'", "8 channel parts but the layer has 6 input channels/features"});
}

// ---------------------------------------------------------------------------------------------
// Round trip

void expect_same_plan(const Plan& a, const Plan& b) {
  EXPECT_EQ(a.ranks(), b.ranks());
  EXPECT_EQ(a.default_split(), b.default_split());
  EXPECT_EQ(a.layer_splits(), b.layer_splits());
}

TEST(PlanYaml, RoundTripsThroughParse) {
  const Plan plan = Plan::parse(kHybridPlan, "hybrid.yaml");
  const std::string yaml = plan.to_yaml();
  const Plan again = Plan::parse(yaml, "again.yaml");
  expect_same_plan(plan, again);
  EXPECT_EQ(again.to_yaml(), yaml);  // a fixed point
  EXPECT_NE(yaml.find("fc2: {sample: 2, channel: 2, filter: 2}"), std::string::npos) << yaml;

  for (const Plan& p : {Plan::sample_parallel(7), Plan::parse("ranks: 2\ndefault: {sample: 1, filter: 2}\n", "x")}) {
    expect_same_plan(p, Plan::parse(p.to_yaml(), "again.yaml"));
  }
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

// A plan on a multiple of its ranks: replica groups, the group outermost in every sample split, so
// that rank q of group g holds what rank q holds under the plan, for group g's block of samples.
TEST(PlanReplicaGroups, RankQOfEveryGroupHoldsRankQsShardOfItsSamples) {
  const Plan plan = Plan::parse("ranks: 2\ndefault: {sample: 2}\nlayers:\n  c: {sample: 1, spatial: [2, 1]}\n", "g.yaml");
  const Plan job = plan.for_job(6);
  EXPECT_EQ(job.ranks(), 6);
  EXPECT_EQ(job.default_split(), split(6));
  EXPECT_EQ(job.split_for("c"), split(3, 1, 1, {2, 1}));
  EXPECT_EQ(plan.for_job(2).split_for("c"), plan.split_for("c"));
  const Shape out = Shape::image(12, 4, {8, 8});
  for (const std::string layer : {"c", "other"}) {
    const LayerSplit& mine = plan.split_for(layer);
    const LayerSplit& ours = job.split_for(layer);
    for (int g = 0; g < 3; ++g)
      for (int q = 0; q < 2; ++q) {
        const Box group = output_box(ours, out, grid_coords(layer_grid(ours), 2 * g + q));
        Box alone = output_box(mine, out.with(0, 4), grid_coords(layer_grid(mine), q));
        alone.begin[0] += 4 * g;
        EXPECT_EQ(group, alone) << layer << " group " << g << " rank " << q;
      }
  }
  for (int job_ranks : {1, 3, 5})
    expect_input_error([&] { (void)plan.for_job(job_ranks); },
                       {fmt::format("plan 'g.yaml' is for 2 ranks but the job has {} ranks", job_ranks), "replica groups"});
}

}  // namespace
}  // namespace tessera
