// Replica groups: a plan of P ranks run by a job of G x P ranks (G groups, data parallel to each
// other, every gradient summed over all groups every step) computes what the 1-rank run computes,
// at 1-4 ranks; a job whose ranks are not a multiple of the plan's is refused on every rank.
#include "invariant_harness.hpp"

namespace tessera::testing {
namespace {

constexpr std::int64_t kBatch = 8;

/// A 2-rank plan of cosmo_style_model with `split` on its convolution blocks (or `layer` alone).
std::string two_rank_plan(const std::vector<std::string>& layers, const std::string& split) {
  std::string text = "ranks: 2\ndefault: {sample: 2}\nlayers:\n";
  for (const auto& layer : layers) text += fmt::format("  {}: {}\n", layer, split);
  return text;
}

/// Where the job's ranks are a multiple of the plan's, the run equals the 1-rank run; elsewhere the
/// plan is refused with a message that says why.
void expect_groups_equal_one_rank(const std::string& plan_text, int plan_ranks) {
  const std::string model = cosmo_style_model(10, "softmax_cross_entropy");
  if (ranks() % plan_ranks == 0) {
    expect_same_as_one_rank(model, plan_text, kBatch);
  } else {
    // Refused on every rank (exit code 2); rank 0 says why, the others "see rank 0".
    const std::string message = refusal(model, plan_text, kBatch);
    EXPECT_NE(message, "");
    if (MpiCommunicator::world()->rank() == 0)
      expect_message(message, {fmt::format("is for {} ranks but the job has {} ranks", plan_ranks, ranks()),
                               "replica groups"});
  }
}

TEST(ReplicaGroups, TheOneRankPlanOnEveryRank) {
  expect_groups_equal_one_rank("ranks: 1\ndefault: {sample: 1}\n", 1);
}

TEST(ReplicaGroups, GroupsOfASpatialPlan) {
  expect_groups_equal_one_rank(two_rank_plan({"conv1", "act1", "pool1", "conv2"}, "{sample: 1, spatial: [2, 1, 1]}"), 2);
}

TEST(ReplicaGroups, GroupsOfAFilterPlan) {
  expect_groups_equal_one_rank(two_rank_plan({"fc1"}, "{sample: 1, filter: 2}"), 2);
}

TEST(ReplicaGroups, GroupsOfAChannelPlan) {
  expect_groups_equal_one_rank(two_rank_plan({"conv2"}, "{sample: 1, channel: 2}"), 2);
}

}  // namespace
}  // namespace tessera::testing
