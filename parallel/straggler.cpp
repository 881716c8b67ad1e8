#include "tessera/parallel/straggler.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>

#include "tessera/core/error.hpp"
#include "tessera/core/rng.hpp"

namespace tessera {
namespace {

[[noreturn]] void bad(const std::string& text, const std::string& why) {
  fail_input("--inject-straggler '{}': {} (expected slow:GROUPS:FACTORx, random:K:DELAY or tail:MEAN, e.g. "
             "slow:1:2x, random:1:50ms, random:1:2x, tail:10ms)",
             text, why);
}

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::size_t begin = 0;
  for (;;) {
    const auto end = text.find(separator, begin);
    parts.push_back(text.substr(begin, end == std::string::npos ? std::string::npos : end - begin));
    if (end == std::string::npos) return parts;
    begin = end + 1;
  }
}

std::optional<double> number(const std::string& text) {
  try {
    std::size_t used = 0;
    const double value = std::stod(text, &used);
    if (used != text.size() || !std::isfinite(value) || value < 0) return std::nullopt;
    return value;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

/// "50ms", "0.5s": seconds; nullopt otherwise.
std::optional<double> duration(const std::string& text) {
  for (const auto& [unit, factor] : {std::pair<const char*, double>{"ms", 1e-3}, {"s", 1.0}}) {
    const std::string u(unit);
    if (text.size() > u.size() && text.compare(text.size() - u.size(), u.size(), u) == 0)
      if (auto v = number(text.substr(0, text.size() - u.size()))) return *v * factor;
  }
  return std::nullopt;
}

/// "2x": 2; nullopt otherwise.
std::optional<double> multiple(const std::string& text) {
  if (text.size() < 2 || text.back() != 'x') return std::nullopt;
  return number(text.substr(0, text.size() - 1));
}

}  // namespace

StragglerSpec parse_straggler(const std::string& text) {
  StragglerSpec spec;
  if (text.empty() || text == "none") return spec;
  const auto parts = split(text, ':');
  if (parts[0] == "slow") {
    if (parts.size() != 3) bad(text, "slow takes GROUPS and FACTOR");
    spec.kind = StragglerSpec::Kind::Slow;
    for (const auto& g : split(parts[1], ',')) {
      const auto v = number(g);
      if (!v || *v != std::floor(*v)) bad(text, fmt::format("'{}' is not a group index", g));
      spec.groups.push_back(static_cast<int>(*v));
    }
    const auto f = multiple(parts[2]);
    if (!f || *f < 1) bad(text, "the slowdown must be a factor of 1x or more, such as 2x");
    spec.factor = *f;
  } else if (parts[0] == "random") {
    if (parts.size() != 3) bad(text, "random takes K and DELAY");
    spec.kind = StragglerSpec::Kind::Random;
    const auto k = number(parts[1]);
    if (!k || *k != std::floor(*k) || *k < 1) bad(text, "K must be a number of groups, 1 or more");
    spec.count = static_cast<int>(*k);
    if (const auto f = multiple(parts[2])) {
      spec.relative = true;
      spec.factor = *f;
    } else if (const auto d = duration(parts[2])) {
      spec.seconds = *d;
    } else {
      bad(text, "DELAY must be a duration such as 50ms or a multiple of the step such as 2x");
    }
  } else if (parts[0] == "tail") {
    if (parts.size() != 2) bad(text, "tail takes MEAN");
    spec.kind = StragglerSpec::Kind::Tail;
    const auto d = duration(parts[1]);
    if (!d) bad(text, "MEAN must be a duration such as 10ms");
    spec.seconds = *d;
  } else {
    bad(text, fmt::format("unknown kind '{}'", parts[0]));
  }
  return spec;
}

void check_straggler(const StragglerSpec& spec, int groups) {
  for (int g : spec.groups)
    if (g < 0 || g >= groups)
      fail_input("--inject-straggler names group {}, but this job has {} replica group{} (0 to {})", g, groups,
                 groups == 1 ? "" : "s", groups - 1);
  if (spec.kind == StragglerSpec::Kind::Random && spec.count > groups)
    fail_input("--inject-straggler delays {} random groups per step, but this job has {}", spec.count, groups);
}

std::vector<int> delayed_groups(const StragglerSpec& spec, std::uint64_t seed, std::int64_t step, int groups) {
  // A partial Fisher-Yates shuffle drawn from (seed, step): the first `count` groups of it.
  std::vector<int> order(static_cast<std::size_t>(groups));
  std::iota(order.begin(), order.end(), 0);
  const std::uint64_t stream = rng_substream(RngStream::Straggler, static_cast<std::uint64_t>(step));
  for (int i = 0; i < spec.count && i < groups; ++i) {
    const auto pick = i + static_cast<int>(random_u64(seed, stream, static_cast<std::uint64_t>(i)) %
                                           static_cast<std::uint64_t>(groups - i));
    std::swap(order[static_cast<std::size_t>(i)], order[static_cast<std::size_t>(pick)]);
  }
  std::vector<int> chosen(order.begin(), order.begin() + std::min(spec.count, groups));
  std::sort(chosen.begin(), chosen.end());
  return chosen;
}

double straggler_delay(const StragglerSpec& spec, std::uint64_t seed, std::int64_t step, int group, int groups,
                       double compute_seconds) {
  switch (spec.kind) {
    case StragglerSpec::Kind::None:
      return 0;
    case StragglerSpec::Kind::Slow:
      return std::count(spec.groups.begin(), spec.groups.end(), group) ? (spec.factor - 1) * compute_seconds : 0.0;
    case StragglerSpec::Kind::Random: {
      const auto chosen = delayed_groups(spec, seed, step, groups);
      if (!std::binary_search(chosen.begin(), chosen.end(), group)) return 0;
      return spec.relative ? spec.factor * compute_seconds : spec.seconds;
    }
    case StragglerSpec::Kind::Tail: {
      // Exponential with the given mean, from a uniform keyed by (step, group).
      const std::uint64_t stream = rng_substream(RngStream::Straggler, static_cast<std::uint64_t>(step), 1);
      const double u = random_uniform(seed, stream, static_cast<std::uint64_t>(group));
      return -spec.seconds * std::log1p(-u);
    }
  }
  return 0;
}

}  // namespace tessera
