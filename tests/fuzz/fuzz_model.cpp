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
    // A small weight budget: a mutated file easily asks for GiBs of weights (refused with an
    // InputError beyond it), and the fuzzer's memory limit would end the run instead.
    tessera::ModelOptions options;
    options.largest_weights = std::int64_t{1} << 24;
    tessera::Model model = tessera::Model::parse(text, "<fuzz>", options);
    (void)model.plan_info(64);
    (void)model.parameter_count();
  });
  return 0;
}
