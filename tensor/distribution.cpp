#include "tessera/tensor/distribution.hpp"

#include <fmt/format.h>

#include "tessera/core/error.hpp"

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

Distribution::Distribution(std::vector<int> grid_shape, std::vector<DimSplit> splits)
    : grid_shape_(std::move(grid_shape)), splits_(std::move(splits)) {
  std::vector<bool> used(grid_shape_.size(), false);
  for (const auto& s : splits_) {
    if (s.grid_axis < 0) continue;
    TESSERA_CHECK(s.grid_axis < static_cast<int>(grid_shape_.size()),
                  "Distribution: grid axis {} outside a {}-axis grid", s.grid_axis, grid_shape_.size());
    TESSERA_CHECK(!used[static_cast<std::size_t>(s.grid_axis)],
                  "Distribution: grid axis {} splits two dimensions", s.grid_axis);
    used[static_cast<std::size_t>(s.grid_axis)] = true;
    TESSERA_CHECK(s.halo >= 0, "Distribution: negative halo");
  }
  for (int g : grid_shape_) TESSERA_CHECK(g >= 1, "Distribution: grid axis of extent {}", g);
}

Distribution Distribution::replicated(std::vector<int> grid_shape, int tensor_rank) {
  return Distribution(std::move(grid_shape), std::vector<DimSplit>(static_cast<std::size_t>(tensor_rank)));
}

Distribution Distribution::sample_split(std::vector<int> grid_shape, int tensor_rank, int axis) {
  std::vector<DimSplit> splits(static_cast<std::size_t>(tensor_rank));
  splits.at(0).grid_axis = axis;
  return Distribution(std::move(grid_shape), std::move(splits));
}

int Distribution::parts(int dim) const {
  const auto& s = splits_.at(static_cast<std::size_t>(dim));
  return s.grid_axis < 0 ? 1 : grid_shape_[static_cast<std::size_t>(s.grid_axis)];
}

int Distribution::grid_size() const {
  int n = 1;
  for (int g : grid_shape_) n *= g;
  return n;
}

Box Distribution::local_box(const Shape& global, const std::vector<int>& coords) const {
  TESSERA_CHECK(global.rank() == tensor_rank(), "Distribution of rank {} applied to shape {}", tensor_rank(),
                global.to_string());
  TESSERA_CHECK(coords.size() == grid_shape_.size(), "Distribution: {} grid coordinates for a {}-axis grid",
                coords.size(), grid_shape_.size());
  Box box;
  for (int d = 0; d < tensor_rank(); ++d) {
    const auto& s = splits_[static_cast<std::size_t>(d)];
    if (s.grid_axis < 0) {
      box.begin.push_back(0);
      box.extent.push_back(global[d]);
    } else {
      const int p = grid_shape_[static_cast<std::size_t>(s.grid_axis)];
      const int c = coords[static_cast<std::size_t>(s.grid_axis)];
      box.begin.push_back(block_begin(global[d], p, c));
      box.extent.push_back(block_extent(global[d], p, c));
    }
  }
  return box;
}

Shape Distribution::local_shape_with_halo(const Shape& global, const std::vector<int>& coords) const {
  const Box box = local_box(global, coords);
  std::vector<std::int64_t> dims = box.extent;
  for (int d = 0; d < tensor_rank(); ++d) {
    const auto& s = splits_[static_cast<std::size_t>(d)];
    if (s.grid_axis >= 0) dims[static_cast<std::size_t>(d)] += 2 * s.halo;
  }
  return Shape(dims, global.kinds());
}

std::vector<int> Distribution::replicated_axes() const {
  std::vector<bool> used(grid_shape_.size(), false);
  for (const auto& s : splits_)
    if (s.grid_axis >= 0) used[static_cast<std::size_t>(s.grid_axis)] = true;
  std::vector<int> axes;
  for (std::size_t a = 0; a < used.size(); ++a)
    if (!used[a]) axes.push_back(static_cast<int>(a));
  return axes;
}

void Distribution::validate(const Shape& global) const {
  if (global.rank() != tensor_rank())
    fail_input("distribution {} does not fit shape {}", to_string(), global.to_string());
  for (int d = 0; d < tensor_rank(); ++d) {
    const int p = parts(d);
    if (global[d] < p)
      fail_input("dimension {} ({}) of shape {} has {} elements but is split into {} parts", d,
                 dim_kind_name(global.kind(d)), global.to_string(), global[d], p);
    const int halo = splits_[static_cast<std::size_t>(d)].halo;
    if (p > 1 && halo > global[d] / p)
      fail_input("halo {} of dimension {} is wider than its smallest block ({})", halo, d, global[d] / p);
  }
}

std::string Distribution::to_string() const {
  std::string s = "{grid [";
  for (std::size_t i = 0; i < grid_shape_.size(); ++i) s += fmt::format("{}{}", i ? "," : "", grid_shape_[i]);
  s += "], dims [";
  for (std::size_t i = 0; i < splits_.size(); ++i) {
    const auto& d = splits_[i];
    s += i ? ", " : "";
    s += d.grid_axis < 0 ? std::string("*") : fmt::format("axis{}", d.grid_axis);
    if (d.halo) s += fmt::format("+h{}", d.halo);
  }
  return s + "]}";
}

}  // namespace tessera
