#include "tessera/parallel/machine.hpp"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>

#include "tessera/core/error.hpp"
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
      } else if (key == "kernels") {
        if (v.IsNull()) continue;
        if (!v.IsMap()) fail_input("{}: expected a mapping from workload keys to seconds", where);
        for (const auto& k : v)
          m.kernels[k.first.as<std::string>()] =
              parse_number(k.second, fmt::format("{} '{}'", where, k.first.as<std::string>()), false);
      } else {
        fail_input("machine file '{}': unknown key '{}' (known: name, source, device, nodes, ranks_per_node, "
                   "cores_per_node, flops, bf16_flops, memory_bandwidth, memory_per_rank, kernel_overhead, grad_overlap, intra, "
                   "inter, sync_wait, sync_wait_share, kernels)",
                   source_name, key);
      }
    }
  } catch (const YAML::Exception& e) {
    fail_input("machine file '{}': {}", source_name, e.what());
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
  s += fmt::format("intra: {}\ninter: {}\n", level_yaml(intra), level_yaml(inter));
  if (!sync_wait.empty()) {
    s += "sync_wait:\n";
    for (const auto& [ranks, seconds] : sync_wait) s += fmt::format("  {}: {}\n", ranks, yaml_number(seconds));
  }
  if (!sync_wait_share.empty()) {
    s += "sync_wait_share:\n";
    for (const auto& [ranks, share] : sync_wait_share) s += fmt::format("  {}: {}\n", ranks, yaml_number(share));
  }
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
  return device == "gpu" ? memory_bandwidth : memory_bandwidth / ranks_on_node(ranks);
}

double Machine::sync_wait_for(int ranks) const {
  const auto it = sync_wait.find(ranks_on_node(ranks));
  return it == sync_wait.end() ? 0.0 : it->second;
}

double Machine::sync_wait_share_for(int ranks) const {
  const auto it = sync_wait_share.find(ranks_on_node(ranks));
  return it == sync_wait_share.end() ? 0.0 : it->second;
}

double Machine::oversubscription(int ranks) const {
  if (device == "gpu") return 1;
  return std::max(1.0, static_cast<double>(ranks_on_node(ranks)) / cores_per_node);
}

}  // namespace tessera
