#include "idx.hpp"

#include <zlib.h>

#include <array>
#include <filesystem>
#include <limits>

#include "tessera/core/error.hpp"

namespace tessera {
namespace {

constexpr int kUnsignedByte = 0x08;

/// A gzFile closed on scope exit (zlib reads plain files transparently too).
class GzFile {
 public:
  explicit GzFile(const std::string& path) : path_(path) {
    if (!std::filesystem::exists(path)) fail_input("{}: no such IDX file", path);
    file_ = gzopen(path.c_str(), "rb");
    if (file_ == nullptr) fail_input("{}: cannot open", path);
  }
  ~GzFile() {
    if (file_ != nullptr) gzclose(file_);
  }
  GzFile(const GzFile&) = delete;
  GzFile& operator=(const GzFile&) = delete;

  /// Reads up to `bytes`; returns how many were read. Fails on a corrupt stream.
  std::size_t read(void* buffer, std::size_t bytes) {
    std::size_t total = 0;
    auto* out = static_cast<unsigned char*>(buffer);
    while (total < bytes) {
      // gzread takes an unsigned count: read in chunks below its limit.
      const auto chunk = static_cast<unsigned>(std::min<std::size_t>(bytes - total, 1u << 30));
      const int got = gzread(file_, out + total, chunk);
      if (got < 0) {
        int code = 0;
        fail_input("{}: corrupt gzip data ({})", path_, gzerror(file_, &code));
      }
      if (got == 0) break;
      total += static_cast<std::size_t>(got);
    }
    return total;
  }

 private:
  std::string path_;
  gzFile file_ = nullptr;
};

std::uint32_t big_endian(const unsigned char* bytes) {
  return (std::uint32_t{bytes[0]} << 24) | (std::uint32_t{bytes[1]} << 16) | (std::uint32_t{bytes[2]} << 8) |
         std::uint32_t{bytes[3]};
}

std::vector<std::int64_t> parse_header(GzFile& file, const std::string& path, int expected_dims) {
  std::array<unsigned char, 4> magic{};
  if (file.read(magic.data(), magic.size()) != magic.size()) fail_input("{}: too short for an IDX file", path);
  const std::uint32_t expected = (kUnsignedByte << 8) | static_cast<std::uint32_t>(expected_dims);
  if (big_endian(magic.data()) != expected) {
    fail_input("{}: bad magic number 0x{:08x}; expected 0x{:08x} (IDX, unsigned bytes, {} dimensions)", path,
               big_endian(magic.data()), expected, expected_dims);
  }
  std::vector<std::int64_t> dims;
  for (int i = 0; i < expected_dims; ++i) {
    std::array<unsigned char, 4> extent{};
    if (file.read(extent.data(), extent.size()) != extent.size()) fail_input("{}: truncated IDX header", path);
    dims.push_back(big_endian(extent.data()));
  }
  return dims;
}

}  // namespace

std::vector<std::int64_t> read_idx_header(const std::string& path, int expected_dims) {
  GzFile file(path);
  return parse_header(file, path, expected_dims);
}

IdxArray read_idx(const std::string& path, int expected_dims) {
  GzFile file(path);
  IdxArray array;
  array.dims = parse_header(file, path, expected_dims);
  std::size_t count = 1;
  for (auto d : array.dims) count *= static_cast<std::size_t>(d);
  array.data.resize(count);
  const std::size_t got = file.read(array.data.data(), count);
  if (got != count) fail_input("{}: truncated: {} data bytes, the header promises {}", path, got, count);
  unsigned char extra = 0;
  if (file.read(&extra, 1) != 0) fail_input("{}: longer than its header says ({} data bytes)", path, count);
  return array;
}

}  // namespace tessera
