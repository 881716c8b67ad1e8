#include "tessera/parallel/delayed_communicator.hpp"

#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <cmath>
#include <optional>
#include <thread>

#include "tessera/core/error.hpp"

namespace tessera {

double CommDelay::seconds(std::size_t bytes) const {
  return latency_seconds + (bytes_per_second > 0 ? static_cast<double>(bytes) / bytes_per_second : 0.0);
}

namespace {

/// A number followed by one of `units` (name, factor); nullopt when the text is not one.
std::optional<double> with_unit(const std::string& text, std::initializer_list<std::pair<const char*, double>> units) {
  for (const auto& [name, factor] : units) {
    const std::string unit(name);
    if (text.size() <= unit.size() || text.compare(text.size() - unit.size(), unit.size(), unit) != 0) continue;
    const std::string number = text.substr(0, text.size() - unit.size());
    try {
      std::size_t used = 0;
      const double value = std::stod(number, &used);
      if (used != number.size() || !std::isfinite(value) || value < 0) return std::nullopt;
      return value * factor;
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }
  return std::nullopt;
}

using SteadyTime = std::chrono::steady_clock::time_point;

SteadyTime after(double seconds) {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
}

class DelayedRequest final : public CommRequest {
 public:
  DelayedRequest(std::unique_ptr<CommRequest> inner, SteadyTime ready) : inner_(std::move(inner)), ready_(ready) {}
  void wait() override {
    inner_->wait();
    std::this_thread::sleep_until(ready_);
  }
  bool test() override { return inner_->test() && std::chrono::steady_clock::now() >= ready_; }
  void cancel() override { inner_->cancel(); }

 private:
  std::unique_ptr<CommRequest> inner_;
  SteadyTime ready_;
};

class DelayedCommunicator final : public Communicator {
 public:
  DelayedCommunicator(std::unique_ptr<Communicator> inner, CommDelay delay) : inner_(std::move(inner)), delay_(delay) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string name() const override { return inner_->name() + " (delayed)"; }
  void barrier() override {
    pause(0);
    inner_->barrier();
  }
  void broadcast(void* data, std::size_t count, DType type, int root) override {
    pause(count * dtype_size(type));
    inner_->broadcast(data, count, type, root);
  }
  void allreduce(void* data, std::size_t count, DType type, ReduceOp op) override {
    pause(count * dtype_size(type));
    inner_->allreduce(data, count, type, op);
  }
  std::unique_ptr<CommRequest> iallreduce(void* data, std::size_t count, DType type, ReduceOp op) override {
    return later(inner_->iallreduce(data, count, type, op), count * dtype_size(type));
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType type, ReduceOp op) override {
    pause(count * dtype_size(type) * static_cast<std::size_t>(size()));
    inner_->reduce_scatter(send, recv, count, type, op);
  }
  void allgather(const void* send, void* recv, std::size_t count, DType type) override {
    pause(count * dtype_size(type));
    inner_->allgather(send, recv, count, type);
  }
  void alltoallv(const void* send, std::span<const std::int64_t> send_counts, std::span<const std::int64_t> send_displs,
                 void* recv, std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                 DType type) override {
    std::int64_t sent = 0;
    for (auto c : send_counts) sent += c;
    pause(static_cast<std::size_t>(sent) * dtype_size(type));
    inner_->alltoallv(send, send_counts, send_displs, recv, recv_counts, recv_displs, type);
  }
  void send(const void* data, std::size_t count, DType type, int dest, int tag) override {
    pause(count * dtype_size(type));
    inner_->send(data, count, type, dest, tag);
  }
  void recv(void* data, std::size_t count, DType type, int source, int tag) override {
    inner_->recv(data, count, type, source, tag);
  }
  std::unique_ptr<CommRequest> isend(const void* data, std::size_t count, DType type, int dest, int tag) override {
    return later(inner_->isend(data, count, type, dest, tag), count * dtype_size(type));
  }
  std::unique_ptr<CommRequest> irecv(void* data, std::size_t count, DType type, int source, int tag) override {
    return later(inner_->irecv(data, count, type, source, tag), count * dtype_size(type));
  }
  bool moves_gpu_memory() const override { return inner_->moves_gpu_memory(); }
  std::unique_ptr<Communicator> split(int color, int key) const override {
    return delayed(inner_->split(color, key), delay_);
  }
  std::unique_ptr<Communicator> duplicate() const override { return delayed(inner_->duplicate(), delay_); }
  int mpi_handle() const override { return inner_->mpi_handle(); }
  [[noreturn]] void abort(int exit_code) override {
    inner_->abort(exit_code);
    std::abort();  // not reached: the inner abort ends the job
  }

 private:
  void pause(std::size_t bytes) const { std::this_thread::sleep_until(after(delay_.seconds(bytes))); }
  std::unique_ptr<CommRequest> later(std::unique_ptr<CommRequest> request, std::size_t bytes) const {
    return std::make_unique<DelayedRequest>(std::move(request), after(delay_.seconds(bytes)));
  }
  std::unique_ptr<Communicator> inner_;
  CommDelay delay_;
};

}  // namespace

CommDelay parse_comm_delay(const std::string& text) {
  const auto bad = [&] {
    return InputError(fmt::format("--inject-comm-delay expects LATENCY or LATENCY,BANDWIDTH (e.g. 20ms or "
                                  "20ms,1GB/s), got '{}'",
                                  text));
  };
  if (text.empty() || text == "0") return {};
  const auto comma = text.find(',');
  CommDelay delay;
  const auto latency = with_unit(text.substr(0, comma), {{"us", 1e-6}, {"ms", 1e-3}, {"s", 1.0}});
  if (!latency) throw bad();
  delay.latency_seconds = *latency;
  if (comma != std::string::npos) {
    const auto bandwidth = with_unit(text.substr(comma + 1), {{"GB/s", 1e9}, {"MB/s", 1e6}, {"KB/s", 1e3}, {"B/s", 1.0}});
    if (!bandwidth || *bandwidth <= 0) throw bad();
    delay.bytes_per_second = *bandwidth;
  }
  return delay;
}

std::unique_ptr<Communicator> delayed(std::unique_ptr<Communicator> inner, CommDelay delay) {
  if (!delay.any()) return inner;
  return std::make_unique<DelayedCommunicator>(std::move(inner), delay);
}

}  // namespace tessera
