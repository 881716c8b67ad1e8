#pragma once
// Logging: rank 0 prints info; every rank prints warnings and errors with its rank.
#include <string>
#include <fmt/format.h>

namespace tessera {

enum class LogLevel { Debug, Info, Warn, Error, Off };

void set_log_level(LogLevel level);
void log_message(LogLevel level, const std::string& message, bool all_ranks = false);

template <typename... Args>
void log_info(fmt::format_string<Args...> f, Args&&... args) {
  log_message(LogLevel::Info, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void log_warn(fmt::format_string<Args...> f, Args&&... args) {
  log_message(LogLevel::Warn, fmt::format(f, std::forward<Args>(args)...), true);
}
template <typename... Args>
void log_debug(fmt::format_string<Args...> f, Args&&... args) {
  log_message(LogLevel::Debug, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace tessera
