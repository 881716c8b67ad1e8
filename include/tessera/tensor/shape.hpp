#pragma once
// A shape is a list of extents, each tagged with what the dimension means. The planner and the
// executor reason over these kinds, never over layer names.
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace tessera {

enum class DimKind { Sample, Channel, Spatial, Feature, Any };

const char* dim_kind_name(DimKind kind);

class Shape {
 public:
  Shape() = default;
  Shape(std::vector<std::int64_t> dims, std::vector<DimKind> kinds);
  /// All dimensions of kind Any.
  Shape(std::initializer_list<std::int64_t> dims);
  explicit Shape(std::vector<std::int64_t> dims);

  /// N x C x (D) x H x W for 1 + spatial_dims spatial dimensions.
  static Shape image(std::int64_t n, std::int64_t c, const std::vector<std::int64_t>& spatial);
  /// N x F.
  static Shape flat(std::int64_t n, std::int64_t features);

  int rank() const { return static_cast<int>(dims_.size()); }
  std::int64_t operator[](int i) const { return dims_.at(static_cast<std::size_t>(i)); }
  std::int64_t& operator[](int i) { return dims_.at(static_cast<std::size_t>(i)); }
  DimKind kind(int i) const { return kinds_.at(static_cast<std::size_t>(i)); }
  const std::vector<std::int64_t>& dims() const { return dims_; }
  const std::vector<DimKind>& kinds() const { return kinds_; }
  std::int64_t numel() const;
  /// Number of Spatial dimensions.
  int spatial_dims() const;
  /// The same shape with dimension `i` set to `extent`.
  Shape with(int i, std::int64_t extent) const;
  /// Elements per sample (product of all dimensions but the first).
  std::int64_t sample_numel() const;

  bool operator==(const Shape& other) const { return dims_ == other.dims_; }
  std::string to_string() const;

 private:
  std::vector<std::int64_t> dims_;
  std::vector<DimKind> kinds_;
};

}  // namespace tessera
