#include "tessera/parallel/collective_guard.hpp"

#include <exception>
#include <vector>

namespace tessera {

AgreedFailure::AgreedFailure(std::string origin_message, int exit_code, int failed_rank, bool is_origin)
    : Error(fmt::format("rank {} failed: {}", failed_rank, origin_message)),
      origin_message_(std::move(origin_message)),
      exit_code_(exit_code),
      failed_rank_(failed_rank),
      is_origin_(is_origin) {}

void collectively(Communicator& comm, const std::function<void()>& body) {
  std::string message;
  int code = 0;
  try {
    body();
  } catch (const AgreedFailure&) {
    throw;  // already agreed: every rank of `comm` is throwing it now
  } catch (const Error& e) {
    message = e.message();
    code = exit_code_for(e);
  } catch (const std::exception& e) {
    message = e.what();
    code = 1;
  }
  // Every rank learns every rank's code; the lowest failing rank speaks for the job.
  const std::vector<int> codes = comm.allgather_value(code);
  for (int r = 0; r < comm.size(); ++r) {
    const int c = codes[static_cast<std::size_t>(r)];
    if (c == 0) continue;
    throw AgreedFailure(r == comm.rank() ? message : std::string("(see rank ") + std::to_string(r) + ")", c, r,
                        r == comm.rank());
  }
}

}  // namespace tessera
