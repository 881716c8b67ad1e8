#include "tessera/core/log.hpp"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "tessera/core/error.hpp"

namespace tessera {
namespace {
LogLevel g_level = LogLevel::Info;
std::shared_ptr<spdlog::logger> logger() {
  static std::shared_ptr<spdlog::logger> instance = [] {
    auto l = spdlog::stderr_color_mt("tessera");
    l->set_pattern("%^[%H:%M:%S %l]%$ %v");
    l->set_level(spdlog::level::trace);
    return l;
  }();
  return instance;
}
}  // namespace

void set_log_level(LogLevel level) { g_level = level; }

void log_message(LogLevel level, const std::string& message, bool all_ranks) {
  if (level < g_level || level == LogLevel::Off) return;
  const int rank = process_rank();
  if (!all_ranks && rank > 0) return;
  const std::string text = rank >= 0 && all_ranks ? fmt::format("[rank {}] {}", rank, message) : message;
  switch (level) {
    case LogLevel::Debug: logger()->debug(text); break;
    case LogLevel::Info: logger()->info(text); break;
    case LogLevel::Warn: logger()->warn(text); break;
    default: logger()->error(text); break;
  }
}

}  // namespace tessera
