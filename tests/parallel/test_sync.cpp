// Synchronization options: the plan file's sync: section, the command line over it key by key,
// and every check of check_sync (each message names the option).
#include <gtest/gtest.h>

#include "expect_input_error.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/parallel/delayed_communicator.hpp"
#include "tessera/parallel/straggler.hpp"
#include "tessera/parallel/sync.hpp"

namespace tessera {
namespace {

TEST(SyncOptions, ThePlanFileSectionAndTheCommandLineOverIt) {
  const Plan plan = Plan::parse("ranks: 1\nsync: {mode: diloco, period: 16, outer_lr: 0.7, outer_optimizer: nesterov}\n",
                                "s.yaml");
  EXPECT_EQ(plan.sync().mode, "diloco");
  EXPECT_EQ(plan.sync().period, 16);
  EXPECT_EQ(plan.sync().outer_lr, 0.7);
  EXPECT_FALSE(plan.sync().outer_momentum);
  SyncOptions cli;
  cli.period = 64;
  cli.outer_momentum = 0.9;
  const SyncOptions merged = cli.over(plan.sync());
  EXPECT_EQ(merged.period, 64);
  EXPECT_EQ(merged.outer_lr, 0.7);
  EXPECT_EQ(merged.outer_momentum, 0.9);
  EXPECT_EQ(merged.outer_optimizer, "nesterov");
  // The section round-trips through the plan's YAML; bsp without options writes none.
  EXPECT_EQ(Plan::parse(plan.to_yaml(), "again.yaml").sync(), plan.sync());
  EXPECT_EQ(Plan::parse("ranks: 2\n", "p.yaml").to_yaml().find("sync"), std::string::npos);
  expect_input_error([] { (void)Plan::parse("ranks: 1\nsync: {mode: bsp, every: 3}\n", "s.yaml"); },
                     {"plan file 's.yaml', sync", "unknown key 'every'"});
  expect_input_error([] { (void)Plan::parse("ranks: 1\nsync: {period: zero}\n", "s.yaml"); },
                     {"'period' must be a positive integer"});
  expect_input_error([] { (void)Plan::parse("ranks: 1\nsync: local_sgd\n", "s.yaml"); }, {"expected a mapping"});
}

SyncOptions mode(const std::string& m) {
  SyncOptions s;
  s.mode = m;
  return s;
}

TEST(SyncOptions, ChecksNameTheOption) {
  EXPECT_NO_THROW(check_sync(mode("bsp"), 1));
  EXPECT_NO_THROW(check_sync(mode("bsp"), 4));
  expect_input_error([] { check_sync(mode("lockstep"), 2); }, {"'lockstep' is unknown", "bsp, local_sgd, diloco"});
  SyncOptions s = mode("bsp");
  s.easgd_alpha = 0.5;
  expect_input_error([&] { check_sync(s, 2); }, {"'easgd_alpha' (--easgd-alpha) is for --sync easgd, not bsp"});
  s = mode("gossip");
  s.start = 3;
  expect_input_error([&] { check_sync(s, 2); }, {"'start' (--sync-start) is for --sync local_sgd, not gossip"});
  s = mode("local_sgd");
  s.period = 0;
  expect_input_error([&] { check_sync(s, 2); }, {"must be at least 1, got 0"});
  s = mode("diloco");
  s.outer_momentum = 1.0;
  expect_input_error([&] { check_sync(s, 2); }, {"outer momentum (--outer-momentum) must be in [0, 1), got 1"});
  s = mode("easgd");
  s.easgd_alpha = 1.5;
  expect_input_error([&] { check_sync(s, 2); }, {"must be in [0, 1], got 1.5"});
  s = mode("gossip");
  s.topology = "torus";
  expect_input_error([&] { check_sync(s, 2); }, {"'torus': choose ring or exponential"});
  expect_input_error([] { check_sync(mode("adascale"), 1); }, {"needs two replica groups or more", "this job has 1"});
  s = mode("diloco");
  s.optimizer_state = true;
  expect_input_error([&] { check_sync(s, 2); }, {"'optimizer_state' (--sync-optimizer-state) is for --sync local_sgd"});
  // Well-formed options of every mode pass.
  s = mode("local_sgd");
  s.period = 4;
  s.start = 100;
  s.optimizer_state = true;
  EXPECT_NO_THROW(check_sync(s, 4));
  EXPECT_EQ(Plan::parse("ranks: 1\n" + s.to_yaml(), "p.yaml").sync(), s);
  for (const auto& m : sync_modes()) EXPECT_NO_THROW(check_sync(mode(m), 2)) << m;
}

TEST(Stragglers, SpecsAndTheirRefusals) {
  const StragglerSpec slow = parse_straggler("slow:1,3:2.5x");
  EXPECT_EQ(slow.groups, (std::vector<int>{1, 3}));
  EXPECT_EQ(slow.factor, 2.5);
  EXPECT_EQ(straggler_delay(slow, 1, 0, 3, 4, 0.2), 1.5 * 0.2);
  EXPECT_EQ(straggler_delay(slow, 1, 0, 0, 4, 0.2), 0.0);
  const StragglerSpec random = parse_straggler("random:1:50ms");
  EXPECT_EQ(random.count, 1);
  EXPECT_DOUBLE_EQ(random.seconds, 0.05);
  EXPECT_TRUE(parse_straggler("random:2:2x").relative);
  EXPECT_DOUBLE_EQ(parse_straggler("tail:10ms").seconds, 0.01);
  EXPECT_FALSE(parse_straggler("none").any());
  for (const char* bad : {"slow:1", "slow:a:2x", "slow:1:0.5x", "random:0:1ms", "random:1:fast", "tail:10", "late:1"})
    expect_input_error([&] { (void)parse_straggler(bad); }, {"--inject-straggler", bad});
  expect_input_error([&] { check_straggler(slow, 2); }, {"names group 3, but this job has 2 replica groups"});
  expect_input_error([&] { check_straggler(parse_straggler("random:3:1ms"), 2); }, {"delays 3 random groups"});
  SyncOptions s = mode("ssp");
  s.staleness = -1;
  expect_input_error([&] { check_sync(s, 2); }, {"staleness (--staleness) must be 0 or more, got -1"});
  s = mode("dssp");
  parse_staleness_range("3:1", s);
  expect_input_error([&] { check_sync(s, 2); }, {"must be LOW:HIGH with 0 <= LOW <= HIGH, got 3:1"});
  expect_input_error([&] { parse_staleness_range("3", s); }, {"such as 1:8, got '3'"});
  parse_staleness_range("1:8", s);
  EXPECT_NO_THROW(check_sync(s, 2));
  EXPECT_EQ(Plan::parse("ranks: 1\n" + s.to_yaml(), "p.yaml").sync(), s);
  s = mode("bsp");
  s.staleness = 2;
  expect_input_error([&] { check_sync(s, 2); }, {"'staleness' (--staleness) is for --sync ssp or eager, not bsp"});
  s = mode("eager");
  s.quorum = "most";
  expect_input_error([&] { check_sync(s, 4); }, {"quorum (--quorum) 'most': choose solo or majority"});
  s.quorum = "solo";
  s.staleness = 3;
  EXPECT_NO_THROW(check_sync(s, 4));
  EXPECT_EQ(Plan::parse("ranks: 1\n" + s.to_yaml(), "p.yaml").sync(), s);
  EXPECT_EQ(eager_quorum(s, 4), 1);
  s.quorum = "majority";
  EXPECT_EQ(eager_quorum(s, 4), 3);
  EXPECT_EQ(eager_quorum(s, 5), 3);
  EXPECT_EQ(eager_quorum(mode("eager"), 2), 2);  // majority by default
  // The lag each mode allows, and the host copies of the parameters its buffers hold.
  EXPECT_EQ(sync_lag(mode("ssp")), 2);
  EXPECT_EQ(sync_lag(mode("dssp")), 8);
  EXPECT_EQ(sync_lag(mode("eager")), 4);
  EXPECT_EQ(sync_lag(mode("local_sgd")), 0);
  EXPECT_EQ(sync_buffer_copies(mode("bsp"), 4), 0);
  EXPECT_EQ(sync_buffer_copies(mode("eager"), 1), 0);  // one group: nothing crosses groups
  EXPECT_EQ(sync_buffer_copies(mode("ssp"), 4), 6);
  EXPECT_EQ(sync_buffer_copies(mode("eager"), 4), 13);
  s = mode("ssp");
  s.quorum = "solo";
  expect_input_error([&] { check_sync(s, 2); }, {"'quorum' (--quorum) is for --sync eager, not ssp"});
}

TEST(CommDelay, ParsesLatencyAndBandwidth) {
  EXPECT_EQ(parse_comm_delay("20ms").latency_seconds, 0.02);
  EXPECT_EQ(parse_comm_delay("20ms").bytes_per_second, 0);
  const CommDelay d = parse_comm_delay("500us,2GB/s");
  EXPECT_DOUBLE_EQ(d.latency_seconds, 5e-4);
  EXPECT_DOUBLE_EQ(d.bytes_per_second, 2e9);
  EXPECT_DOUBLE_EQ(d.seconds(4000000), 5e-4 + 2e-3);
  EXPECT_FALSE(parse_comm_delay("0").any());
  for (const char* bad : {"20", "fast", "20ms,", "20ms,0GB/s", "-1ms", "20ms,1GB"})
    expect_input_error([&] { (void)parse_comm_delay(bad); }, {"--inject-comm-delay expects", bad});
}

}  // namespace
}  // namespace tessera
