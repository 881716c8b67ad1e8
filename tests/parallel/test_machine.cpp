// Machine files, in one process: the YAML round trip, defaults, every error with its message, the
// shipped files of machines/, and the per-rank rates a job derives from a machine.
#include <gtest/gtest.h>

#include <functional>
#include <regex>
#include <string>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/parallel/machine.hpp"
#include "expect_input_error.hpp"

namespace tessera {
namespace {

void expect_parse_error(const std::string& yaml, const std::vector<std::string>& needles) {
  SCOPED_TRACE(yaml);
  expect_input_error([&] { (void)Machine::parse(yaml, "m.yaml"); }, needles);
}

const char* kFull = R"(name: two-node test
source: "made up: for the test"
device: gpu
nodes: 2
ranks_per_node: 4
cores_per_node: 64
flops: 1.5e13
bf16_flops: 6.0e13
memory_bandwidth: 1.2e12
memory_per_rank: 3.8e10
kernel_overhead: 1.5e-5
grad_overlap: 0.75
intra:
  p2p: {alpha: 2.0e-6, beta: 1.0e-11}
  allreduce: {alpha: 5.0e-6, beta: 2.0e-11}
  alltoall: {alpha: 3.0e-6, beta: 3.0e-11}
inter:
  p2p: {alpha: 4.0e-6, beta: 8.0e-11}
sync_wait: {3: 0.004}
peak_flops: 2.0e13
bf16_peak_flops: 3.0e14
peak_memory_bandwidth: 2.0e12
efficiency: {conv3d_forward: [0.2, 0.3, 0.4], gemm: 0.7}
step_overhead: [0.001, 0.002, 0.004]
kernels:
  "m/conv1|n4|c1x28x28|f1c1|t1": 0.0125
  "m/fc|n4|f2c1|t1": 3.5e-5
)";

/// The smallest valid file: everything else defaults.
const char* kMinimal = "intra: {p2p: {alpha: 1e-6, beta: 1e-10}}\n";

TEST(Machine, ParsesEveryField) {
  const Machine m = Machine::parse(kFull, "full.yaml");
  EXPECT_EQ(m.name, "two-node test");
  EXPECT_EQ(m.source, "made up: for the test");
  EXPECT_EQ(m.device, "gpu");
  EXPECT_EQ(m.nodes, 2);
  EXPECT_EQ(m.ranks_per_node, 4);
  EXPECT_EQ(m.cores_per_node, 64);
  EXPECT_DOUBLE_EQ(m.flops, 1.5e13);
  EXPECT_DOUBLE_EQ(m.memory_bandwidth, 1.2e12);
  EXPECT_DOUBLE_EQ(m.memory_per_rank, 3.8e10);
  EXPECT_DOUBLE_EQ(m.kernel_overhead, 1.5e-5);
  EXPECT_DOUBLE_EQ(m.grad_overlap, 0.75);
  EXPECT_EQ(m.intra.p2p, (AlphaBeta{2e-6, 1e-11}));
  EXPECT_EQ(m.intra.allreduce, (AlphaBeta{5e-6, 2e-11}));
  EXPECT_EQ(m.intra.alltoall, (AlphaBeta{3e-6, 3e-11}));
  // Collectives not given default to the level's point-to-point costs.
  EXPECT_EQ(m.inter.p2p, (AlphaBeta{4e-6, 8e-11}));
  EXPECT_EQ(m.inter.allreduce, m.inter.p2p);
  EXPECT_EQ(m.inter.alltoall, m.inter.p2p);
  ASSERT_EQ(m.kernels.size(), 2u);
  EXPECT_DOUBLE_EQ(m.kernels.at("m/conv1|n4|c1x28x28|f1c1|t1"), 0.0125);
  EXPECT_DOUBLE_EQ(m.kernels.at("m/fc|n4|f2c1|t1"), 3.5e-5);
}

TEST(Machine, RoundTripsThroughYaml) {
  const Machine m = Machine::parse(kFull, "full.yaml");
  const Machine again = Machine::parse(m.to_yaml(), "again.yaml");
  EXPECT_EQ(again.name, m.name);
  EXPECT_EQ(again.source, m.source);
  EXPECT_EQ(again.device, m.device);
  EXPECT_EQ(again.nodes, m.nodes);
  EXPECT_EQ(again.ranks_per_node, m.ranks_per_node);
  EXPECT_EQ(again.cores_per_node, m.cores_per_node);
  EXPECT_DOUBLE_EQ(again.flops, m.flops);
  EXPECT_DOUBLE_EQ(again.bf16_flops, 6.0e13);
  EXPECT_DOUBLE_EQ(again.memory_bandwidth, m.memory_bandwidth);
  EXPECT_DOUBLE_EQ(again.memory_per_rank, m.memory_per_rank);
  EXPECT_DOUBLE_EQ(again.kernel_overhead, m.kernel_overhead);
  EXPECT_DOUBLE_EQ(again.grad_overlap, m.grad_overlap);
  EXPECT_EQ(again.intra, m.intra);
  EXPECT_EQ(again.inter, m.inter);
  EXPECT_EQ(again.kernels, m.kernels);
  EXPECT_EQ(again.sync_wait, m.sync_wait);
  EXPECT_DOUBLE_EQ(again.peak_flops, 2.0e13);
  EXPECT_DOUBLE_EQ(again.bf16_peak_flops, m.bf16_peak_flops);
  EXPECT_DOUBLE_EQ(again.peak_memory_bandwidth, m.peak_memory_bandwidth);
  EXPECT_EQ(again.efficiency.size(), 2u);
  EXPECT_EQ(again.efficiency, m.efficiency);
  EXPECT_EQ(again.step_overhead, (Range{0.001, 0.002, 0.004}));
  // And once more: a fixed point.
  EXPECT_EQ(Machine::parse(again.to_yaml(), "third.yaml").to_yaml(), again.to_yaml());
}

TEST(Machine, RoundTripsAwkwardStrings) {
  Machine m = Machine::parse(kMinimal, "min.yaml");
  m.name = "a: name # with \"quotes\"";
  m.source = "line one\nline two";
  m.kernels["model/layer: odd|n1|t2"] = 1e-3;
  const Machine again = Machine::parse(m.to_yaml(), "again.yaml");
  EXPECT_EQ(again.name, m.name);
  EXPECT_EQ(again.source, m.source);
  EXPECT_EQ(again.kernels, m.kernels);
}

// Numbers with an exponent carry a point in the mantissa: YAML 1.1 readers (PyYAML, which the
// scaling scripts and tests use) read "5e-06" as a string and "5.0e-06" as a float.
TEST(Machine, WritesFloatsThatYaml11ReadsAsNumbers) {
  Machine m = Machine::parse(kMinimal, "min.yaml");
  m.flops = 3e13;
  m.bf16_flops = 1.56e14;
  m.memory_per_rank = 4e10;
  m.intra.p2p = {5e-6, 4e-11};
  m.sync_wait[2] = 1e-3;
  m.sync_wait_share[3] = 0.45;
  m.copy_bandwidth = 1.1e10;
  m.copy_run = 9e-10;
  m.kernels["model/layer|n1|t2"] = 2e-5;
  const std::string text = m.to_yaml();
  for (const char* expected : {"flops: 3.0e+13", "bf16_flops: 1.56e+14", "memory_per_rank: 4.0e+10",
                               "p2p: {alpha: 5.0e-06, beta: 4.0e-11}", "2: 0.001", "|t2\": 2.0e-05"})
    EXPECT_NE(text.find(expected), std::string::npos) << expected << " in\n" << text;
  const std::regex bare_exponent(R"([:\s][-+]?[0-9]+[eE][-+]?[0-9])");
  EXPECT_FALSE(std::regex_search(text, bare_exponent)) << text;
  const Machine again = Machine::parse(text, "again.yaml");
  EXPECT_EQ(again.sync_wait_share, m.sync_wait_share);
  EXPECT_DOUBLE_EQ(again.copy_bandwidth, m.copy_bandwidth);
  EXPECT_DOUBLE_EQ(again.copy_run, m.copy_run);
  EXPECT_DOUBLE_EQ(again.flops, m.flops);
  EXPECT_DOUBLE_EQ(again.intra.p2p.alpha, m.intra.p2p.alpha);
  EXPECT_EQ(again.kernels, m.kernels);
}

TEST(Machine, Defaults) {
  const Machine m = Machine::parse(kMinimal, "min.yaml");
  EXPECT_EQ(m.device, "cpu");
  EXPECT_EQ(m.nodes, 1);
  EXPECT_EQ(m.ranks_per_node, 1);
  EXPECT_EQ(m.cores_per_node, 1);
  EXPECT_DOUBLE_EQ(m.kernel_overhead, 0);
  EXPECT_DOUBLE_EQ(m.grad_overlap, 0);
  EXPECT_TRUE(m.kernels.empty());
  EXPECT_EQ(m.intra.allreduce, m.intra.p2p);
  EXPECT_EQ(m.intra.alltoall, m.intra.p2p);
  // One node: across nodes is within the node.
  EXPECT_EQ(m.inter, m.intra);
  // An empty kernels entry is allowed.
  EXPECT_TRUE(Machine::parse(std::string(kMinimal) + "kernels:\n", "k.yaml").kernels.empty());
}

TEST(Machine, RefusesBadInput) {
  const std::string intra = "intra: {p2p: {alpha: 1e-6, beta: 1e-10}}\n";
  expect_parse_error("nodes: [1\n", {"m.yaml", "not valid YAML"});
  expect_parse_error("- 1\n- 2\n", {"m.yaml", "expected a mapping"});
  expect_parse_error(intra + "flop: 1e12\n", {"m.yaml", "unknown key 'flop'", "flops"});
  expect_parse_error(intra + "flops: -1e12\n", {"'flops'", "positive", "got -1"});
  expect_parse_error(intra + "flops: 0\n", {"'flops'", "positive"});
  expect_parse_error(intra + "memory_bandwidth: fast\n", {"'memory_bandwidth'", "expected a number", "fast"});
  expect_parse_error(intra + "kernel_overhead: -1e-6\n", {"'kernel_overhead'", "non-negative"});
  expect_parse_error(intra + "grad_overlap: 1.5\n", {"'grad_overlap'", "between 0 and 1"});
  expect_parse_error(intra + "grad_overlap: -0.1\n", {"'grad_overlap'", "non-negative"});
  expect_parse_error(intra + "nodes: 2.5\n", {"'nodes'", "positive integer"});
  expect_parse_error(intra + "ranks_per_node: 0\n", {"'ranks_per_node'", "positive"});
  expect_parse_error(intra + "device: tpu\n", {"'device'", "cpu or gpu", "tpu"});
  expect_parse_error("flops: 1e12\n", {"m.yaml", "missing 'intra'"});
  expect_parse_error(intra + "nodes: 4\n", {"m.yaml", "missing 'inter'"});
  expect_parse_error("intra: {allreduce: {alpha: 1e-6, beta: 1e-10}}\n", {"'intra'", "missing 'p2p'"});
  expect_parse_error("intra: {p2p: {alpha: 1e-6}}\n", {"'intra'.p2p", "both alpha and beta"});
  expect_parse_error("intra: {p2p: {alpha: 1e-6, beta: 1e-10, gamma: 1}}\n", {"'intra'.p2p", "unknown key 'gamma'"});
  expect_parse_error("intra: {p2p: {alpha: -1e-6, beta: 1e-10}}\n", {"'intra'.p2p.alpha", "non-negative"});
  expect_parse_error("intra: {p2p: {alpha: 1e-6, beta: x}}\n", {"'intra'.p2p.beta", "expected a number", "'x'"});
  expect_parse_error("intra: {p2p: {alpha: 1e-6, beta: 1e-10}, bcast: {alpha: 1, beta: 1}}\n",
                     {"'intra'", "unknown key 'bcast'"});
  expect_parse_error("intra: 5\n", {"'intra'", "expected a mapping"});
  expect_parse_error(intra + "kernels: [1, 2]\n", {"'kernels'", "mapping from workload keys"});
  expect_parse_error(intra + "kernels: {\"a|n1\": 0}\n", {"'kernels'", "a|n1", "positive"});
  expect_parse_error(intra + "kernels: {\"a|n1\": soon}\n", {"'kernels'", "a|n1", "expected a number"});
  expect_parse_error(intra + "sync_wait: [1]\n", {"'sync_wait'", "mapping from ranks on a node"});
  expect_parse_error(intra + "sync_wait: {0: 0.01}\n", {"'sync_wait' key '0'", "positive"});
  expect_parse_error(intra + "sync_wait: {3: -0.01}\n", {"'sync_wait'", "non-negative"});
  expect_input_error([] { (void)Machine::load("/nonexistent/machine.yaml"); },
                     {"cannot open machine file", "/nonexistent/machine.yaml"});
}

TEST(Machine, SyncWaitByRanksOnTheNode) {
  const Machine m = Machine::parse(
      "device: cpu\ncores_per_node: 2\nranks_per_node: 8\nsync_wait: {3: 0.011, 4: 0.009}\n"
      "intra: {p2p: {alpha: 1e-6, beta: 1e-10}}\n",
      "m.yaml");
  EXPECT_DOUBLE_EQ(m.sync_wait_for(3), 0.011);
  EXPECT_DOUBLE_EQ(m.sync_wait_for(4), 0.009);
  EXPECT_DOUBLE_EQ(m.sync_wait_for(2), 0.0);   // not measured
  EXPECT_DOUBLE_EQ(m.sync_wait_for(20), 0.0);  // 8 ranks on the node: not measured
  EXPECT_NE(m.to_yaml().find("sync_wait:\n  3: 0.011\n  4: 0.009\n"), std::string::npos) << m.to_yaml();
}

TEST(Machine, RatesPerRankOnCpuNodes) {
  Machine m = Machine::parse(kMinimal, "min.yaml");
  m.device = "cpu";
  m.nodes = 1;
  m.ranks_per_node = 8;
  m.cores_per_node = 4;
  m.flops = 400e9;
  m.memory_bandwidth = 40e9;
  EXPECT_EQ(m.ranks_on_node(1), 1);
  EXPECT_EQ(m.ranks_on_node(2), 2);
  EXPECT_EQ(m.ranks_on_node(8), 8);
  EXPECT_EQ(m.ranks_on_node(64), 8);  // more nodes: each holds ranks_per_node
  EXPECT_EQ(m.threads_per_rank(1), 4);
  EXPECT_EQ(m.threads_per_rank(2), 2);
  EXPECT_EQ(m.threads_per_rank(3), 1);
  EXPECT_EQ(m.threads_per_rank(8), 1);
  EXPECT_DOUBLE_EQ(m.rank_flops(1), 400e9);
  EXPECT_DOUBLE_EQ(m.rank_flops(4), 100e9);
  EXPECT_DOUBLE_EQ(m.rank_flops(100), 50e9);
  EXPECT_DOUBLE_EQ(m.rank_flops(4, Precision::BF16), 100e9);  // no bf16_flops: the fp32 rate
  m.bf16_flops = 800e9;
  EXPECT_DOUBLE_EQ(m.rank_flops(4, Precision::BF16), 200e9);  // the node's bf16 rate, shared
  EXPECT_DOUBLE_EQ(m.rank_memory_bandwidth(2), 20e9);
  EXPECT_DOUBLE_EQ(m.oversubscription(1), 1);
  EXPECT_DOUBLE_EQ(m.oversubscription(4), 1);
  EXPECT_DOUBLE_EQ(m.oversubscription(6), 1.5);
  EXPECT_DOUBLE_EQ(m.oversubscription(8), 2);
  EXPECT_DOUBLE_EQ(m.oversubscription(80), 2);
}

TEST(Machine, RatesPerRankOnGpuNodes) {
  Machine m = Machine::parse(kFull, "full.yaml");
  EXPECT_EQ(m.ranks_on_node(3), 3);
  EXPECT_EQ(m.ranks_on_node(8), 4);
  EXPECT_EQ(m.threads_per_rank(1), 1);
  EXPECT_EQ(m.threads_per_rank(8), 1);
  EXPECT_DOUBLE_EQ(m.rank_flops(8), 1.5e13);  // one device per rank
  EXPECT_DOUBLE_EQ(m.rank_flops(8, Precision::BF16), 6.0e13);
  EXPECT_DOUBLE_EQ(m.rank_memory_bandwidth(8), 1.2e12);
  EXPECT_DOUBLE_EQ(m.oversubscription(8), 1);
}

const char* kComponents = R"(device: gpu
flops: 1.0e13
memory_bandwidth: 1.0e12
peak_flops: 2.0e13
bf16_peak_flops: 3.0e14
peak_memory_bandwidth: 2.0e12
efficiency:
  conv3d_forward: [0.2, 0.3, 0.4]
  conv3d_backward: 0.25
  gemm: [0.6, 0.7, 0.8]
  conv3d_bf16: [0.1, 0.2, 0.3]
  memory: [0.7, 0.8, 0.9]
step_overhead: [0.001, 0.002, 0.004]
intra: {p2p: {alpha: 1e-6, beta: 1e-10}}
)";

