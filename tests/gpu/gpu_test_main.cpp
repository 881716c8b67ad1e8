// The main of the GPU test binaries. Without a usable GPU (no CUDA in this build, no driver, no
// device) it prints why and exits with 77, which ctest reports as "Skipped" (SKIP_RETURN_CODE),
// never as passed. With one, it runs the tests on GPU 0 (or $TESSERA_TEST_GPU).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/layers/runtime.hpp"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (tessera::cuda::device_count() == 0) {
    std::printf("SKIPPED: no GPU to test on: %s\n", tessera::cuda::unavailable_reason().c_str());
    return 77;
  }
  try {
    const char* chosen = std::getenv("TESSERA_TEST_GPU");
    const int device = chosen ? std::atoi(chosen) : 0;
    tessera::cuda::set_device(device);
    std::printf("GPU %d: %s\n", device, tessera::cuda::describe_device(device).c_str());
    tessera::LayersRuntime runtime(1);
    return RUN_ALL_TESTS();
  } catch (const std::exception& error) {
    std::fprintf(stderr, "GPU tests could not start: %s\n", error.what());
    return 1;
  }
}
