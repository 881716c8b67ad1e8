#include "tessera/core/error.hpp"

namespace tessera {
namespace {
int g_process_rank = -1;
std::string with_rank(const std::string& message, int rank) {
  return rank >= 0 ? fmt::format("[rank {}] {}", rank, message) : message;
}
}  // namespace

void set_process_rank(int rank) { g_process_rank = rank; }
int process_rank() { return g_process_rank; }

Error::Error(const std::string& message)
    : std::runtime_error(with_rank(message, g_process_rank)), message_(message), rank_(g_process_rank) {}

int exit_code_for(const std::exception& error) {
  if (dynamic_cast<const InputError*>(&error) != nullptr) return 2;
  if (dynamic_cast<const NumericError*>(&error) != nullptr) return 3;
  return 1;
}

}  // namespace tessera
