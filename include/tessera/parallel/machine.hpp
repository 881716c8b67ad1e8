#pragma once
// Machine files: what the planner knows of the machine it plans for. Pure code (no MPI): a
// machine file of a supercomputer one does not have is read the same way as the one
// `tessera calibrate` measures here.
//
//   name: summit-class
//   source: "OLCF Summit user guide; NVIDIA V100 datasheet"   # where the numbers come from
//   device: gpu               # gpu: one device per rank; cpu: the node's cores are shared by its ranks
//   nodes: 4608
//   ranks_per_node: 6
//   cores_per_node: 42        # cpu only: threads per rank = cores / ranks on the node
//   flops: 14.0e12            # sustained fp32 FLOP/s of one device (gpu) or one whole node (cpu)
//   memory_bandwidth: 900e9   # bytes/s of one device (gpu) or one node (cpu)
//   memory_per_rank: 16e9     # bytes a rank may use
//   kernel_overhead: 10e-6    # seconds per layer call (launch, primitive dispatch)
//   copy_bandwidth: 8e9       # cpu, measured: bytes/s one rank copies between boxes (exchanges)
//   copy_run: 2e-9            # cpu, measured: and seconds per contiguous run of such a copy
//   grad_overlap: 0.8         # share of backward compute the gradient allreduce hides (0..1)
//   intra: {p2p: {alpha: 5e-6, beta: 2e-11}, allreduce: {...}, alltoall: {...}}
//   inter: {p2p: {alpha: 1.5e-6, beta: 4e-11}, ...}
//   sync_wait: {3: 0.0002}   # cpu, measured: waiting per blocking exchange with 3 ranks on the node
//   sync_wait_share: {3: 0.45}  # cpu, measured: and this share of the work before the exchange
//   kernels: {"cosmoflow/conv1|n4|c1x64x64x64|f1c1|t2": 0.123}   # measured seconds (tessera calibrate)
//
// A machine one does not have is better described by its datasheet peaks and the efficiencies
// others measured per kernel class, each one number or [low, typical, high] where sources differ:
//   peak_flops: 19.5e12       # fp32 FLOP/s of one device (gpu) or node (cpu), datasheet
//   bf16_peak_flops: 312e12   # dense bf16 tensor-core FLOP/s
//   peak_memory_bandwidth: 1555e9
//   efficiency: {conv3d_forward: [0.3, 0.4, 0.5], conv3d_backward: 0.35, gemm: 0.8, memory: 0.85,
//                conv3d_bf16: [0.2, 0.3, 0.4]}   # classes: conv2d, conv3d, conv2d_first and
//                # conv3d_first (a convolution reading the model's input; else its conv class), gemm,
//                # each with an optional _forward/_backward and _bf16 suffix; memory (of
//                # peak_memory_bandwidth)
//   step_overhead: [2e-3, 4e-3, 8e-3]   # seconds per training step outside the layers
// The planner prices with the typical values; `tessera plan` also gives the step at the ends.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "tessera/core/precision.hpp"

namespace tessera {

/// Time of moving n bytes: alpha + beta * n (alpha: seconds, beta: seconds per byte).
struct AlphaBeta {
  double alpha = 0;
  double beta = 0;
  bool operator==(const AlphaBeta&) const = default;
};

/// Costs of one communication level (ranks within a node, or across nodes).
/// - p2p: one message of n bytes.
/// - allreduce of n bytes over p ranks: 2 ceil(log2 p) alpha + 2 (p-1)/p n beta (ring /
///   Rabenseifner), with this level's alpha and beta.
/// - alltoall(v) over p ranks sending n bytes in all from each rank: (p-1) alpha + n beta.
struct CommLevel {
  AlphaBeta p2p;
  AlphaBeta allreduce;
  AlphaBeta alltoall;
  bool operator==(const CommLevel&) const = default;
};

/// A number others measured, with the spread of their measurements (low <= typical <= high).
struct Range {
  double low = 0, typical = 0, high = 0;
  bool operator==(const Range&) const = default;
};

/// Which end of its ranges a machine file is read at: the planner prices with the typical values;
/// Slow takes the low efficiencies and the high step overhead, Fast the opposite.
enum class Bound { Typical, Slow, Fast };

struct Machine {
  std::string name = "machine";
  /// Where the numbers come from (datasheets, papers, or "measured by tessera calibrate on HOST").
  std::string source;
  /// "cpu": the ranks of a node share its cores and its memory bandwidth; "gpu": one device per rank.
  std::string device = "cpu";
  int nodes = 1;
  int ranks_per_node = 1;
  int cores_per_node = 1;
  /// Sustained fp32 FLOP/s of convolution and matrix products: of one device (gpu) or of a whole
  /// node (cpu).
  double flops = 1e11;
  /// Sustained FLOP/s of the same with bf16 operands (`precision: bf16`: tensor cores on GPUs);
  /// 0: as `flops` (no faster path, e.g. CPUs and GPUs without bf16/TF32 tensor cores).
  double bf16_flops = 0;
  /// Bytes/s of one device (gpu) or of a whole node (cpu): element-wise layers, packing.
  double memory_bandwidth = 1e10;
  /// Bytes one rank may use; plans needing more are refused.
  double memory_per_rank = 1e10;
  /// Seconds per layer call (kernel launch, primitive dispatch), forward and backward each.
  double kernel_overhead = 0;
  /// Box copies as the exchanges make them (a window assembled from a tile, its gradient taken
  /// back), caches cold and one rank per core copying at once: the bytes/s one rank copies and the
  /// seconds each contiguous run adds (cpu; measured by `tessera calibrate`). 0: a copy is priced
  /// as two passes at the rank's share of memory_bandwidth.
  double copy_bandwidth = 0;
  double copy_run = 0;
  /// Share (0..1) of the backward compute before the last gradient bucket that the gradient
  /// allreduce hides.
  double grad_overlap = 0;
  CommLevel intra;
  CommLevel inter;
  /// Seconds a blocking exchange or collective waits beyond its alpha-beta cost when this many
  /// ranks share a node (cpu nodes with more ranks than cores: a peer may be descheduled), by
  /// ranks on the node; measured by `tessera calibrate` at its own rank count. Absent: 0.
  std::map<int, double> sync_wait;
  /// The wait's part that grows with the work between two exchanges (a descheduled peer is late by
  /// a share of its work): the share of the work before a blocking exchange it adds, by ranks on
  /// the node; measured by `tessera calibrate` with two amounts of work. Absent: 0.
  std::map<int, double> sync_wait_share;
  /// sync_wait for a job of `ranks` ranks (0 when not measured).
  double sync_wait_for(int ranks) const;
  /// sync_wait_share for a job of `ranks` ranks (0 when not measured).
  double sync_wait_share_for(int ranks) const;
  /// Measured seconds of forward + backward of one layer on one local workload (see
  /// kernel_key in planner.hpp), written by `tessera calibrate`.
  std::map<std::string, double> kernels;
  /// Datasheet peaks (0: not given) that `efficiency` is a share of.
  double peak_flops = 0, bf16_peak_flops = 0, peak_memory_bandwidth = 0;
  /// Achieved share of the peak by kernel class (see the file format above).
  std::map<std::string, Range> efficiency;
  /// Seconds per training step outside the layers (framework, launches between them).
  Range step_overhead;
  /// The end of the ranges this machine is read at (Machine::at).
  Bound bound = Bound::Typical;

