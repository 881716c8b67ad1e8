#pragma once
// A testing aid for experiments on one machine: a communicator that makes every operation of
// another take at least a fixed latency plus its bytes over a bandwidth (--inject-comm-delay), as
// a slow link between replica groups would. A nonblocking operation's delay runs from its start,
// so whatever the caller computes meanwhile hides it, as it would hide a real transfer.
#include <memory>
#include <string>

#include "tessera/core/communicator.hpp"

namespace tessera {

/// A latency per operation plus bytes over a bandwidth.
struct CommDelay {
  double latency_seconds = 0;
  double bytes_per_second = 0;  ///< 0: no bandwidth term
  bool any() const { return latency_seconds > 0 || bytes_per_second > 0; }
  /// Seconds an operation moving `bytes` takes at least.
  double seconds(std::size_t bytes) const;
  bool operator==(const CommDelay&) const = default;
};

/// "20ms", "20ms,1GB/s", "500us,100MB/s", "0" (latency in s, ms or us; bandwidth in B/s, KB/s,
/// MB/s or GB/s, powers of 1000); an InputError naming --inject-comm-delay otherwise.
CommDelay parse_comm_delay(const std::string& text);

/// `inner` with every operation delayed by `delay` (moves_gpu_memory, split and the rest as `inner`'s;
/// communicators split from it are delayed too).
std::unique_ptr<Communicator> delayed(std::unique_ptr<Communicator> inner, CommDelay delay);

}  // namespace tessera
