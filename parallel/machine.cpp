#include "tessera/parallel/machine.hpp"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string_view>
#include <type_traits>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/parallel/calibration.hpp"
#include "tessera/parallel/yaml_file.hpp"

namespace tessera {
namespace {

double parse_number(const YAML::Node& node, const std::string& where, bool allow_zero) {
  double value = 0;
  try {
    value = node.as<double>();
  } catch (const YAML::Exception&) {
    fail_input("{}: expected a number, got '{}'", where, node.IsScalar() ? node.Scalar() : std::string("a non-scalar"));
  }
  if (!std::isfinite(value) || value < 0 || (!allow_zero && value == 0))
    fail_input("{}: expected a {} number, got {}", where, allow_zero ? "non-negative" : "positive", value);
  return value;
}

int parse_count(const YAML::Node& node, const std::string& where) {
  const double value = parse_number(node, where, false);
  if (value != std::floor(value) || value > 1e9) fail_input("{}: expected a positive integer, got {}", where, value);
  return static_cast<int>(value);
}

AlphaBeta parse_alpha_beta(const YAML::Node& node, const std::string& where) {
  if (!node.IsMap()) fail_input("{}: expected {{alpha: SECONDS, beta: SECONDS_PER_BYTE}}", where);
  AlphaBeta ab;
  bool has_alpha = false, has_beta = false;
  for (const auto& item : node) {
    const auto key = item.first.as<std::string>();
    if (key == "alpha") ab.alpha = parse_number(item.second, where + ".alpha", true), has_alpha = true;
    else if (key == "beta") ab.beta = parse_number(item.second, where + ".beta", true), has_beta = true;
    else fail_input("{}: unknown key '{}' (known: alpha, beta)", where, key);
  }
  if (!has_alpha || !has_beta) fail_input("{}: needs both alpha and beta", where);
  return ab;
}

/// A level: p2p is required; allreduce and alltoall default to it.
CommLevel parse_level(const YAML::Node& node, const std::string& where) {
  if (!node.IsMap()) fail_input("{}: expected a mapping with p2p (and optionally allreduce, alltoall)", where);
  CommLevel level;
  bool has_p2p = false, has_allreduce = false, has_alltoall = false;
  for (const auto& item : node) {
    const auto key = item.first.as<std::string>();
    const auto sub = where + "." + key;
    if (key == "p2p") level.p2p = parse_alpha_beta(item.second, sub), has_p2p = true;
    else if (key == "allreduce") level.allreduce = parse_alpha_beta(item.second, sub), has_allreduce = true;
    else if (key == "alltoall") level.alltoall = parse_alpha_beta(item.second, sub), has_alltoall = true;
    else fail_input("{}: unknown key '{}' (known: p2p, allreduce, alltoall)", where, key);
  }
  if (!has_p2p) fail_input("{}: missing 'p2p'", where);
  if (!has_allreduce) level.allreduce = level.p2p;
  if (!has_alltoall) level.alltoall = level.p2p;
  return level;
}

std::string yaml_quoted(const std::string& s) {
  YAML::Emitter e;
  e << YAML::DoubleQuoted << s;
  return e.c_str();
}

/// `value` to 6 significant digits as YAML 1.1 readers (PyYAML) read a float: an exponent needs a
/// mantissa with a point ("5.0e-06", not "5e-06", which they read as a string).
std::string yaml_number(double value) {
  std::string text = fmt::format("{:.6g}", value);
  const auto e = text.find('e');
  if (e != std::string::npos && text.find('.') == std::string::npos) text.insert(e, ".0");
  return text;
}

std::string level_yaml(const CommLevel& l) {
  auto ab = [](const AlphaBeta& x) {
    return fmt::format("{{alpha: {}, beta: {}}}", yaml_number(x.alpha), yaml_number(x.beta));
  };
  return fmt::format("{{p2p: {}, allreduce: {}, alltoall: {}}}", ab(l.p2p), ab(l.allreduce), ab(l.alltoall));
}

// The efficiency classes a file may name: each class, optionally per pass, optionally bf16.
bool known_efficiency(const std::string& key) {
  if (key == "memory") return true;
  for (const char* kernel_class : {"conv2d", "conv3d", "conv2d_first", "conv3d_first", "gemm"})
    for (const char* pass : {"", "_forward", "_backward"})
      for (const char* precision : {"", "_bf16"})
        if (key == std::string(kernel_class) + pass + precision) return true;
  return false;
}

// One number, or [low, typical, high] in order; each > 0 and, for shares, <= 1.
Range parse_range(const YAML::Node& node, const std::string& where, bool share) {
  Range r;
  if (node.IsSequence()) {
    if (node.size() != 3) fail_input("{}: expected one number or [low, typical, high]", where);
    r = {parse_number(node[0], where, true), parse_number(node[1], where, true), parse_number(node[2], where, true)};
    if (!(r.low <= r.typical && r.typical <= r.high))
      fail_input("{}: expected low <= typical <= high, got [{}, {}, {}]", where, r.low, r.typical, r.high);
  } else {
    r.low = r.typical = r.high = parse_number(node, where, true);
  }
  if (share && (r.low <= 0 || r.high > 1)) fail_input("{}: a share of the peak, above 0 and at most 1", where);
  return r;
}

std::string range_yaml(const Range& r) {
  if (r.low == r.high) return yaml_number(r.typical);
  return fmt::format("[{}, {}, {}]", yaml_number(r.low), yaml_number(r.typical), yaml_number(r.high));
}

}  // namespace

Machine Machine::load(const std::string& path) {
  return parse(read_input_file(path, "machine file"), path);
}

Machine Machine::parse(const std::string& yaml_text, const std::string& source_name) {
  YAML::Node root = parse_yaml_mapping(yaml_text, fmt::format("machine file '{}'", source_name),
                                       "a mapping (name, device, nodes, ...)", ": not valid YAML");
  Machine m;
  bool has_intra = false, has_inter = false;
  try {
    for (const auto& item : root) {
      const auto key = item.first.as<std::string>();
      const auto where = fmt::format("machine file '{}', '{}'", source_name, key);
      const auto& v = item.second;
      if (key == "name") m.name = v.as<std::string>();
      else if (key == "source") m.source = v.as<std::string>();
      else if (key == "device") {
        m.device = v.as<std::string>();
        if (m.device != "cpu" && m.device != "gpu") fail_input("{}: expected cpu or gpu, got '{}'", where, m.device);
      } else if (key == "nodes") m.nodes = parse_count(v, where);
      else if (key == "ranks_per_node") m.ranks_per_node = parse_count(v, where);
      else if (key == "cores_per_node") m.cores_per_node = parse_count(v, where);
      else if (key == "flops") m.flops = parse_number(v, where, false);
      else if (key == "bf16_flops") m.bf16_flops = parse_number(v, where, true);
      else if (key == "memory_bandwidth") m.memory_bandwidth = parse_number(v, where, false);
      else if (key == "memory_per_rank") m.memory_per_rank = parse_number(v, where, false);
      else if (key == "kernel_overhead") m.kernel_overhead = parse_number(v, where, true);
      else if (key == "copy_bandwidth") m.copy_bandwidth = parse_number(v, where, false);
      else if (key == "copy_run") m.copy_run = parse_number(v, where, true);
      else if (key == "grad_overlap") {
        m.grad_overlap = parse_number(v, where, true);
        if (m.grad_overlap > 1) fail_input("{}: a share between 0 and 1, got {}", where, m.grad_overlap);
      } else if (key == "intra") m.intra = parse_level(v, where), has_intra = true;
      else if (key == "inter") m.inter = parse_level(v, where), has_inter = true;
      else if (key == "sync_wait" || key == "sync_wait_share") {
        if (v.IsNull()) continue;
        if (!v.IsMap())
          fail_input("{}: expected a mapping from ranks on a node to {}, e.g. {{3: 0.01}}", where,
                     key == "sync_wait" ? "seconds" : "a share of the work");
        for (const auto& k : v) {
          const std::string name = k.first.as<std::string>();
          const int ranks = parse_count(k.first, fmt::format("{} key '{}'", where, name));
          (key == "sync_wait" ? m.sync_wait : m.sync_wait_share)[ranks] =
              parse_number(k.second, fmt::format("{} '{}'", where, name), true);
        }
      } else if (key == "peak_flops") m.peak_flops = parse_number(v, where, false);
      else if (key == "bf16_peak_flops") m.bf16_peak_flops = parse_number(v, where, false);
      else if (key == "peak_memory_bandwidth") m.peak_memory_bandwidth = parse_number(v, where, false);
      else if (key == "step_overhead") m.step_overhead = parse_range(v, where, false);
      else if (key == "efficiency") {
        if (v.IsNull()) continue;
        if (!v.IsMap()) fail_input("{}: expected a mapping from kernel classes to shares of the peak", where);
        for (const auto& k : v) {
          const std::string name = k.first.as<std::string>();
          if (!known_efficiency(name))
            fail_input("{}: unknown kernel class '{}' (known: conv2d, conv3d, conv2d_first, conv3d_first, "
                       "gemm, each with an optional _forward or _backward and an optional _bf16 suffix; memory)",
                       where, name);
          m.efficiency[name] = parse_range(k.second, fmt::format("{} '{}'", where, name), true);
        }
      } else if (key == "kernels") {
        if (v.IsNull()) continue;
        if (!v.IsMap()) fail_input("{}: expected a mapping from workload keys to seconds", where);
        for (const auto& k : v)
          m.kernels[k.first.as<std::string>()] =
              parse_number(k.second, fmt::format("{} '{}'", where, k.first.as<std::string>()), false);
      } else {
        fail_input("machine file '{}': unknown key '{}' (known: name, source, device, nodes, ranks_per_node, "
                   "cores_per_node, flops, bf16_flops, memory_bandwidth, memory_per_rank, kernel_overhead, copy_bandwidth, "
                   "copy_run, grad_overlap, intra, "
                   "inter, sync_wait, sync_wait_share, kernels, peak_flops, bf16_peak_flops, peak_memory_bandwidth, "
                   "efficiency, step_overhead)",
                   source_name, key);
      }
    }
  } catch (const YAML::Exception& e) {
    fail_input("machine file '{}': {}", source_name, e.what());
  }
  for (const auto& [name, range] : m.efficiency) {
    const bool bf16 = name.size() > 5 && name.substr(name.size() - 5) == "_bf16";
    const double peak = name == "memory" ? m.peak_memory_bandwidth : bf16 ? m.bf16_peak_flops : m.peak_flops;
    if (peak <= 0)
      fail_input("machine file '{}': efficiency '{}' is a share of '{}', which the file does not give", source_name,
                 name, name == "memory" ? "peak_memory_bandwidth" : bf16 ? "bf16_peak_flops" : "peak_flops");
  }
  if (!has_intra) fail_input("machine file '{}': missing 'intra' (communication within a node)", source_name);
  if (!has_inter) {
    if (m.nodes > 1) fail_input("machine file '{}': missing 'inter' (communication across nodes)", source_name);
    m.inter = m.intra;
  }
  return m;
}

std::string Machine::to_yaml() const {
  std::string s;
  s += fmt::format("name: {}\n", yaml_quoted(name));
  s += fmt::format("source: {}\n", yaml_quoted(source));
  s += fmt::format("device: {}\nnodes: {}\nranks_per_node: {}\ncores_per_node: {}\n", device, nodes, ranks_per_node,
                   cores_per_node);
  s += fmt::format("flops: {}\nmemory_bandwidth: {}\nmemory_per_rank: {}\n", yaml_number(flops),
                   yaml_number(memory_bandwidth), yaml_number(memory_per_rank));
  if (bf16_flops > 0) s += fmt::format("bf16_flops: {}\n", yaml_number(bf16_flops));
  s += fmt::format("kernel_overhead: {}\ngrad_overlap: {}\n", yaml_number(kernel_overhead), yaml_number(grad_overlap));
  if (copy_bandwidth > 0)
    s += fmt::format("copy_bandwidth: {}\ncopy_run: {}\n", yaml_number(copy_bandwidth), yaml_number(copy_run));
  s += fmt::format("intra: {}\ninter: {}\n", level_yaml(intra), level_yaml(inter));
  if (!sync_wait.empty()) {
    s += "sync_wait:\n";
    for (const auto& [ranks, seconds] : sync_wait) s += fmt::format("  {}: {}\n", ranks, yaml_number(seconds));
  }
  if (!sync_wait_share.empty()) {
    s += "sync_wait_share:\n";
    for (const auto& [ranks, share] : sync_wait_share) s += fmt::format("  {}: {}\n", ranks, yaml_number(share));
  }
  if (peak_flops > 0) s += fmt::format("peak_flops: {}\n", yaml_number(peak_flops));
  if (bf16_peak_flops > 0) s += fmt::format("bf16_peak_flops: {}\n", yaml_number(bf16_peak_flops));
  if (peak_memory_bandwidth > 0) s += fmt::format("peak_memory_bandwidth: {}\n", yaml_number(peak_memory_bandwidth));
  if (!efficiency.empty()) {
    s += "efficiency:\n";
    for (const auto& [kernel_class, range] : efficiency) s += fmt::format("  {}: {}\n", kernel_class, range_yaml(range));
  }
  if (step_overhead.high > 0) s += fmt::format("step_overhead: {}\n", range_yaml(step_overhead));
  if (!kernels.empty()) {
    s += "kernels:\n";
    for (const auto& [key, seconds] : kernels) s += fmt::format("  {}: {}\n", yaml_quoted(key), yaml_number(seconds));
  }
  return s;
}

int Machine::ranks_on_node(int ranks) const { return std::max(1, std::min(ranks, ranks_per_node)); }

int Machine::threads_per_rank(int ranks) const {
  if (device == "gpu") return 1;
  return std::max(1, cores_per_node / ranks_on_node(ranks));
}

double Machine::rank_flops(int ranks, Precision precision) const {
  const double rate = precision == Precision::BF16 && bf16_flops > 0 ? bf16_flops : flops;
  return device == "gpu" ? rate : rate / ranks_on_node(ranks);
}

double Machine::rank_memory_bandwidth(int ranks) const {
  const auto share = efficiency.find("memory");
  const double rate = share == efficiency.end() ? memory_bandwidth : peak_memory_bandwidth * value_at(share->second, true);
  return device == "gpu" ? rate : rate / ranks_on_node(ranks);
}

Machine Machine::at(Bound b) const {
  Machine m = *this;
  m.bound = b;
  return m;
}

bool Machine::has_ranges() const {
  if (step_overhead.low < step_overhead.high) return true;
  return std::any_of(efficiency.begin(), efficiency.end(), [](const auto& e) { return e.second.low < e.second.high; });
}

double Machine::value_at(const Range& r, bool slow_is_low) const {
  switch (bound) {
    case Bound::Slow: return slow_is_low ? r.low : r.high;
    case Bound::Fast: return slow_is_low ? r.high : r.low;
    case Bound::Typical: break;
  }
  return r.typical;
}

double Machine::class_flops(int ranks, const std::string& kernel_class, bool backward, Precision precision) const {
  if (efficiency.empty() || kernel_class.empty()) return 0;
  const bool bf16 = precision == Precision::BF16 && bf16_peak_flops > 0;
  const std::string suffix = bf16 ? "_bf16" : "";
  auto share = efficiency.find(kernel_class + (backward ? "_backward" : "_forward") + suffix);
  if (share == efficiency.end()) share = efficiency.find(kernel_class + suffix);
  if (share == efficiency.end()) {
    // A first layer's class falls back to its convolutions' (conv3d_first -> conv3d).
    constexpr std::string_view kFirst = "_first";
    if (kernel_class.ends_with(kFirst))
      return class_flops(ranks, kernel_class.substr(0, kernel_class.size() - kFirst.size()), backward, precision);
    return 0;
  }
  const double rate = (bf16 ? bf16_peak_flops : peak_flops) * value_at(share->second, true);
  return device == "gpu" ? rate : rate / ranks_on_node(ranks);
}

double Machine::sync_wait_for(int ranks) const {
  const auto it = sync_wait.find(ranks_on_node(ranks));
  return it == sync_wait.end() ? 0.0 : it->second;
}

double Machine::sync_wait_share_for(int ranks) const {
  const auto it = sync_wait_share.find(ranks_on_node(ranks));
  return it == sync_wait_share.end() ? 0.0 : it->second;
}

double Machine::box_copy_seconds(int ranks, double bytes, double runs) const {
  if (copy_bandwidth <= 0) return 2.0 * bytes / rank_memory_bandwidth(ranks);
  return oversubscription(ranks) * (runs * copy_run + bytes / copy_bandwidth);
}

CommLevel Machine::intra_for(int ranks) const {
  CommLevel level = intra;
  const double stretch = oversubscription(ranks);
  for (AlphaBeta* ab : {&level.p2p, &level.allreduce, &level.alltoall}) {
    ab->alpha *= stretch;
    ab->beta *= stretch;
  }
  return level;
}

double Machine::oversubscription(int ranks) const {
  if (device == "gpu") return 1;
  return std::max(1.0, static_cast<double>(ranks_on_node(ranks)) / cores_per_node);
}

namespace {

/// Per key, the median over the maps that have it.
template <typename Key>
std::map<Key, double> median_by_key(const std::vector<const std::map<Key, double>*>& maps) {
  std::map<Key, std::vector<double>> values;
  for (const auto* m : maps)
    for (const auto& [key, value] : *m) values[key].push_back(value);
  std::map<Key, double> result;
  for (auto& [key, list] : values) result[key] = median(std::move(list));
  return result;
}

}  // namespace

Machine merge_calibrations(const std::vector<Machine>& machines, const std::vector<std::string>& names) {
  if (machines.size() < 2 || names.size() != machines.size())
    fail_input("merging calibrations needs at least two machine files, got {}", machines.size());
  const Machine& first = machines.front();
  for (std::size_t i = 1; i < machines.size(); ++i) {
    const Machine& m = machines[i];
    if (m.device != first.device || m.nodes != first.nodes || m.cores_per_node != first.cores_per_node ||
        m.ranks_per_node != first.ranks_per_node)
      fail_input(
          "{} and {} describe different nodes ({}, {} nodes of {} cores, {} ranks per node against {}, {} "
          "nodes of {} cores, {} ranks per node): only calibrations of one machine merge",
          names[i], names[0], m.device, m.nodes, m.cores_per_node, m.ranks_per_node, first.device, first.nodes,
          first.cores_per_node, first.ranks_per_node);
  }
  Machine merged = first;
  auto median_over = [&](auto field) {
    std::vector<double> values;
    for (const Machine& m : machines) values.push_back(field(m));
    return median(std::move(values));
  };
  merged.flops = median_over([](const Machine& m) { return m.flops; });
  merged.bf16_flops = median_over([](const Machine& m) { return m.bf16_flops; });
  merged.memory_bandwidth = median_over([](const Machine& m) { return m.memory_bandwidth; });
  merged.kernel_overhead = median_over([](const Machine& m) { return m.kernel_overhead; });
  merged.copy_bandwidth = median_over([](const Machine& m) { return m.copy_bandwidth; });
  merged.copy_run = median_over([](const Machine& m) { return m.copy_run; });
  for (auto level : {&Machine::intra, &Machine::inter})
    for (auto line : {&CommLevel::p2p, &CommLevel::allreduce, &CommLevel::alltoall}) {
      (merged.*level.*line).alpha = median_over([&](const Machine& m) { return (m.*level.*line).alpha; });
      (merged.*level.*line).beta = median_over([&](const Machine& m) { return (m.*level.*line).beta; });
    }
  auto maps = [&](auto member) {
    std::vector<std::remove_reference_t<decltype(first.*member)> const*> list;
    for (const Machine& m : machines) list.push_back(&(m.*member));
    return median_by_key(list);
  };
  merged.sync_wait = maps(&Machine::sync_wait);
  merged.sync_wait_share = maps(&Machine::sync_wait_share);
  merged.kernels = maps(&Machine::kernels);
  std::string files;
  for (const auto& name : names) files += (files.empty() ? "" : ", ") + name;
  merged.source = fmt::format(
      "the median of {} calibrations ({}), each measured number over the files that have it; "
      "the first: {}",
      machines.size(), files, first.source);
  return merged;
}

}  // namespace tessera