TEST(Machine, EfficienciesOfKernelClassesWithTheirRanges) {
  const Machine m = Machine::parse(kComponents, "c.yaml");
  EXPECT_TRUE(m.has_ranges());
  // Typical: peak x the middle value; a pass falls back to the class's own entry.
  EXPECT_DOUBLE_EQ(m.class_flops(1, "conv3d", false, Precision::F32), 0.3 * 2.0e13);
  EXPECT_DOUBLE_EQ(m.class_flops(1, "conv3d", true, Precision::F32), 0.25 * 2.0e13);
  EXPECT_DOUBLE_EQ(m.class_flops(1, "gemm", true, Precision::F32), 0.7 * 2.0e13);
  EXPECT_DOUBLE_EQ(m.class_flops(1, "conv3d", true, Precision::BF16), 0.2 * 3.0e14);
  EXPECT_DOUBLE_EQ(m.class_flops(1, "conv2d", false, Precision::F32), 0);  // not given: the roofline's flops
  EXPECT_DOUBLE_EQ(m.class_flops(1, "gemm", false, Precision::BF16), 0);   // no gemm_bf16
  EXPECT_DOUBLE_EQ(m.rank_memory_bandwidth(1), 0.8 * 2.0e12);
  EXPECT_DOUBLE_EQ(m.step_overhead_seconds(), 0.002);
  // The slow end: low efficiencies, the high overhead; the fast end: the opposite.
  const Machine slow = m.at(Bound::Slow), fast = m.at(Bound::Fast);
  EXPECT_DOUBLE_EQ(slow.class_flops(1, "conv3d", false, Precision::F32), 0.2 * 2.0e13);
  EXPECT_DOUBLE_EQ(fast.class_flops(1, "conv3d", false, Precision::F32), 0.4 * 2.0e13);
  EXPECT_DOUBLE_EQ(slow.class_flops(1, "conv3d", true, Precision::F32), 0.25 * 2.0e13);
  EXPECT_DOUBLE_EQ(slow.rank_memory_bandwidth(1), 0.7 * 2.0e12);
  EXPECT_DOUBLE_EQ(fast.rank_memory_bandwidth(1), 0.9 * 2.0e12);
  EXPECT_DOUBLE_EQ(slow.step_overhead_seconds(), 0.004);
  EXPECT_DOUBLE_EQ(fast.step_overhead_seconds(), 0.001);
  // Single numbers are no range.
  EXPECT_FALSE(Machine::parse("peak_flops: 1e12\nefficiency: {gemm: 0.5}\nintra: {p2p: {alpha: 1e-6, beta: 1e-10}}\n",
                              "one.yaml")
                   .has_ranges());
}

