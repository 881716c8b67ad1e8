// The default grouped exchange of Communicator: a nonblocking receive and send per message.
#include "tessera/core/communicator.hpp"

#include "tessera/core/error.hpp"

#include <utility>

namespace tessera {
namespace {

/// Waits for every request of a group (receives first: they were posted first).
class RequestGroup final : public CommRequest {
 public:
  explicit RequestGroup(std::vector<std::unique_ptr<CommRequest>> requests) : requests_(std::move(requests)) {}
  void wait() override {
    for (auto& request : requests_) request->wait();
  }
  bool test() override {
    bool done = true;
    for (auto& request : requests_) done = request->test() && done;  // tests each: each progresses
    return done;
  }

 private:
  std::vector<std::unique_ptr<CommRequest>> requests_;
};

}  // namespace

std::unique_ptr<CommRequest> Communicator::exchange(std::span<const Message> sends, std::span<const Message> receives,
                                                    DType type, int tag) {
  // Peers are checked before anything is posted; a send that still fails to post (the transport
  // refuses it) leaves receives to cancel, below.
  for (const auto* messages : {&receives, &sends})
    for (const Message& m : *messages)
      if (m.peer < 0 || m.peer >= size())
        fail("{}: a grouped exchange with rank {}, but the communicator has ranks 0-{}", name(), m.peer, size() - 1);
  std::vector<std::unique_ptr<CommRequest>> requests;
  requests.reserve(sends.size() + receives.size());
  try {
    for (const Message& m : receives) requests.push_back(irecv(m.data, m.count, type, m.peer, tag));
    for (const Message& m : sends) requests.push_back(isend(m.data, m.count, type, m.peer, tag));
  } catch (...) {
    // A message that cannot be posted fails the exchange; the receives already posted may never
    // be matched (this rank's peers see the failure too), and their destructors would wait for
    // them forever: cancel them first.
    for (std::size_t i = 0; i < requests.size() && i < receives.size(); ++i) requests[i]->cancel();
    throw;
  }
  return std::make_unique<RequestGroup>(std::move(requests));
}

}  // namespace tessera
