#include "tessera/layers/options.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>

#include <fmt/format.h>

#include "tessera/core/error.hpp"

namespace tessera {
namespace {

/// Prefix for errors: "layer 'conv1' (conv): " or nothing when the owner is unnamed.
std::string prefix(const std::string& context) { return context.empty() ? std::string() : context + ": "; }

bool parse_int(const std::string& text, std::int64_t& value) {
  const char* end = text.data() + text.size();
  auto [last, error] = std::from_chars(text.data(), end, value);
  return error == std::errc() && last == end && !text.empty();
}

/// Integer parameters (sizes, counts, strides) stay far from the int64 limits, so that the shape
/// arithmetic of any layer cannot overflow (fuzzing found "padding: 4611686018427387904").
constexpr std::int64_t kLargestInteger = 2147483647;

void check_range(const std::string& context, const std::string& key, std::int64_t value) {
  if (value > kLargestInteger || value < -kLargestInteger)
    fail_input("{}parameter '{}' is {}, beyond what Tessera accepts (at most {} in size)", prefix(context), key, value,
               kLargestInteger);
}

bool parse_float(const std::string& text, double& value) {
  if (text.empty()) return false;
  char* end = nullptr;
  value = std::strtod(text.c_str(), &end);
  return end == text.c_str() + text.size();
}

/// Edit distance (insertions, deletions, substitutions), for "did you mean" suggestions.
std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

}  // namespace

void LayerOptions::set(const std::string& key, std::string scalar) {
  values_[key] = {std::move(scalar)};
  is_list_[key] = false;
}

void LayerOptions::set_list(const std::string& key, std::vector<std::string> items) {
  values_[key] = std::move(items);
  is_list_[key] = true;
}

bool LayerOptions::has(const std::string& key) const { return values_.count(key) > 0; }

const std::vector<std::string>& LayerOptions::items(const std::string& key) const {
  used_.insert(key);
  auto found = values_.find(key);
  if (found == values_.end()) {
    // A required parameter is often missing because it was misspelled: say so.
    for (const auto& [given, value] : values_)
      if (edit_distance(given, key) <= 2)
        fail_input("{}parameter '{}' is required (did you misspell it as '{}'?)", prefix(context_), key, given);
    fail_input("{}parameter '{}' is required", prefix(context_), key);
  }
  return found->second;
}

std::int64_t LayerOptions::get_int(const std::string& key) const {
  const auto& values = items(key);
  if (is_list_.at(key)) fail_input("{}parameter '{}' must be an integer, got a list", prefix(context_), key);
  std::int64_t value = 0;
  if (!parse_int(values[0], value))
    fail_input("{}parameter '{}' must be an integer, got '{}'", prefix(context_), key, values[0]);
  check_range(context_, key, value);
  return value;
}

std::int64_t LayerOptions::get_int(const std::string& key, std::int64_t fallback) const {
  used_.insert(key);
  return has(key) ? get_int(key) : fallback;
}

double LayerOptions::get_float(const std::string& key) const {
  const auto& values = items(key);
  if (is_list_.at(key)) fail_input("{}parameter '{}' must be a number, got a list", prefix(context_), key);
  double value = 0;
  if (!parse_float(values[0], value))
    fail_input("{}parameter '{}' must be a number, got '{}'", prefix(context_), key, values[0]);
  return value;
}

double LayerOptions::get_float(const std::string& key, double fallback) const {
  used_.insert(key);
  return has(key) ? get_float(key) : fallback;
}

bool LayerOptions::get_bool(const std::string& key, bool fallback) const {
  used_.insert(key);
  if (!has(key)) return fallback;
  const auto& values = items(key);
  if (!is_list_.at(key)) {
    std::string text = values[0];
    std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
    // The spellings YAML 1.1 reads as booleans, which is what users of YAML files expect.
    if (text == "true" || text == "yes" || text == "on" || text == "1") return true;
    if (text == "false" || text == "no" || text == "off" || text == "0") return false;
  }
  fail_input("{}parameter '{}' must be true or false, got '{}'", prefix(context_), key,
             is_list_.at(key) ? std::string("a list") : values[0]);
}

std::string LayerOptions::get_string(const std::string& key) const {
  const auto& values = items(key);
  if (is_list_.at(key)) fail_input("{}parameter '{}' must be a single value, got a list", prefix(context_), key);
  return values[0];
}

std::string LayerOptions::get_string(const std::string& key, const std::string& fallback) const {
  used_.insert(key);
  return has(key) ? get_string(key) : fallback;
}

std::vector<std::int64_t> LayerOptions::get_int_list(const std::string& key,
                                                     std::vector<std::int64_t> fallback) const {
  used_.insert(key);
  if (!has(key)) {
    if (fallback.empty()) items(key);  // throws "required"
    return fallback;
  }
  const auto& values = items(key);
  if (values.empty()) fail_input("{}parameter '{}' is an empty list", prefix(context_), key);
  std::vector<std::int64_t> result;
  for (const auto& text : values) {
    std::int64_t value = 0;
    if (!parse_int(text, value))
      fail_input("{}parameter '{}' must be an integer or a list of integers, got '{}'", prefix(context_), key, text);
    check_range(context_, key, value);
    result.push_back(value);
  }
  return result;
}

std::vector<std::int64_t> LayerOptions::get_ints(const std::string& key, int count) const {
  items(key);  // throws "required"
  return get_ints(key, count, 0);
}

std::vector<std::int64_t> LayerOptions::get_ints(const std::string& key, int count, std::int64_t fallback) const {
  std::vector<std::int64_t> values = get_int_list(key, {fallback});
  if (values.size() == 1) values.assign(static_cast<std::size_t>(count), values[0]);
  if (static_cast<int>(values.size()) != count)
    fail_input("{}parameter '{}' needs 1 or {} values, got {}", prefix(context_), key, count, values.size());
  return values;
}

void LayerOptions::check_all_used() const {
  std::vector<std::string> unknown;
  for (const auto& [key, value] : values_)
    if (!used_.count(key)) unknown.push_back(key);
  if (unknown.empty()) return;

  std::string message = prefix(context_) + (unknown.size() == 1 ? "unknown parameter " : "unknown parameters ");
  for (std::size_t i = 0; i < unknown.size(); ++i) {
    const std::string& key = unknown[i];
    message += fmt::format("{}'{}'", i ? ", " : "", key);
    // Suggest the closest known name when it is a plausible typo.
    const std::string* best = nullptr;
    std::size_t best_distance = 0;
    for (const auto& known : used_) {
      const std::size_t distance = edit_distance(key, known);
      if (!best || distance < best_distance) {
        best = &known;
        best_distance = distance;
      }
    }
    if (best && best_distance <= std::max<std::size_t>(2, key.size() / 3)) message += fmt::format(" (did you mean '{}'?)", *best);
  }
  if (used_.empty()) {
    message += "; it takes no parameters";
  } else {
    message += "; known parameters:";
    for (const auto& known : used_) message += " " + known;
  }
  throw InputError(message);
}

}  // namespace tessera
