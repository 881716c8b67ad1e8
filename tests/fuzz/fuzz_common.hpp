#pragma once
// What the parser fuzz targets share: a bad file must end in an InputError (one clear message);
// any other exception is a bug, and so is a crash or a sanitizer report (libFuzzer catches those).
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "tessera/core/error.hpp"

namespace tessera::fuzz {

template <typename Body> void expect_only_input_errors(Body&& body) {
  try {
    body();
  } catch (const InputError&) {
    // A refused file: the expected outcome for most inputs.
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: not an InputError: %s\n", e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "fuzz: an exception that is not a std::exception\n");
    std::abort();
  }
}

}  // namespace tessera::fuzz