TEST(Machine, RefusesBadEfficiencies) {
  const std::string base = "peak_flops: 1e13\npeak_memory_bandwidth: 1e12\nintra: {p2p: {alpha: 1e-6, beta: 1e-10}}\n";
  expect_parse_error(base + "efficiency: {conv4d: 0.5}\n", {"'efficiency'", "unknown kernel class 'conv4d'", "conv3d"});
  expect_parse_error(base + "efficiency: {gemm: 1.5}\n", {"'efficiency' 'gemm'", "at most 1"});
  expect_parse_error(base + "efficiency: {gemm: 0}\n", {"'efficiency' 'gemm'", "above 0"});
  expect_parse_error(base + "efficiency: {gemm: [0.5, 0.4, 0.6]}\n", {"'gemm'", "low <= typical <= high"});
  expect_parse_error(base + "efficiency: {gemm: [0.5, 0.6]}\n", {"'gemm'", "[low, typical, high]"});
  expect_parse_error(base + "efficiency: [0.5]\n", {"'efficiency'", "mapping from kernel classes"});
  expect_parse_error(base + "efficiency: {gemm_bf16: 0.5}\n", {"'gemm_bf16'", "'bf16_peak_flops'"});
  expect_parse_error("efficiency: {conv2d: 0.5}\nintra: {p2p: {alpha: 1e-6, beta: 1e-10}}\n",
                     {"'conv2d'", "'peak_flops'", "does not give"});
  expect_parse_error(base + "step_overhead: [0.002, 0.001, 0.003]\n", {"'step_overhead'", "low <= typical"});
  expect_parse_error(base + "step_overhead: -1\n", {"'step_overhead'", "non-negative"});
}

