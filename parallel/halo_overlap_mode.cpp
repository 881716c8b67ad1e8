#include "tessera/parallel/halo_overlap_mode.hpp"

#include <fmt/format.h>

#include "tessera/core/error.hpp"

namespace tessera {

HaloOverlap parse_halo_overlap(const std::string& text) {
  if (text == "auto") return HaloOverlap::Automatic;
  if (text == "always") return HaloOverlap::Always;
  if (text == "never") return HaloOverlap::Never;
  throw InputError(fmt::format("halo overlap '{}': choose auto, always or never", text));
}

const char* to_string(HaloOverlap overlap) {
  switch (overlap) {
    case HaloOverlap::Automatic: return "auto";
    case HaloOverlap::Always: return "always";
    case HaloOverlap::Never: return "never";
  }
  return "?";
}

}  // namespace tessera
