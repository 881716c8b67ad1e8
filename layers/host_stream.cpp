#include "layers/host_stream.hpp"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <fstream>
#include <string>

namespace tessera::host {
namespace {

/// The largest cache of CPU 0 as sysfs gives it ("32768K"), 0 where it gives none.
std::int64_t last_level_cache_bytes() {
  std::int64_t largest = 0;
  for (int index = 0; index < 8; ++index) {
    std::ifstream file("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
    std::string text;
    if (!(file >> text) || text.empty() || !std::isdigit(static_cast<unsigned char>(text[0]))) continue;
    std::int64_t bytes = std::stoll(text);
    const char unit = text.back();
    if (unit == 'K')
      bytes <<= 10;
    else if (unit == 'M')
      bytes <<= 20;
    largest = std::max(largest, bytes);
  }
  return largest;
}

std::atomic<std::int64_t> threshold_override{-1};

}  // namespace

bool streams_output(std::int64_t bytes) {
  static const std::int64_t cache = [] {
    const std::int64_t b = last_level_cache_bytes();
    return b > 0 ? b : std::int64_t{32} << 20;
  }();
  const std::int64_t threshold = threshold_override.load(std::memory_order_relaxed);
  return bytes > (threshold >= 0 ? threshold : cache / 2);
}

void set_streaming_threshold(std::int64_t bytes) {
  threshold_override.store(bytes, std::memory_order_relaxed);
}

}  // namespace tessera::host
