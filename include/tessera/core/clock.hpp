#pragma once
// The wall clock that timings read: steady (never set back), in seconds as a double.
#include <chrono>

namespace tessera {

using Clock = std::chrono::steady_clock;

/// Seconds elapsed since `start`.
inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace tessera
