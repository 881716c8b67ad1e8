// libFuzzer target: import_onnx on arbitrary bytes (seeded with tests/fuzz/onnx_seeds), then the
// export of what imported.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_common.hpp"
#include "tessera/train/onnx.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  tessera::fuzz::expect_only_input_errors([&] {
    const tessera::ImportedModel imported = tessera::import_onnx(bytes, "<fuzz>");
    (void)tessera::export_onnx(imported.model_text, "<fuzz>", imported.tensors);
  });
  return 0;
}
