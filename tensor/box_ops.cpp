#include "tessera/tensor/box_ops.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "box_walk.hpp"
#include "tessera/core/error.hpp"

namespace tessera {
namespace {

/// Walks `region` inside two dense row-major arrays that cover the boxes `src` and `dst`, calling
/// fn(src_offset, dst_offset, rows, src_row, dst_row, run) once per set of `rows` contiguous runs of
/// `run` elements, `src_row`/`dst_row` apart. Trailing dimensions that all three boxes span
/// completely merge into one run, so a whole-tile copy is a single run.
template <typename RowsFn>
void for_each_rows(const Box& region, const Box& src, const Box& dst, RowsFn fn) {
  const int rank = static_cast<int>(region.extent.size());
  TESSERA_CHECK(rank >= 1 && rank <= kMaxBoxRank, "box operations take 1 to {} dimensions, got {}", kMaxBoxRank, rank);
  if (region.numel() == 0) return;
  std::array<std::int64_t, kMaxBoxRank> src_stride{}, dst_stride{}, count{};
  std::int64_t s = 0, t = 0, src_step = 1, dst_step = 1;
  for (int d = rank - 1; d >= 0; --d) {
    const auto i = static_cast<std::size_t>(d);
    src_stride[i] = src_step;
    dst_stride[i] = dst_step;
    s += (region.begin[i] - src.begin[i]) * src_step;
    t += (region.begin[i] - dst.begin[i]) * dst_step;
    src_step *= src.extent[i];
    dst_step *= dst.extent[i];
  }
  // Dimensions [outer, rank) form one contiguous run.
  int outer = rank - 1;
  std::int64_t run = region.extent[static_cast<std::size_t>(outer)];
  while (outer > 0) {
    const auto i = static_cast<std::size_t>(outer);
    if (region.extent[i] != src.extent[i] || region.extent[i] != dst.extent[i]) break;
    --outer;
    run *= region.extent[static_cast<std::size_t>(outer)];
  }
  // The innermost outer dimension is the rows of a call; an odometer walks the dimensions before it.
  const int last = outer - 1;  // -1: the whole region is one run
  const auto l = static_cast<std::size_t>(std::max(last, 0));
  const std::int64_t rows = last >= 0 ? region.extent[l] : 1;
  const std::int64_t src_row = last >= 0 ? src_stride[l] : 0, dst_row = last >= 0 ? dst_stride[l] : 0;
  while (true) {
    fn(s, t, rows, src_row, dst_row, run);
    int d = last - 1;
    for (; d >= 0; --d) {
      const auto i = static_cast<std::size_t>(d);
      s += src_stride[i];
      t += dst_stride[i];
      if (++count[i] < region.extent[i]) break;
      s -= src_stride[i] * region.extent[i];
      t -= dst_stride[i] * region.extent[i];
      count[i] = 0;
    }
    if (d < 0) return;
  }
}

/// Runs of up to this many elements get a loop of fixed length (halo strips, the rows of small
/// tiles): a library call per run of a few elements costs more than the copy.
constexpr std::int64_t kFixedRunUpTo = 16;

enum class HostOp { Copy, Add, Fill };

/// `rows` runs of N elements (N > 0), or of `run` elements (N == 0).
template <HostOp Op, std::int64_t N>
void host_rows(const float* __restrict src, float* __restrict dst, std::int64_t rows, std::int64_t src_row,
               std::int64_t dst_row, std::int64_t run, float value) {
  const std::int64_t n = N > 0 ? N : run;
  for (std::int64_t j = 0; j < rows; ++j) {
    float* __restrict to = dst + j * dst_row;
    if constexpr (Op == HostOp::Fill) {
      for (std::int64_t k = 0; k < n; ++k) to[k] = value;
    } else {
      const float* __restrict from = src + j * src_row;
      if constexpr (Op == HostOp::Add) {
        for (std::int64_t k = 0; k < n; ++k) to[k] += from[k];
      } else if constexpr (N > 0) {
        for (std::int64_t k = 0; k < n; ++k) to[k] = from[k];
      } else {
        std::memcpy(to, from, static_cast<std::size_t>(n) * sizeof(float));
      }
    }
  }
}

using HostRowsFn = void (*)(const float*, float*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, float);

template <HostOp Op, std::size_t... N>
constexpr std::array<HostRowsFn, sizeof...(N)> host_rows_table(std::index_sequence<N...>) {
  return {&host_rows<Op, static_cast<std::int64_t>(N)>...};
}

/// Op over `region` on the host: the rows of each call by the loop of their run's length.
template <HostOp Op>
void host_box_op(const Box& region, const float* src, const Box& src_box, float* dst, const Box& dst_box,
                 float value = 0.0f) {
  static constexpr auto kTable = host_rows_table<Op>(std::make_index_sequence<kFixedRunUpTo + 1>());
  for_each_rows(region, src_box, dst_box,
                [&](std::int64_t s, std::int64_t t, std::int64_t rows, std::int64_t src_row, std::int64_t dst_row,
                    std::int64_t run) {
                  const HostRowsFn rows_fn = kTable[static_cast<std::size_t>(run <= kFixedRunUpTo ? run : 0)];
                  rows_fn(src ? src + s : nullptr, dst + t, rows, src_row, dst_row, run, value);
                });
}

}  // namespace

namespace detail {

static_assert(kBoxWalkRank == kMaxBoxRank);

/// The walk of `region`, trailing dimensions that all three boxes span completely merged into one
/// (a whole-tile copy is one dimension: fewer divisions per element in the kernel).
BoxWalk box_walk(const Box& region, const Box& src_box, const Box& dst_box) {
  const int rank = static_cast<int>(region.extent.size());
  TESSERA_CHECK(rank >= 1 && rank <= kMaxBoxRank, "box operations take 1 to {} dimensions, got {}", kMaxBoxRank, rank);
  BoxWalk walk;
  walk.count = region.numel();
  std::int64_t src_step = 1, dst_step = 1;
  // Dimensions from the innermost outwards, written innermost last after the loop.
  std::int64_t extent[kBoxWalkRank], src_stride[kBoxWalkRank], dst_stride[kBoxWalkRank];
  int kept = 0;
  bool merging = true;
  for (int d = rank - 1; d >= 0; --d) {
    const auto i = static_cast<std::size_t>(d);
    walk.src_offset += (region.begin[i] - src_box.begin[i]) * src_step;
    walk.dst_offset += (region.begin[i] - dst_box.begin[i]) * dst_step;
    if (kept > 0 && merging) {
      extent[kept - 1] *= region.extent[i];  // the dimension inside it is whole in all three boxes
    } else {
      extent[kept] = region.extent[i];
      src_stride[kept] = src_step;
      dst_stride[kept] = dst_step;
      ++kept;
    }
    merging = region.extent[i] == src_box.extent[i] && region.extent[i] == dst_box.extent[i];
    src_step *= src_box.extent[i];
    dst_step *= dst_box.extent[i];
  }
  walk.rank = kept;
  for (int k = 0; k < kept; ++k) {
    walk.extent[kept - 1 - k] = extent[k];
    walk.src_stride[kept - 1 - k] = src_stride[k];
    walk.dst_stride[kept - 1 - k] = dst_stride[k];
  }
  return walk;
}

}  // namespace detail

void copy_box(const Box& region, const float* src, const Box& src_box, float* dst, const Box& dst_box,
              const Device& device) {
  if (region.numel() == 0) return;
  if (!device.is_host()) {
    detail::cuda_box_op(detail::BoxOp::Copy, detail::box_walk(region, src_box, dst_box), src, dst, 0.0f, device.index);
    return;
  }
  host_box_op<HostOp::Copy>(region, src, src_box, dst, dst_box);
}

void add_box(const Box& region, const float* src, const Box& src_box, float* dst, const Box& dst_box,
             const Device& device) {
  if (region.numel() == 0) return;
  if (!device.is_host()) {
    detail::cuda_box_op(detail::BoxOp::Add, detail::box_walk(region, src_box, dst_box), src, dst, 0.0f, device.index);
    return;
  }
  host_box_op<HostOp::Add>(region, src, src_box, dst, dst_box);
}

void fill_box(const Box& region, float* dst, const Box& dst_box, float value, const Device& device) {
  if (region.numel() == 0) return;
  if (!device.is_host()) {
    detail::cuda_box_op(detail::BoxOp::Fill, detail::box_walk(region, dst_box, dst_box), nullptr, dst, value,
                        device.index);
    return;
  }
  host_box_op<HostOp::Fill>(region, nullptr, dst_box, dst, dst_box, value);
}

}  // namespace tessera
