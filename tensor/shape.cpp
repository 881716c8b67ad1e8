#include "tessera/tensor/shape.hpp"

#include <fmt/format.h>

#include "tessera/core/error.hpp"

namespace tessera {

const char* dim_kind_name(DimKind kind) {
  switch (kind) {
    case DimKind::Sample: return "sample";
    case DimKind::Channel: return "channel";
    case DimKind::Spatial: return "spatial";
    case DimKind::Feature: return "feature";
    case DimKind::Any: return "any";
  }
  return "?";
}

Shape::Shape(std::vector<std::int64_t> dims, std::vector<DimKind> kinds)
    : dims_(std::move(dims)), kinds_(std::move(kinds)) {
  TESSERA_CHECK(dims_.size() == kinds_.size(), "Shape: {} extents but {} dimension kinds", dims_.size(), kinds_.size());
  for (auto d : dims_) TESSERA_CHECK(d >= 0, "Shape: negative extent {}", d);
}

Shape::Shape(std::initializer_list<std::int64_t> dims) : Shape(std::vector<std::int64_t>(dims)) {}

Shape::Shape(std::vector<std::int64_t> dims)
    : Shape(dims, std::vector<DimKind>(dims.size(), DimKind::Any)) {}

Shape Shape::image(std::int64_t n, std::int64_t c, const std::vector<std::int64_t>& spatial) {
  std::vector<std::int64_t> dims{n, c};
  std::vector<DimKind> kinds{DimKind::Sample, DimKind::Channel};
  for (auto s : spatial) {
    dims.push_back(s);
    kinds.push_back(DimKind::Spatial);
  }
  return Shape(std::move(dims), std::move(kinds));
}

Shape Shape::flat(std::int64_t n, std::int64_t features) {
  return Shape({n, features}, {DimKind::Sample, DimKind::Feature});
}

std::int64_t Shape::numel() const {
  std::int64_t n = 1;
  for (auto d : dims_) n *= d;
  return n;
}

int Shape::spatial_dims() const {
  int n = 0;
  for (auto k : kinds_) n += k == DimKind::Spatial ? 1 : 0;
  return n;
}

Shape Shape::with(int i, std::int64_t extent) const {
  Shape s = *this;
  s[i] = extent;
  return s;
}

std::int64_t Shape::sample_numel() const {
  std::int64_t n = 1;
  for (std::size_t i = 1; i < dims_.size(); ++i) n *= dims_[i];
  return n;
}

std::string Shape::to_string() const {
  std::string s = "[";
  for (std::size_t i = 0; i < dims_.size(); ++i) s += fmt::format("{}{}", i ? ", " : "", dims_[i]);
  return s + "]";
}

}  // namespace tessera
