#pragma once
// One process-wide order for the io level's HDF5 work.
//
// HDF5 is not thread-safe, and its collective reads must be issued in the same order on every
// rank, or two ranks wait in different collectives forever. Both are solved by tickets: an
// operation draws a ticket in the thread that requests it (the training thread, in program order,
// hence in the same order on every rank), and runs only when its ticket is current. A Prefetcher
// draws its ticket at submit() and its background thread waits for it, so a direct read issued
// after a submit runs after that prefetched read, on every rank alike. Only one operation runs at
// a time, so HDF5 is never entered by two threads.
#include <cstdint>

namespace tessera::io_order {

/// The next ticket, in the calling thread's program order.
std::uint64_t draw();

/// Holds the turn for a scope: waits until `ticket` is current; on exit the next ticket runs.
/// The default constructor draws a ticket now, unless this thread already holds the turn (then
/// it is a no-op, so a read nested in a prefetched read does not wait for itself).
class Turn {
 public:
  Turn();
  explicit Turn(std::uint64_t ticket);
  ~Turn();
  Turn(const Turn&) = delete;
  Turn& operator=(const Turn&) = delete;

 private:
  bool owner_ = false;
};

}  // namespace tessera::io_order
