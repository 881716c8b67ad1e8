#include "tessera/core/dtype.hpp"

namespace tessera {
std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::F64: return "float64";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::U8: return "uint8";
  }
  return "unknown";
}
}  // namespace tessera