  /// This machine read at `b`.
  Machine at(Bound b) const;
  /// Whether any efficiency or the step overhead has a spread (low < high).
  bool has_ranges() const;
  /// A range's value at this machine's bound (`slow_is_low`: a low value makes the step slower,
  /// as for efficiencies; false for overheads).
  double value_at(const Range& r, bool slow_is_low) const;
  /// FLOP/s one rank gets from kernel class `kernel_class` ("conv2d", "conv3d", "conv2d_first",
  /// "conv3d_first", "gemm") in one pass at `precision`, from peak x efficiency (a first layer's
  /// class falls back to its convolutions'); 0 when the file gives no efficiency for it.
  double class_flops(int ranks, const std::string& kernel_class, bool backward, Precision precision) const;
  /// The step overhead at this machine's bound.
  double step_overhead_seconds() const { return value_at(step_overhead, false); }

  /// Parses a machine file; errors are InputErrors naming the file and the key.
  static Machine load(const std::string& path);
  static Machine parse(const std::string& yaml_text, const std::string& source_name);
  std::string to_yaml() const;

  /// Ranks of a job of `ranks` ranks that share one node (the nodes are filled in rank order).
  int ranks_on_node(int ranks) const;
  /// Threads per rank the executor uses on this machine for a job of `ranks` ranks (cpu: the
  /// node's cores over its ranks, at least 1; gpu: 1).
  int threads_per_rank(int ranks) const;
  /// Sustained FLOP/s and bytes/s one rank gets in a job of `ranks` ranks (cpu: the node's rate
  /// shared by the ranks on it; gpu: the device's).
  double rank_flops(int ranks, Precision precision = Precision::F32) const;
  double rank_memory_bandwidth(int ranks) const;
  /// Seconds one rank of a job of `ranks` ranks takes to copy `bytes` in `runs` contiguous runs
  /// between two boxes (copy_bandwidth and copy_run, stretched by the oversubscription).
  double box_copy_seconds(int ranks, double bytes, double runs) const;
  /// The costs within a node for a job of `ranks` ranks: on an oversubscribed CPU node a transfer
  /// is the CPU work of ranks that share the cores, so alpha and beta stretch as compute does.
  CommLevel intra_for(int ranks) const;
  /// How much slower one rank computes than with the node to itself when the ranks on a node
  /// outnumber its cores (cpu; 1 otherwise): `tessera calibrate` scales a kernel it times alone
  /// for a rank count other than its own job's by it.
  double oversubscription(int ranks) const;
};

/// Several calibrations of one machine as one file: each measured number (the rates, the
/// communication lines, copies, waits and every kernel timing) the median over the files that have
/// it; the rest (name, shape of the node, datasheet values) from the first. One calibration is a
/// sample of a machine whose speed drifts; calibrations spread over time make a typical one.
/// `names` name the files in the messages and the source. InputError when they describe different
/// nodes (device, nodes, cores, ranks per node) or fewer than two are given.
Machine merge_calibrations(const std::vector<Machine>& machines, const std::vector<std::string>& names);

}  // namespace tessera
