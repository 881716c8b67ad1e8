#include "tessera/core/precision.hpp"

#include "tessera/core/error.hpp"

namespace tessera {

std::string_view precision_name(Precision precision) { return precision == Precision::BF16 ? "bf16" : "fp32"; }

Precision parse_precision(std::string_view text, const std::string& context) {
  if (text == "fp32") return Precision::F32;
  if (text == "bf16") return Precision::BF16;
  fail_input("{}: precision must be fp32 or bf16, got '{}'", context, text);
}

}  // namespace tessera
