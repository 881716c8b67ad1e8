// eager's partial collective (partial_allreduce.hpp). Each group's rank 0 runs the rounds: it tells
// the others' rank 0 which step its group handed last, fires round r once a quorum handed step r and
// every group handed step r − staleness, and tells its own group's ranks to fire too, with the step
// up to which they put their gradients in, so that a group's ranks contribute alike.
#include "tessera/parallel/partial_allreduce.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <thread>

#include "tessera/core/error.hpp"

namespace tessera {
namespace {

constexpr int kReadyTag = 7401;  ///< rank 0 of a group to the others': the newest step handed
constexpr int kFireTag = 7402;   ///< rank 0 of a group to its ranks: {round, up to which step} (round −1: stop)
constexpr auto kPoll = std::chrono::microseconds(100);

/// Waits for `request`, sleeping between tests, so that an agent never spins a core.
void poll(CommRequest& request) {
  while (!request.test()) std::this_thread::sleep_for(kPoll);
}

}  // namespace

PartialAllreduce::PartialAllreduce(Communicator& across, Communicator& group, int quorum, int staleness,
                                   std::size_t count, std::int64_t first, std::vector<PartialItem> pending)
    : across_(across),
      group_(group),
      quorum_(quorum),
      staleness_(staleness),
      count_(count),
      next_round_(first),
      handed_(first - 1) {
  if (quorum_ < 1 || quorum_ > across_.size())
    fail("partial allreduce: quorum {} of {} groups", quorum_, across_.size());
  for (auto& item : pending) {
    if (item.values.size() != count_) fail("partial allreduce: a pending gradient of {} values, not {}", item.values.size(), count_);
    items_.push_back(std::move(item));
  }
  std::sort(items_.begin(), items_.end(), [](const PartialItem& a, const PartialItem& b) { return a.step < b.step; });
  agent_ = std::thread([this] { run(); });
}

PartialAllreduce::~PartialAllreduce() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  if (agent_.joinable()) agent_.join();
}

void PartialAllreduce::contribute(std::int64_t step, const float* values) {
  {
    std::lock_guard lock(mutex_);
    if (step != handed_ + 1) fail("partial allreduce: step {} handed after step {}", step, handed_);
    items_.push_back({step, std::vector<float>(values, values + count_)});
    handed_ = step;
  }
  changed_.notify_all();
}

PartialRound PartialAllreduce::result(std::int64_t step) {
  const auto begin = std::chrono::steady_clock::now();
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return results_.count(step) > 0 || failed_; });
  if (failed_) fail("partial allreduce: the agent of the rounds failed");
  PartialRound out = std::move(results_[step]);
  results_.erase(step);
  out.wait_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  return out;
}

std::vector<PartialItem> PartialAllreduce::pending() const {
  std::lock_guard lock(mutex_);
  return {items_.begin(), items_.end()};
}

void PartialAllreduce::run() {
  try {
    if (group_.rank() == 0) lead();
    else follow();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera: error: eager rounds: %s\n", e.what());
    {
      std::lock_guard lock(mutex_);
      failed_ = true;
    }
    changed_.notify_all();
  }
}

