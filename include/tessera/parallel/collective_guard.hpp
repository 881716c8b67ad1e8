#pragma once
// Makes every rank of a communicator fail together. Work whose errors may differ between ranks
// (reading files, building the model, opening data) runs inside `collectively`: afterwards the
// ranks agree whether any of them failed, and if so every rank throws the same AgreedFailure —
// carrying the lowest failing rank's message and exit code — so no rank is left waiting in a
// collective for one that is gone, and the job can end cleanly with one message and one code.
#include <functional>
#include <string>

#include "tessera/core/communicator.hpp"
#include "tessera/core/error.hpp"

namespace tessera {

class AgreedFailure : public Error {
 public:
  AgreedFailure(std::string origin_message, int exit_code, int failed_rank, bool is_origin);
  int exit_code() const { return exit_code_; }
  int failed_rank() const { return failed_rank_; }
  /// True on the rank whose error this is (the one that should print it).
  bool is_origin() const { return is_origin_; }
  const std::string& origin_message() const { return origin_message_; }

 private:
  std::string origin_message_;
  int exit_code_;
  int failed_rank_;
  bool is_origin_;
};

/// Runs `body` on every rank; if it throws on any rank, throws AgreedFailure on all.
void collectively(Communicator& comm, const std::function<void()>& body);

}  // namespace tessera
