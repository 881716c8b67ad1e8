#pragma once
// Boxes of a global tensor and the blocks of an extent cut into parts (uneven blocks allowed: part
// i of n elements over p parts is [i*n/p, (i+1)*n/p)).
#include <cstdint>
#include <vector>

namespace tessera {

/// First global index of block `part` of `extent` elements cut into `parts`.
std::int64_t block_begin(std::int64_t extent, int parts, int part);
std::int64_t block_extent(std::int64_t extent, int parts, int part);

/// A box of a global tensor: begin and extent per dimension.
struct Box {
  std::vector<std::int64_t> begin;
  std::vector<std::int64_t> extent;
  std::int64_t numel() const;
  bool operator==(const Box&) const = default;
};

}  // namespace tessera