void PartialAllreduce::lead() {
  const int groups = across_.size(), me = across_.rank();
  std::vector<std::int64_t> ready(static_cast<std::size_t>(groups), next_round_ - 1), inbox(ready.size());
  std::vector<std::unique_ptr<CommRequest>> receives(ready.size());
  for (int p = 0; p < groups; ++p)
    if (p != me) receives[static_cast<std::size_t>(p)] = across_.irecv(&inbox[static_cast<std::size_t>(p)], 1, DType::I64, p, kReadyTag);
  struct Sent {
    std::unique_ptr<std::int64_t> value;
    std::unique_ptr<CommRequest> request;
  };
  std::deque<Sent> sent;
  std::int64_t announced = next_round_ - 1, round = next_round_;
  // On an error the notices still awaited are cancelled, so that their requests can go.
  struct CancelOnError {
    std::vector<std::unique_ptr<CommRequest>>& receives;
    ~CancelOnError() {
      if (std::uncaught_exceptions() == 0) return;
      for (auto& receive : receives)
        if (receive) receive->cancel();
    }
  } cancel_on_error{receives};
  for (;;) {
    for (int p = 0; p < groups; ++p) {
      auto& receive = receives[static_cast<std::size_t>(p)];
      while (receive && receive->test()) {
        ready[static_cast<std::size_t>(p)] = inbox[static_cast<std::size_t>(p)];
        receive = across_.irecv(&inbox[static_cast<std::size_t>(p)], 1, DType::I64, p, kReadyTag);
      }
    }
    std::int64_t handed = 0;
    bool stop = false;
    {
      std::lock_guard lock(mutex_);
      handed = handed_;
      stop = stop_;
    }
    if (handed > announced) {
      announced = handed;
      for (int p = 0; p < groups; ++p) {
        if (p == me) continue;
        auto value = std::make_unique<std::int64_t>(handed);
        auto request = across_.isend(value.get(), 1, DType::I64, p, kReadyTag);
        sent.push_back({std::move(value), std::move(request)});
      }
    }
    while (!sent.empty() && sent.front().request->test()) sent.pop_front();
    ready[static_cast<std::size_t>(me)] = handed;
    const auto quorum = std::count_if(ready.begin(), ready.end(), [&](std::int64_t r) { return r >= round; });
    const std::int64_t slowest = *std::min_element(ready.begin(), ready.end());
    if (quorum >= quorum_ && slowest >= round - staleness_) {
      std::int64_t message[2] = {round, handed};
      for (int r = 1; r < group_.size(); ++r) group_.send(message, 2, DType::I64, r, kFireTag);
      fire(round, handed);
      ++round;
      continue;
    }
    // Every rank took the same last round's result (so every rank joined it), and every group's
    // last notice has arrived: nothing more will be sent to this rank.
    if (stop && round > handed && slowest >= handed) break;
    std::unique_lock lock(mutex_);
    changed_.wait_for(lock, kPoll, [&] { return handed_ > announced || stop_ != stop; });
  }
  for (auto& s : sent) poll(*s.request);
  for (auto& receive : receives)
    if (receive) receive->cancel();
  std::int64_t message[2] = {-1, -1};
  for (int r = 1; r < group_.size(); ++r) group_.send(message, 2, DType::I64, r, kFireTag);
}

void PartialAllreduce::follow() {
  for (;;) {
    std::int64_t message[2] = {0, 0};
    auto request = group_.irecv(message, 2, DType::I64, 0, kFireTag);
    poll(*request);
    if (message[0] < 0) return;
    {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [&] { return handed_ >= message[1] || stop_; });
      if (handed_ < message[1]) fail("partial allreduce: stopped before step {} was handed", message[1]);
    }
    fire(message[0], message[1]);
  }
}

void PartialAllreduce::fire(std::int64_t round, std::int64_t upto) {
  const auto groups = static_cast<std::size_t>(across_.size()), me = static_cast<std::size_t>(across_.rank());
  // The sum, then per group: how many gradients it put in, and the oldest one's age.
  std::vector<float> payload(count_ + 2 * groups, 0.0f);
  int taken = 0;
  std::int64_t oldest = round;
  {
    std::lock_guard lock(mutex_);
    while (!items_.empty() && items_.front().step <= upto) {
      const auto& values = items_.front().values;
      for (std::size_t k = 0; k < count_; ++k) payload[k] += values[k];
      oldest = std::min(oldest, items_.front().step);
      items_.pop_front();
      ++taken;
    }
  }
  payload[count_ + me] = static_cast<float>(taken);
  payload[count_ + groups + me] = static_cast<float>(round - oldest);
  poll(*across_.iallreduce(payload.data(), payload.size(), DType::F32, ReduceOp::Sum));
  PartialRound out;
  out.sum.assign(payload.begin(), payload.begin() + static_cast<std::ptrdiff_t>(count_));
  for (std::size_t g = 0; g < groups; ++g) {
    out.contributors += payload[count_ + g] > 0;
    out.staleness = std::max(out.staleness, static_cast<std::int64_t>(payload[count_ + groups + g]));
  }
  {
    std::lock_guard lock(mutex_);
    results_[round] = std::move(out);
  }
  changed_.notify_all();
}

}  // namespace tessera
