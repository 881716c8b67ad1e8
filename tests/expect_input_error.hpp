#pragma once
// One check for bad input, shared by the tests: `body` must throw an InputError whose message
// contains every one of `needles`.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "tessera/core/error.hpp"

namespace tessera {

inline void expect_input_error(const std::function<void()>& body, const std::vector<std::string>& needles) {
  try {
    body();
  } catch (const InputError& e) {
    for (const auto& needle : needles)
      EXPECT_NE(e.message().find(needle), std::string::npos) << "message '" << e.message() << "' lacks '" << needle
                                                            << "'";
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "threw something other than an InputError: " << e.what();
    return;
  }
  ADD_FAILURE() << "did not throw an InputError" << (needles.empty() ? "" : " (expected '" + needles.front() + "')");
}

}  // namespace tessera
