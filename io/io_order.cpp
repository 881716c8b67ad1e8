#include "io_order.hpp"

#include <condition_variable>
#include <mutex>

namespace tessera::io_order {
namespace {

struct Order {
  std::mutex mutex;
  std::condition_variable turn_changed;
  std::uint64_t next = 0;     // the next ticket to hand out
  std::uint64_t current = 0;  // the ticket allowed to run
};

Order& order() {
  static Order instance;
  return instance;
}

thread_local bool holds_turn = false;

}  // namespace

std::uint64_t draw() {
  std::lock_guard lock(order().mutex);
  return order().next++;
}

Turn::Turn() {
  if (holds_turn) return;
  std::unique_lock lock(order().mutex);
  const std::uint64_t ticket = order().next++;
  order().turn_changed.wait(lock, [&] { return order().current == ticket; });
  owner_ = holds_turn = true;
}

Turn::Turn(std::uint64_t ticket) {
  std::unique_lock lock(order().mutex);
  order().turn_changed.wait(lock, [&] { return order().current == ticket; });
  owner_ = holds_turn = true;
}

Turn::~Turn() {
  if (!owner_) return;
  holds_turn = false;
  {
    std::lock_guard lock(order().mutex);
    ++order().current;
  }
  order().turn_changed.notify_all();
}

}  // namespace tessera::io_order
