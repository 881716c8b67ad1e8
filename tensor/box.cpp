#include "tessera/tensor/box.hpp"

namespace tessera {

std::int64_t block_begin(std::int64_t extent, int parts, int part) {
  return extent * part / parts;
}

std::int64_t block_extent(std::int64_t extent, int parts, int part) {
  return block_begin(extent, parts, part + 1) - block_begin(extent, parts, part);
}

std::int64_t Box::numel() const {
  std::int64_t n = 1;
  for (auto e : extent) n *= e;
  return n;
}

}  // namespace tessera
