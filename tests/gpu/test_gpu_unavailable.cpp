// Where a GPU is asked for and there is none (a build without CUDA, no driver, no device, or a
// device number past the last one), Tessera says so clearly instead of failing later.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/layers/dnn_backend.hpp"
#include "tessera/tensor/tensor.hpp"

namespace tessera {
namespace {

std::string message_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

TEST(GpuUnavailable, AskingForAMissingGpuIsAClearError) {
  const int count = cuda::device_count();
  const Device missing = Device::cuda(count);  // one past the last GPU (GPU 0 where there is none)
  const std::string tensor = message_of([&] { Tensor t(Shape({4}), missing); });
  ASSERT_FALSE(tensor.empty()) << "a tensor on a missing GPU was created";
  if (count == 0) {
    EXPECT_FALSE(cuda::unavailable_reason().empty());
    EXPECT_NE(tensor.find(cuda::unavailable_reason()), std::string::npos) << tensor;
    const std::string backend = message_of([] { make_cuda_backend(); });
    EXPECT_NE(backend.find(cuda::unavailable_reason()), std::string::npos) << backend;
  } else {
    EXPECT_NE(tensor.find("sees " + std::to_string(count)), std::string::npos) << tensor;
  }
  if (!cuda::built()) {
    EXPECT_NE(tensor.find("TESSERA_ENABLE_CUDA=ON"), std::string::npos) << tensor;
    EXPECT_EQ(cuda::device_count(), 0);
  }
}

}  // namespace
}  // namespace tessera