/// The machine files shipped in machines/ load, and hold what their names say.
TEST(Machine, ShippedFilesLoad) {
  const std::string dir = std::string(TESSERA_SOURCE_DIR) + "/machines/";
  struct Expect {
    const char* file;
    int nodes, ranks_per_node;
    double min_memory, max_memory;  // per rank
  };
  const Expect files[] = {
      {"summit_class.yaml", 4608, 6, 10e9, 16e9},
      {"perlmutter_class.yaml", 1536, 4, 30e9, 40e9},
      {"frontier_class.yaml", 9856, 8, 50e9, 64e9},
  };
  for (const auto& e : files) {
    SCOPED_TRACE(e.file);
    Machine m;
    ASSERT_NO_THROW(m = Machine::load(dir + e.file));
    EXPECT_EQ(m.device, "gpu");
    EXPECT_EQ(m.nodes, e.nodes);
    EXPECT_EQ(m.ranks_per_node, e.ranks_per_node);
    EXPECT_GE(m.memory_per_rank, e.min_memory);
    EXPECT_LE(m.memory_per_rank, e.max_memory);
    EXPECT_FALSE(m.source.empty());
    // Sustained fp32 of one GPU (device): between 5 and 60 TFLOP/s; HBM between 0.5 and 3.5 TB/s.
    EXPECT_GT(m.flops, 5e12);
    EXPECT_LT(m.flops, 60e12);
    EXPECT_GT(m.memory_bandwidth, 0.5e12);
    EXPECT_LT(m.memory_bandwidth, 3.5e12);
    EXPECT_GT(m.grad_overlap, 0);
    EXPECT_LE(m.grad_overlap, 1);
    EXPECT_GT(m.kernel_overhead, 0);
    // Within a node is faster per byte than across nodes, and no level is free.
    EXPECT_GT(m.intra.p2p.alpha, 0);
    EXPECT_GT(m.inter.p2p.alpha, 0);
    EXPECT_LT(m.intra.p2p.beta, m.inter.p2p.beta);
    EXPECT_LE(m.intra.allreduce.beta, m.inter.allreduce.beta);
    EXPECT_EQ(m.threads_per_rank(1024), 1);
    // Built from components: datasheet peaks above the sustained rates, the convolutions' and the
    // memory's efficiencies with the spread of their sources.
    EXPECT_TRUE(m.has_ranges());
    EXPECT_GT(m.peak_flops, 0);
    EXPECT_GE(m.peak_flops, m.class_flops(1, "conv3d", false, Precision::F32));
    EXPECT_GT(m.class_flops(1, "conv3d", true, Precision::F32), 0);
    EXPECT_LE(m.rank_memory_bandwidth(1), m.peak_memory_bandwidth);
    EXPECT_GT(m.at(Bound::Slow).rank_memory_bandwidth(1), 0.5e12);
  }
}

