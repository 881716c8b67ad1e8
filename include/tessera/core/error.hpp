#pragma once
// Errors carry the MPI rank of the process that raised them and a context chain.
#include <stdexcept>
#include <string>
#include <fmt/format.h>

namespace tessera {

/// Rank of this process in the world (set once by the runtime; -1 before MPI starts).
void set_process_rank(int rank);
int process_rank();

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message);
  /// The message without the "[rank r]" prefix.
  const std::string& message() const { return message_; }
  int rank() const { return rank_; }

 private:
  std::string message_;
  int rank_;
};

/// Input the user gave us is wrong (files, options, plans). Exit code 2.
class InputError : public Error {
 public:
  using Error::Error;
};

/// Training diverged (NaN/Inf loss or gradients). Exit code 3.
class NumericError : public Error {
 public:
  using Error::Error;
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

template <typename... Args>
[[noreturn]] void fail_input(fmt::format_string<Args...> format, Args&&... args) {
  throw InputError(fmt::format(format, std::forward<Args>(args)...));
}

/// Exit code the runtime uses for an exception of this type.
int exit_code_for(const std::exception& error);

}  // namespace tessera

#define TESSERA_CHECK(condition, ...)                                         \
  do {                                                                        \
    if (!(condition)) ::tessera::fail(__VA_ARGS__);                           \
  } while (false)
