#pragma once
// The element types the io level reads. Data is read from the file in its own type (as the
// native type of the same size and sign) and converted here: HDF5 1.10 turns a collective read
// into an independent one whenever it has to convert types itself.
#include <hdf5.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>

namespace tessera {

enum class Number { U8, I8, U16, I16, U32, I32, U64, I64, F32, F64 };

/// The Number of a file type (any byte order), or none for strings, compounds, odd sizes...
std::optional<Number> number_of(hid_t file_type);
/// The matching native memory type (H5T_NATIVE_UINT8, ...).
hid_t native_type(Number number);
std::size_t number_size(Number number);
bool is_integer(Number number);

/// Converts `count` elements of type `number` at `source` (possibly unaligned) to `Out`.
template <typename Out>
void convert_numbers(Number number, const void* source, std::size_t count, Out* destination) {
  auto run = [&](auto sample) {
    using In = decltype(sample);
    const auto* bytes = static_cast<const unsigned char*>(source);
    for (std::size_t i = 0; i < count; ++i) {
      In value;
      std::memcpy(&value, bytes + i * sizeof(In), sizeof(In));
      destination[i] = static_cast<Out>(value);
    }
  };
  switch (number) {
    case Number::U8: run(std::uint8_t{}); break;
    case Number::I8: run(std::int8_t{}); break;
    case Number::U16: run(std::uint16_t{}); break;
    case Number::I16: run(std::int16_t{}); break;
    case Number::U32: run(std::uint32_t{}); break;
    case Number::I32: run(std::int32_t{}); break;
    case Number::U64: run(std::uint64_t{}); break;
    case Number::I64: run(std::int64_t{}); break;
    case Number::F32: run(float{}); break;
    case Number::F64: run(double{}); break;
  }
}

}  // namespace tessera
