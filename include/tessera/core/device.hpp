#pragma once
#include <string>

namespace tessera {

enum class DeviceKind { Host, Cuda };

/// Where a tensor's memory lives. Chosen at run time; layers are not templated on it.
struct Device {
  DeviceKind kind = DeviceKind::Host;
  int index = 0;

  static Device host() { return {}; }
  static Device cuda(int index) { return {DeviceKind::Cuda, index}; }
  bool is_host() const { return kind == DeviceKind::Host; }
  bool operator==(const Device&) const = default;
  std::string to_string() const;
};

}  // namespace tessera
