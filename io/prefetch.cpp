#include "tessera/io/prefetch.hpp"

#include "io_order.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/signal_mask.hpp"

namespace tessera {

Prefetcher::Prefetcher(std::shared_ptr<Dataset> dataset) : dataset_(std::move(dataset)) {
  TESSERA_CHECK(dataset_ != nullptr, "Prefetcher: no dataset");
  thread_ = std::thread([this] {
    block_stop_signals();  // the main thread takes them
    run();
  });
}

Prefetcher::~Prefetcher() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  thread_.join();
}

void Prefetcher::submit(ReadRequest request) {
  auto slot = std::make_shared<Slot>();
  slot->request = std::move(request);
  {
    // Drawn in the caller's thread, in program order: the same order on every rank.
    slot->ticket = io_order::draw();
    std::lock_guard lock(mutex_);
    slots_.push_back(std::move(slot));
  }
  work_ready_.notify_one();
}

Batch Prefetcher::take() {
  std::unique_lock lock(mutex_);
  TESSERA_CHECK(!slots_.empty(), "Prefetcher::take: nothing was submitted");
  std::shared_ptr<Slot> slot = slots_.front();
  batch_ready_.wait(lock, [&] { return slot->done; });
  slots_.pop_front();
  lock.unlock();
  if (slot->error) std::rethrow_exception(slot->error);
  return std::move(slot->batch);
}

std::size_t Prefetcher::pending() const {
  std::lock_guard lock(mutex_);
  return slots_.size();
}

void Prefetcher::run() {
  for (;;) {
    std::shared_ptr<Slot> slot;
    {
      std::unique_lock lock(mutex_);
      // The oldest slot not yet read. On shutdown, every submitted read still runs: each read is
      // collective, and dropping one here but not on another rank would hang that rank.
      auto next = [&]() -> std::shared_ptr<Slot> {
        for (const auto& s : slots_) {
          if (!s->done) return s;
        }
        return nullptr;
      };
      work_ready_.wait(lock, [&] { return stopping_ || next() != nullptr; });
      slot = next();
      if (!slot) return;  // stopping, and nothing left to read
    }
    // Only this thread touches the slot's request and batch until `done` is set.
    try {
      io_order::Turn turn(slot->ticket);
      dataset_->read(slot->request.indices, slot->request.box, slot->batch.inputs, slot->batch.targets);
      slot->batch.indices = slot->request.indices;
    } catch (...) {
      slot->error = std::current_exception();
    }
    {
      std::lock_guard lock(mutex_);
      slot->done = true;
    }
    batch_ready_.notify_all();
  }
}

}  // namespace tessera
