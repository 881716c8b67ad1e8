// libFuzzer target: Model::parse on arbitrary text, then what the rest of Tessera asks of a model
// that parsed (its plan info, its parameter count).
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_common.hpp"
#include "tessera/train/model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  tessera::fuzz::expect_only_input_errors([&] {
    tessera::Model model = tessera::Model::parse(text, "<fuzz>");
    (void)model.plan_info(64);
    (void)model.parameter_count();
  });
  return 0;
}
