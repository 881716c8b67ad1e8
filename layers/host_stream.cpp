#include "layers/host_stream.hpp"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <fstream>
#include <string>

#include <unistd.h>

#include "tessera/layers/runtime.hpp"

namespace tessera::host {
namespace {

/// The CPUs a sysfs CPU list ("0-3,8") names.
int cpus_in_list(const std::string& list) {
  int count = 0;
  std::size_t at = 0;
  while (at < list.size()) {
    const std::size_t end = std::min(list.find(',', at), list.size());
    const std::string range = list.substr(at, end - at);
    const std::size_t dash = range.find('-');
    if (!range.empty() && std::isdigit(static_cast<unsigned char>(range[0])))
      count += dash == std::string::npos ? 1 : std::stoi(range.substr(dash + 1)) - std::stoi(range.substr(0, dash)) + 1;
    at = end + 1;
  }
  return count;
}

/// CPU 0's largest cache as sysfs gives it ("32768K"; 0 where it gives none), and how many CPUs
/// share it (0: not said).
struct LastLevelCache {
  std::int64_t bytes = 0;
  int sharing_cpus = 0;
};

LastLevelCache last_level_cache() {
  LastLevelCache largest;
  for (int index = 0; index < 8; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
    std::ifstream file(dir + "/size");
    std::string text;
    if (!(file >> text) || text.empty() || !std::isdigit(static_cast<unsigned char>(text[0]))) continue;
    std::int64_t bytes = std::stoll(text);
    const char unit = text.back();
    if (unit == 'K')
      bytes <<= 10;
    else if (unit == 'M')
      bytes <<= 20;
    if (bytes <= largest.bytes) continue;
    std::ifstream shared(dir + "/shared_cpu_list");
    std::string list;
    largest = {bytes, (shared >> list) ? cpus_in_list(list) : 0};
  }
  return largest;
}

std::atomic<std::int64_t> threshold_override{-1};
std::atomic<int> ranks_on_node{1};

}  // namespace

std::int64_t streaming_threshold() {
  const std::int64_t override = threshold_override.load(std::memory_order_relaxed);
  if (override >= 0) return override;
  static const LastLevelCache cache = last_level_cache();
  static const int caches = [] {
    const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    return cache.sharing_cpus > 0 && cpus > cache.sharing_cpus ? static_cast<int>(cpus / cache.sharing_cpus) : 1;
  }();
  const std::int64_t bytes = cache.bytes > 0 ? cache.bytes : std::int64_t{32} << 20;
  const int sharing = (ranks_on_node.load(std::memory_order_relaxed) + caches - 1) / caches;
  return bytes / 2 / std::max(1, sharing);
}

bool streams_output(std::int64_t bytes) {
  return bytes > streaming_threshold();
}

void set_streaming_threshold(std::int64_t bytes) {
  threshold_override.store(bytes, std::memory_order_relaxed);
}

}  // namespace tessera::host

namespace tessera {

void set_ranks_on_node(int ranks) {
  host::ranks_on_node.store(std::max(1, ranks), std::memory_order_relaxed);
}

}  // namespace tessera