TEST(Machine, CalibrationsMergeIntoTheirMedianNumberByNumber) {
  Machine a = Machine::parse(kFull, "a.yaml"), b = a, c = a;
  b.flops = 3e13, c.flops = 1e13;  // median 1.5e13 (a's)
  b.intra.allreduce.beta = 1e-11, c.intra.allreduce.beta = 4e-11;
  b.sync_wait[3] = 0.001, c.sync_wait[3] = 0.009;
  c.sync_wait[4] = 0.002;  // one file only
  b.kernels["m/conv1|n4|c1x28x28|f1c1|t1"] = 0.0100;
  c.kernels["m/conv1|n4|c1x28x28|f1c1|t1"] = 0.0200;
  b.kernels.erase("m/fc|n4|f2c1|t1");  // two files have it: the mean of the two
  c.kernels["m/fc|n4|f2c1|t1"] = 4.5e-5;
  const Machine m = merge_calibrations({a, b, c}, {"a.yaml", "b.yaml", "c.yaml"});
  EXPECT_DOUBLE_EQ(m.flops, 1.5e13);
  EXPECT_DOUBLE_EQ(m.intra.allreduce.beta, 2e-11);
  EXPECT_DOUBLE_EQ(m.sync_wait.at(3), 0.004);
  EXPECT_DOUBLE_EQ(m.sync_wait.at(4), 0.002);
  EXPECT_DOUBLE_EQ(m.kernels.at("m/conv1|n4|c1x28x28|f1c1|t1"), 0.0125);
  EXPECT_DOUBLE_EQ(m.kernels.at("m/fc|n4|f2c1|t1"), 4.0e-5);
  EXPECT_EQ(m.name, a.name);
  EXPECT_NE(m.source.find("median of 3 calibrations (a.yaml, b.yaml, c.yaml)"), std::string::npos) << m.source;

  Machine other = a;
  other.cores_per_node = 32;
  expect_input_error(
      [&] {
        (void)merge_calibrations({a, other}, {"a.yaml", "other.yaml"});
      },
      {"other.yaml and a.yaml describe different nodes", "32 cores"});
  expect_input_error([&] { (void)merge_calibrations({a}, {"a.yaml"}); }, {"at least two machine files"});
}

}  // namespace
}  // namespace tessera
