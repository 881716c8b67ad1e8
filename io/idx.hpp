#pragma once
// The IDX format of (Fashion-)MNIST: a big-endian header (0, 0, type, dimension count, then one
// 32-bit extent per dimension) followed by the data, row-major. Read gzipped or plain.
#include <cstdint>
#include <string>
#include <vector>

namespace tessera {

struct IdxArray {
  std::vector<std::int64_t> dims;
  std::vector<std::uint8_t> data;
};

/// The extents of an IDX file of unsigned bytes with `expected_dims` dimensions (reads only the
/// header). Throws InputError naming the file on a missing file or a bad magic number.
std::vector<std::int64_t> read_idx_header(const std::string& path, int expected_dims);

/// The whole file; also checks the data is exactly as long as the header says.
IdxArray read_idx(const std::string& path, int expected_dims);

}  // namespace tessera
