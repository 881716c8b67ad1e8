#include "tessera/core/device.hpp"

#include <fmt/format.h>

namespace tessera {
std::string Device::to_string() const {
  return kind == DeviceKind::Host ? std::string("host") : fmt::format("cuda:{}", index);
}
}  // namespace tessera
