#include "tessera/train/halo_overlap.hpp"

#include "tessera/core/error.hpp"
#include "tessera/layers/layer.hpp"

namespace tessera {

HaloSplit split_at_halos(const Layer& layer, const std::vector<std::int64_t>& ready_begin,
                         const std::vector<std::int64_t>& ready_end, const std::vector<std::int64_t>& output_begin,
                         const std::vector<std::int64_t>& output_extent) {
  const std::size_t dims = output_begin.size();
  TESSERA_CHECK(ready_begin.size() == dims && ready_end.size() == dims && output_extent.size() == dims,
                "split_at_halos: {} spatial dimensions expected", dims);
  HaloSplit split;
  // Per dimension the interior [first, last): input_range is monotone, so it is one run.
  std::vector<std::int64_t> first(dims), last(dims);
  double tile = 1, interior = 1;
  for (std::size_t d = 0; d < dims; ++d) {
    first[d] = last[d] = 0;
    bool found = false;
    for (std::int64_t o = 0; o < output_extent[d]; ++o) {
      const auto [lo, hi] = layer.input_range(static_cast<int>(d), output_begin[d] + o, output_begin[d] + o + 1);
      if (lo < ready_begin[d] || hi > ready_end[d]) continue;
      if (!found) first[d] = o;
      found = true;
      last[d] = o + 1;
    }
    if (!found) return split;  // every output reads a halo along d
    tile *= static_cast<double>(output_extent[d]);
    interior *= static_cast<double>(last[d] - first[d]);
  }
  split.interior = true;
  for (std::size_t d = 0; d < dims; ++d) {
    for (int side = 0; side < 2; ++side) {
      OutputRegion r;
      for (std::size_t e = 0; e < dims; ++e) {
        if (e < d) {
          r.begin.push_back(first[e]);
          r.extent.push_back(last[e] - first[e]);
        } else if (e == d) {
          r.begin.push_back(side == 0 ? 0 : last[e]);
          r.extent.push_back(side == 0 ? first[e] : output_extent[e] - last[e]);
        } else {
          r.begin.push_back(0);
          r.extent.push_back(output_extent[e]);
        }
      }
      if (r.extent[d] > 0) split.boundary.push_back(std::move(r));
    }
  }
  split.boundary_share = tile > 0 ? (tile - interior) / tile : 0;
  return split;
}

}  // namespace tessera
