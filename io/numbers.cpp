#include "numbers.hpp"

namespace tessera {

std::optional<Number> number_of(hid_t file_type) {
  const std::size_t size = H5Tget_size(file_type);
  switch (H5Tget_class(file_type)) {
    case H5T_INTEGER: {
      const bool is_signed = H5Tget_sign(file_type) != H5T_SGN_NONE;
      switch (size) {
        case 1: return is_signed ? Number::I8 : Number::U8;
        case 2: return is_signed ? Number::I16 : Number::U16;
        case 4: return is_signed ? Number::I32 : Number::U32;
        case 8: return is_signed ? Number::I64 : Number::U64;
        default: return std::nullopt;
      }
    }
    case H5T_FLOAT:
      if (size == 4) return Number::F32;
      if (size == 8) return Number::F64;
      return std::nullopt;
    default: return std::nullopt;
  }
}

hid_t native_type(Number number) {
  switch (number) {
    case Number::U8: return H5T_NATIVE_UINT8;
    case Number::I8: return H5T_NATIVE_INT8;
    case Number::U16: return H5T_NATIVE_UINT16;
    case Number::I16: return H5T_NATIVE_INT16;
    case Number::U32: return H5T_NATIVE_UINT32;
    case Number::I32: return H5T_NATIVE_INT32;
    case Number::U64: return H5T_NATIVE_UINT64;
    case Number::I64: return H5T_NATIVE_INT64;
    case Number::F32: return H5T_NATIVE_FLOAT;
    case Number::F64: return H5T_NATIVE_DOUBLE;
  }
  return H5T_NATIVE_UINT8;
}

std::size_t number_size(Number number) {
  switch (number) {
    case Number::U8: case Number::I8: return 1;
    case Number::U16: case Number::I16: return 2;
    case Number::U32: case Number::I32: case Number::F32: return 4;
    case Number::U64: case Number::I64: case Number::F64: return 8;
  }
  return 1;
}

bool is_integer(Number number) { return number != Number::F32 && number != Number::F64; }

}  // namespace tessera
