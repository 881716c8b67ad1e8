// Direct kernels for convolutions of one input channel (see host_direct_convolution.hpp). The
// input is first copied with its padding written out, so that every tap of every output is a load
// at a fixed offset. Forward holds 16 filters x 16 outputs of a row in registers and adds each tap
// as one load and 16 multiply-adds; backward-weights holds 8 filters x the 3 taps of one kernel
// row and adds each 16 outputs' gradients as 11 loads and 24 multiply-adds; it reads the output
// gradient, or makes it a row at a time from the max pooling that reads the output (PooledRows).
// Both are built for AVX-512, AVX2 and the baseline: forward's variant chosen when the library
// loads, backward-weights' (whose AVX-512 variant keeps vectors in registers, which only it can)
// at its first call.
#include "layers/host_direct_convolution.hpp"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "layers/host_stream.hpp"
#include "layers/pool_box.hpp"
#include "tessera/core/error.hpp"

namespace tessera::host {
namespace {

constexpr std::int64_t kLanes = 16;   ///< outputs of a row per vector
constexpr std::int64_t kWidth = 3;    ///< the kernel width the kernels are written for
constexpr std::int64_t kMaxExtent = 7;  ///< the largest kernel depth and height
constexpr int kFilterBlock = 8;       ///< filters per backward-weights block

using Vec = float __attribute__((vector_size(64)));
using Mask = int __attribute__((vector_size(64)));
// Vectors pass only by reference and move through memcpy (unaligned loads and stores): 64-byte
// vectors by value change the calling convention between the variants.
[[gnu::always_inline]] inline void load(Vec& v, const float* p) { std::memcpy(&v, p, sizeof v); }
[[gnu::always_inline]] inline void store(float* p, const Vec& v) { std::memcpy(p, &v, sizeof v); }

/// v = the first `count` lanes at p, the others 0.
[[gnu::always_inline]] inline void load_partial(Vec& v, const float* p, std::int64_t count) {
  v = Vec{};
  std::memcpy(&v, p, static_cast<std::size_t>(count) * sizeof(float));
}

[[gnu::always_inline]] inline double lane_sum(const Vec& v) {
  double sum = 0;
  for (int i = 0; i < kLanes; ++i) sum += static_cast<double>(v[i]);
  return sum;
}

/// Keeps v in a register where Pin (a 64-byte vector fits one only with AVX-512): otherwise the
/// compiler folds its load into every multiply-add that reads it, and the loads bound the loop.
template <bool Pin>
[[gnu::always_inline]] inline void pin(Vec& v) {
  if constexpr (Pin) asm("" : "+v"(v));
}

std::int64_t round_up(std::int64_t value, std::int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

/// A geometry as 3-D (a 2-D one has depth 1), with the padded input's sizes.
struct Box {
  std::int64_t batch, filters;
  std::int64_t depth, height, width;               ///< input
  std::int64_t pad_depth, pad_height, pad_width;
  std::int64_t kernel_depth, kernel_height;
  std::int64_t out_depth, out_height, out_width;
  std::int64_t padded_depth, padded_height, padded_width;  ///< padded_width: a multiple of kLanes

  explicit Box(const ConvolutionGeometry& g) {
    const bool three_d = g.input_size.size() == 3;
    const std::size_t h = three_d ? 1 : 0;
    batch = g.batch;
    filters = g.out_channels;
    depth = three_d ? g.input_size[0] : 1;
    pad_depth = three_d ? g.padding[0] : 0;
    kernel_depth = three_d ? g.kernel[0] : 1;
    out_depth = three_d ? g.output_size[0] : 1;
    height = g.input_size[h], pad_height = g.padding[h], kernel_height = g.kernel[h], out_height = g.output_size[h];
    width = g.input_size[h + 1], pad_width = g.padding[h + 1], out_width = g.output_size[h + 1];
    padded_depth = depth + 2 * pad_depth;
    padded_height = height + 2 * pad_height;
    // Whole vectors from any output column, each reaching kWidth - 1 further.
    padded_width = round_up(out_width, kLanes) + kLanes;
  }
  std::int64_t taps() const { return kernel_depth * kernel_height * kWidth; }
  std::int64_t padded_row(std::int64_t n, std::int64_t d, std::int64_t h) const {
    return ((n * padded_depth + d) * padded_height + h) * padded_width;
  }
  std::int64_t output_plane() const { return out_height * out_width; }
};

/// One output row of filter group `group` (16 filters; `row_of`, the padded input's rows its
/// kernel rows read): into `row`, filter f's at f * row_stride, the leaky ReLU applied.
[[gnu::always_inline]] inline void row_of_group(const Box& b, const float* const* row_of, const float* packed,
                                                const float* bias, std::int64_t group, bool leaky, float slope,
                                                float* row, std::int64_t row_stride) {
  const std::int64_t kernel_rows = b.kernel_depth * b.kernel_height, taps = b.taps();
  const float* w = packed + group * taps * kLanes;
  for (std::int64_t column = 0; column < b.out_width; column += kLanes) {
    Vec acc[kLanes];
#pragma GCC unroll 16
    for (int f = 0; f < kLanes; ++f) acc[f] = Vec{} + bias[group * kLanes + f];
    for (std::int64_t r = 0; r < kernel_rows; ++r) {
      for (std::int64_t k = 0; k < kWidth; ++k) {
        Vec x;
        load(x, row_of[r] + column + k);
        const float* tap = w + (r * kWidth + k) * kLanes;
#pragma GCC unroll 16
        for (int f = 0; f < kLanes; ++f) acc[f] += x * tap[f];
      }
    }
#pragma GCC unroll 16
    for (int f = 0; f < kLanes; ++f) {
      Vec y = acc[f];
      if (leaky) {  // y > 0 ? y : slope * y, as a select on the bits
        const Mask positive = y > 0;
        y = reinterpret_cast<Vec>((reinterpret_cast<Mask>(y) & positive) |
                                  (reinterpret_cast<Mask>(y * slope) & ~positive));
      }
      store(row + f * row_stride + column, y);
    }
  }
}

/// Forward of output rows [begin, end) (row = (n, od, oh)) for every filter.
/// packed: [groups][taps][kLanes] weights, filters past the last 0; bias: [groups][kLanes];
/// row: kLanes x round_up(out_width, kLanes) floats of the caller's, where a row's outputs are
/// gathered filter by filter before they are written out (writing 16 planes a vector at a time
/// measured slower: their rows lie a power of 2 apart and share cache sets), in streaming stores
/// with `stream` (streams_output).
__attribute__((target_clones("avx512f", "avx2", "default")))
void forward_rows(const Box& b, const float* padded, const float* packed, const float* bias, bool leaky, float slope,
                  float* row, float* output, std::int64_t begin, std::int64_t end, bool stream) {
  const std::int64_t rows_per_sample = b.out_depth * b.out_height, kernel_rows = b.kernel_depth * b.kernel_height;
  const std::int64_t groups = (b.filters + kLanes - 1) / kLanes;
  const std::int64_t row_stride = round_up(b.out_width, kLanes), filter_stride = b.out_depth * b.output_plane();
  const float* row_of[kMaxExtent * kMaxExtent];
  for (std::int64_t index = begin; index < end; ++index) {
    const std::int64_t n = index / rows_per_sample, od = index % rows_per_sample / b.out_height,
                       oh = index % b.out_height;
    for (std::int64_t r = 0; r < kernel_rows; ++r)
      row_of[r] = padded + b.padded_row(n, od + r / b.kernel_height, oh + r % b.kernel_height);
    for (std::int64_t group = 0; group < groups; ++group) {
      row_of_group(b, row_of, packed, bias, group, leaky, slope, row, row_stride);
      const std::int64_t filters = std::min(kLanes, b.filters - group * kLanes);
      float* out = output + ((n * b.filters + group * kLanes) * b.out_depth + od) * b.output_plane() + oh * b.out_width;
      for (std::int64_t f = 0; f < filters; ++f)
        stream_copy(out + f * filter_stride, row + f * row_stride, b.out_width, stream);
    }
  }
  if (stream) stream_fence();
}

constexpr Mask kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/// The floats of a row buffer of forward_pooled_rows: whole pairs of vectors past the row's end.
std::int64_t pooled_row_stride(const Box& b) {
  return round_up(b.out_width, 2 * kLanes);
}

/// Forward of the max pooling's output rows [begin, end) (row = (n, pooled depth, pooled row)) for
/// every filter: the convolution rows its windows cover (1 or 2 deep, 2 high) into `rows` (4 x 16
/// filters x pooled_row_stride floats of the caller's), then each window's maximum and its place in
/// the convolution's output plane, 16 windows at a time: the values and places of max pooling's
/// forward over the convolution's output (max_pool_row_2x2's scan order, the first of equals).
__attribute__((target_clones("avx512f", "avx2", "default"))) void forward_pooled_rows(
    const Box& b, const float* padded, const float* packed, const float* bias, bool leaky, float slope, float* rows,
    const PoolBox& pool, float* output, std::int32_t* argmax, std::int64_t begin, std::int64_t end) {
  const std::int64_t kernel_rows = b.kernel_depth * b.kernel_height, groups = (b.filters + kLanes - 1) / kLanes;
  const std::int64_t stride = pooled_row_stride(b), per_sample = pool.out[0] * pool.out[1], count = pool.out[2];
  const std::int64_t depth = pool.kernel[0], plane_row = pool.in[2], plane_rows = pool.in[1] * pool.in[2];
  const float* row_of[kMaxExtent * kMaxExtent];
  for (std::int64_t index = begin; index < end; ++index) {
    const std::int64_t n = index / per_sample, pd = index % per_sample / pool.out[1], ph = index % pool.out[1];
    for (std::int64_t group = 0; group < groups; ++group) {
      for (std::int64_t r = 0; r < 2 * depth; ++r) {  // r = i * 2 + j: depth i, height j
        const std::int64_t od = pd * depth + r / 2, oh = 2 * ph + r % 2;
        for (std::int64_t k = 0; k < kernel_rows; ++k)
          row_of[k] = padded + b.padded_row(n, od + k / b.kernel_height, oh + k % b.kernel_height);
        row_of_group(b, row_of, packed, bias, group, leaky, slope, rows + r * kLanes * stride, stride);
      }
      const std::int64_t filters = std::min(kLanes, b.filters - group * kLanes);
      for (std::int64_t f = 0; f < filters; ++f) {
        const std::int64_t p = n * b.filters + group * kLanes + f;
        float* y = output + pool.out_at(p, pd, ph);
        std::int32_t* where = argmax + p * pool.out_plane() + (pd * pool.out[1] + ph) * count;
        for (std::int64_t ow = 0; ow < count; ow += kLanes) {
          Vec best = Vec{} - __builtin_inff();
          Mask at = Mask{};
          for (std::int64_t r = 0; r < 2 * depth; ++r) {
            const float* x = rows + (r * kLanes + f) * stride + 2 * ow;
            Vec low, high;
            load(low, x);
            load(high, x + kLanes);
            const Mask place =
                static_cast<std::int32_t>((pd * depth + r / 2) * plane_rows + (2 * ph + r % 2) * plane_row + 2 * ow) +
                2 * kIota;
            const Vec even =
                __builtin_shufflevector(low, high, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
            const Vec odd =
                __builtin_shufflevector(low, high, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
            for (int e = 0; e < 2; ++e) {
              const Vec value = e == 0 ? even : odd;
              const Mask larger = value > best;
              best = reinterpret_cast<Vec>((reinterpret_cast<Mask>(value) & larger) |
                                           (reinterpret_cast<Mask>(best) & ~larger));
              at = ((place + e) & larger) | (at & ~larger);
            }
          }
          const std::int64_t lanes = std::min(kLanes, count - ow);
          std::memcpy(y + ow, &best, static_cast<std::size_t>(lanes) * sizeof(float));
          std::memcpy(where + ow, &at, static_cast<std::size_t>(lanes) * sizeof(std::int32_t));
        }
      }
    }
  }
}

/// The output gradient of backward-weights, a row (n, filter, od, oh) at a time: the dense tensor's.
struct DenseRows {
  const Box* b;
  const float* grad_output;
  /// Row oh of plane (n, f, od) (`scratch` unused); fetches the next plane's into the cache.
  [[gnu::always_inline]] const float* row(std::int64_t n, std::int64_t f, std::int64_t od, std::int64_t oh,
                                          float*) const {
    const float* row = grad_output + ((n * b->filters + f) * b->out_depth + od) * b->output_plane() + oh * b->out_width;
    if (od + 1 < b->out_depth)
      for (std::int64_t w = 0; w < b->out_width; w += kLanes) __builtin_prefetch(row + b->output_plane() + w, 0, 2);
    return row;
  }
};

/// ...or what max pooling's backward (through its leaky ReLU) would write there, made from the
/// pooling's gradient and maxima in `scratch` (out_width floats): each pair of a row gets its
/// window's gradient where the window's maximum is, the same values as max_backward_tiled's.
struct PooledRows {
  PoolBox pool;
  std::int64_t filters, rows, depth_kernel;
  const float* grad_output;
  const std::int32_t* argmax;
  const float* output;  ///< null: no leaky ReLU
  float slope;
  [[gnu::always_inline]] const float* row(std::int64_t n, std::int64_t f, std::int64_t od, std::int64_t oh,
                                          float* scratch) const {
    const std::int64_t p = n * filters + f, pd = od / depth_kernel, ph = oh / 2, count = pool.out[2];
    const float* g = grad_output + pool.out_at(p, pd, ph);
    const float* y = output ? output + pool.out_at(p, pd, ph) : nullptr;
    const std::int32_t* where = argmax + p * pool.out_plane() + (pd * pool.out[1] + ph) * count;
    const auto base = static_cast<std::int32_t>(od * rows + oh * pool.in[2]);
    // 16 windows at a time (the last ones in part of a vector), without branches (the maxima's
    // places are coin tosses): each window's gradient through the ReLU's factor, at its
    // maximum's place of the pair.
    for (std::int64_t ow = 0; ow < count; ow += kLanes) {
      const std::int64_t lanes = std::min(kLanes, count - ow);
      const bool whole = lanes == kLanes;  // (fixed-size copies inline; partial ones are calls)
      Vec value;
      if (whole)
        load(value, g + ow);
      else
        load_partial(value, g + ow, lanes);
      if (y) {
        Vec out;
        if (whole)
          load(out, y + ow);
        else
          load_partial(out, y + ow, lanes);
        const Mask positive = out > 0;
        value = reinterpret_cast<Vec>((reinterpret_cast<Mask>(value) & positive) |
                                      (reinterpret_cast<Mask>(value * slope) & ~positive));
      }
      Mask at = Mask{};
      if (whole)
        std::memcpy(&at, where + ow, sizeof at);
      else
        std::memcpy(&at, where + ow, static_cast<std::size_t>(lanes) * sizeof(std::int32_t));
      at -= base + 2 * static_cast<std::int32_t>(ow) + 2 * kIota;
      const Vec first = reinterpret_cast<Vec>(reinterpret_cast<Mask>(value) & (at == 0));
      const Vec second = reinterpret_cast<Vec>(reinterpret_cast<Mask>(value) & (at == 1));
      // Their lanes as first0 second0 first1 second1 ... (GCC and Clang alike).
      const Vec low = __builtin_shufflevector(first, second, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      const Vec high =
          __builtin_shufflevector(first, second, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
      if (whole) {
        store(scratch + 2 * ow, low);
        store(scratch + 2 * ow + kLanes, high);
      } else {
        float pairs[2 * kLanes];
        store(pairs, low);
        store(pairs + kLanes, high);
        std::memcpy(scratch + 2 * ow, pairs, static_cast<std::size_t>(2 * lanes) * sizeof(float));
      }
    }
    return scratch;
  }
};

/// Backward-weights of filters [first, first + Block) over one plane (n, od): adds each weight's
/// sum to sums[f * taps + t] and each bias's to bias_sums[f]. The filters' output gradients
/// (`rows`, DenseRows or PooledRows) are first copied into `pack`, [out_height][vectors of a
/// row][Block][kLanes] with zeros past the row's end: their planes lie a power of 2 apart and share
/// cache sets, and each is read once per kernel row; `scratch` holds a row where rows makes one.
template <int Block, bool Pin, typename Rows>
[[gnu::always_inline]] inline void weights_block(const Box& b, const float* padded, const Rows& rows, float* pack,
                                                 float* scratch, std::int64_t n, std::int64_t od, std::int64_t first,
                                                 double* sums, double* bias_sums) {
  const std::int64_t taps = b.taps(), kernel_rows = b.kernel_depth * b.kernel_height;
  const std::int64_t vectors = (b.out_width + kLanes - 1) / kLanes;
  for (int f = 0; f < Block; ++f)
    for (std::int64_t oh = 0; oh < b.out_height; ++oh) {
      const float* dy = rows.row(n, first + f, od, oh, scratch);
      for (std::int64_t v = 0; v < vectors; ++v) {
        const std::int64_t count = std::min(kLanes, b.out_width - v * kLanes);
        float* to = pack + ((oh * vectors + v) * Block + f) * kLanes;
        Vec g;
        if (count == kLanes)
          load(g, dy + v * kLanes);
        else
          load_partial(g, dy + v * kLanes, count);
        store(to, g);
      }
    }
  for (std::int64_t r = 0; r < kernel_rows; ++r) {
    Vec acc[Block][kWidth] = {};
    for (std::int64_t oh = 0; oh < b.out_height; ++oh) {
      const float* x = padded + b.padded_row(n, od + r / b.kernel_height, oh + r % b.kernel_height);
      const float* g = pack + oh * vectors * Block * kLanes;
      for (std::int64_t v = 0; v < vectors; ++v, g += Block * kLanes) {
        Vec x0, x1, x2;
        load(x0, x + v * kLanes);
        load(x1, x + v * kLanes + 1);
        load(x2, x + v * kLanes + 2);
#pragma GCC unroll 8
        for (int f = 0; f < Block; ++f) {
          Vec dy;
          load(dy, g + f * kLanes);
          pin<Pin>(dy);
          acc[f][0] += dy * x0;
          acc[f][1] += dy * x1;
          acc[f][2] += dy * x2;
        }
      }
    }
    for (int f = 0; f < Block; ++f)
      for (std::int64_t k = 0; k < kWidth; ++k) sums[(first + f) * taps + r * kWidth + k] += lane_sum(acc[f][k]);
  }
  Vec bias[Block] = {};
  const float* g = pack;
  for (std::int64_t i = 0; i < b.out_height * vectors; ++i, g += Block * kLanes)
    for (int f = 0; f < Block; ++f) {
      Vec dy;
      load(dy, g + f * kLanes);
      bias[f] += dy;
    }
  for (int f = 0; f < Block; ++f) bias_sums[first + f] += lane_sum(bias[f]);
}

/// Backward-weights over one plane (n, od) for every filter; pack and scratch: see weights_block.
template <bool Pin, typename Rows>
[[gnu::always_inline]] inline void weights_plane_of(const Box& b, const float* padded, const Rows& rows, float* pack,
                                                    float* scratch, std::int64_t plane, double* sums,
                                                    double* bias_sums) {
  const std::int64_t n = plane / b.out_depth, od = plane % b.out_depth;
  std::int64_t first = 0;
  for (; first + kFilterBlock <= b.filters; first += kFilterBlock)
    weights_block<kFilterBlock, Pin>(b, padded, rows, pack, scratch, n, od, first, sums, bias_sums);
  for (; first < b.filters; ++first)
    weights_block<1, Pin>(b, padded, rows, pack, scratch, n, od, first, sums, bias_sums);
}

/// Backward-weights over one plane, its AVX-512 variant and its AVX2 or baseline one.
template <typename Rows>
__attribute__((target("avx512f"))) void weights_plane_avx512(const Box& b, const float* padded, const Rows& rows,
                                                             float* pack, float* scratch, std::int64_t plane,
                                                             double* sums, double* bias_sums) {
  weights_plane_of<true>(b, padded, rows, pack, scratch, plane, sums, bias_sums);
}

template <typename Rows>
__attribute__((target("avx2"))) void weights_plane_avx2(const Box& b, const float* padded, const Rows& rows,
                                                        float* pack, float* scratch, std::int64_t plane, double* sums,
                                                        double* bias_sums) {
  weights_plane_of<false>(b, padded, rows, pack, scratch, plane, sums, bias_sums);
}

template <typename Rows>
void weights_plane_baseline(const Box& b, const float* padded, const Rows& rows, float* pack, float* scratch,
                            std::int64_t plane, double* sums, double* bias_sums) {
  weights_plane_of<false>(b, padded, rows, pack, scratch, plane, sums, bias_sums);
}

template <typename Rows>
using WeightsPlane = void (*)(const Box&, const float*, const Rows&, float*, float*, std::int64_t, double*, double*);

/// The variant for this CPU: AVX-512 where it has it, else AVX2, else the baseline.
template <typename Rows>
WeightsPlane<Rows> weights_plane_for_this_cpu() {
  if (__builtin_cpu_supports("avx512f")) return weights_plane_avx512<Rows>;
  if (__builtin_cpu_supports("avx2")) return weights_plane_avx2<Rows>;
  return weights_plane_baseline<Rows>;
}

}  // namespace

bool direct_convolution_applies(const ConvolutionGeometry& g) {
  const std::size_t dims = g.input_size.size();
  if (g.in_channels != 1 || (dims != 2 && dims != 3) || g.kernel.back() != kWidth) return false;
  for (std::size_t i = 0; i < dims; ++i) {
    if (g.stride[i] != 1 || g.dilation[i] != 1 || g.kernel[i] > kMaxExtent || g.padding[i] >= g.kernel[i]) return false;
    if (g.output_size[i] != g.input_size[i] + 2 * g.padding[i] - g.kernel[i] + 1) return false;
  }
  return true;
}

void DirectConvolution::AlignedFree::operator()(float* p) const { std::free(p); }

const float* DirectConvolution::padded_input(const ConvolutionGeometry& geometry, const float* input) {
  const Box b(geometry);
  const std::int64_t rows = b.batch * b.padded_depth * b.padded_height, size = rows * b.padded_width;
  if (size > padded_capacity_) {
    void* memory = std::aligned_alloc(64, static_cast<std::size_t>(size) * sizeof(float));
    if (!memory) throw std::bad_alloc();
    padded_.reset(static_cast<float*>(memory));
    padded_capacity_ = size;
  }
  float* padded = padded_.get();
#pragma omp parallel for schedule(static)
  for (std::int64_t row = 0; row < rows; ++row) {
    float* to = padded + row * b.padded_width;
    const std::int64_t h = row % b.padded_height - b.pad_height;
    const std::int64_t d = row / b.padded_height % b.padded_depth - b.pad_depth;
    const std::int64_t n = row / (b.padded_height * b.padded_depth);
    std::fill(to, to + b.padded_width, 0.0f);
    if (d >= 0 && d < b.depth && h >= 0 && h < b.height)
      std::copy_n(input + ((n * b.depth + d) * b.height + h) * b.width, b.width, to + b.pad_width);
  }
  return padded;
}

/// Forward's weights as [groups of 16 filters][taps][16], filters past the last 0, and its bias as
/// [groups][16].
static void pack_weights(const ConvolutionGeometry& geometry, const float* weights, const float* bias,
                         std::vector<float>& packed, std::vector<float>& packed_bias) {
  const Box b(geometry);
  const std::int64_t groups = (b.filters + kLanes - 1) / kLanes, taps = b.taps();
  packed.assign(static_cast<std::size_t>(groups * taps * kLanes), 0.0f);
  packed_bias.assign(static_cast<std::size_t>(groups * kLanes), 0.0f);
  for (std::int64_t f = 0; f < b.filters; ++f) {
    for (std::int64_t t = 0; t < taps; ++t)
      packed[static_cast<std::size_t>((f / kLanes * taps + t) * kLanes + f % kLanes)] = weights[f * taps + t];
    if (geometry.bias) packed_bias[static_cast<std::size_t>(f)] = bias[f];
  }
}

void DirectConvolution::forward(const ConvolutionGeometry& geometry, const float* input, const float* weights,
                                const float* bias, float* output) {
  TESSERA_CHECK(direct_convolution_applies(geometry), "direct convolution kernels asked for {}", geometry.to_string());
  const Box b(geometry);
  const float* padded = padded_input(geometry, input);
  std::vector<float> packed, packed_bias;
  pack_weights(geometry, weights, bias, packed, packed_bias);
  const std::int64_t rows = b.batch * b.out_depth * b.out_height;
  const bool leaky = geometry.leaky_relu;
  const float slope = geometry.leaky_slope;
  const int threads = omp_get_max_threads();
  const bool stream = streams_output(geometry.output_elements() * static_cast<std::int64_t>(sizeof(float)));
  const std::int64_t row_floats = kLanes * round_up(b.out_width, kLanes);
  rows_.resize(std::max(rows_.size(), static_cast<std::size_t>(threads * row_floats)));
  float* row_buffers = rows_.data();
#pragma omp parallel num_threads(threads)
  {
    const std::int64_t count = omp_get_num_threads(), thread = omp_get_thread_num();
    forward_rows(b, padded, packed.data(), packed_bias.data(), leaky, slope, row_buffers + thread * row_floats,
                 output, rows * thread / count, rows * (thread + 1) / count, stream);
  }
}

void DirectConvolution::backward_weights(const ConvolutionGeometry& geometry, const float* input,
                                         const float* grad_output, float* grad_weights, float* grad_bias) {
  TESSERA_CHECK(direct_convolution_applies(geometry), "direct convolution kernels asked for {}", geometry.to_string());
  const Box b(geometry);
  weights_from(geometry, input, DenseRows{&b, grad_output}, grad_weights, grad_bias);
}

void DirectConvolution::backward_weights_from_pooling(const ConvolutionGeometry& geometry, const float* input,
                                                      const PooledGradient& pooled, float* grad_weights,
                                                      float* grad_bias) {
  TESSERA_CHECK(
      direct_convolution_applies(geometry) && pooled.geometry && pooled_gradient_applies(geometry, *pooled.geometry),
      "direct convolution kernels asked for {} from the pooling {}", geometry.to_string(),
      pooled.geometry ? pooled.geometry->to_string() : std::string("(none)"));
  const PoolBox pool = pool_box(*pooled.geometry);
  const PooledRows rows{pool,           geometry.out_channels, pool.in[1] * pool.in[2],
                        pool.kernel[0], pooled.grad_output,    static_cast<const std::int32_t*>(pooled.workspace),
                        pooled.output,  pooled.slope};
  weights_from(geometry, input, rows, grad_weights, grad_bias);
}

void DirectConvolution::forward_pooled(const ConvolutionGeometry& geometry, const float* input, const float* weights,
                                       const float* bias, const PooledOutput& pooled) {
  TESSERA_CHECK(direct_convolution_applies(geometry) && pooled.geometry &&
                    pooled_gradient_applies(geometry.without_activation(), *pooled.geometry),
                "direct convolution kernels asked for {} pooled by {}", geometry.to_string(),
                pooled.geometry ? pooled.geometry->to_string() : std::string("(none)"));
  const Box b(geometry);
  const PoolBox pool = pool_box(*pooled.geometry);
  const float* padded = padded_input(geometry, input);
  std::vector<float> packed, packed_bias;
  pack_weights(geometry, weights, bias, packed, packed_bias);
  const std::int64_t rows = b.batch * pool.out[0] * pool.out[1];
  const int threads = omp_get_max_threads();
  // 4 rows of 16 filters, and a pair of vectors past the last for the loads of its last windows.
  const std::int64_t buffer_floats = (4 * kLanes + 1) * pooled_row_stride(b);
  rows_.resize(std::max(rows_.size(), static_cast<std::size_t>(threads * buffer_floats)));
  float* buffers = rows_.data();
#pragma omp parallel num_threads(threads)
  {
    const std::int64_t count = omp_get_num_threads(), thread = omp_get_thread_num();
    forward_pooled_rows(b, padded, packed.data(), packed_bias.data(), geometry.leaky_relu, geometry.leaky_slope,
                        buffers + thread * buffer_floats, pool, pooled.output, pooled.argmax, rows * thread / count,
                        rows * (thread + 1) / count);
  }
}

template <typename Rows>
void DirectConvolution::weights_from(const ConvolutionGeometry& geometry, const float* input, const Rows& rows,
                                     float* grad_weights, float* grad_bias) {
  const Box b(geometry);
  const float* padded = padded_input(geometry, input);
  const std::int64_t planes = b.batch * b.out_depth, sums_per_thread = b.filters * (b.taps() + 1);
  const int threads = omp_get_max_threads();
  // Each thread sums its planes in its own slot; the slots are added in thread order.
  std::vector<double> sums(static_cast<std::size_t>(threads * sums_per_thread), 0.0);
  const std::int64_t row_floats = round_up(b.out_width, kLanes);
  const std::int64_t pack_floats = b.out_height * row_floats * kFilterBlock + row_floats;  // + a scratch row
  packs_.resize(std::max(packs_.size(), static_cast<std::size_t>(threads * pack_floats)));
  float* packs = packs_.data();
  static const WeightsPlane<Rows> weights_plane = weights_plane_for_this_cpu<Rows>();
#pragma omp parallel num_threads(threads)
  {
    const std::int64_t count = omp_get_num_threads(), thread = omp_get_thread_num();
    double* mine = sums.data() + thread * sums_per_thread;
    float* pack = packs + thread * pack_floats;
    float* scratch = pack + (pack_floats - row_floats);
    for (std::int64_t plane = planes * thread / count; plane < planes * (thread + 1) / count; ++plane)
      weights_plane(b, padded, rows, pack, scratch, plane, mine, mine + b.filters * b.taps());
  }
  const std::int64_t weight_count = b.filters * b.taps();
  for (std::int64_t i = 0; i < sums_per_thread; ++i) {
    double total = 0;
    for (int t = 0; t < threads; ++t) total += sums[static_cast<std::size_t>(t * sums_per_thread + i)];
    if (i < weight_count)
      grad_weights[i] = static_cast<float>(total);
    else if (geometry.bias)
      grad_bias[i - weight_count] = static_cast<float>(total);
  }
}

bool pooled_gradient_applies(const ConvolutionGeometry& geometry, const PoolingGeometry& pooling) {
  if (pooling.mode != PoolingMode::Max || pooling.input_size != geometry.output_size ||
      pooling.batch != geometry.batch || pooling.channels != geometry.out_channels)
    return false;
  const PoolBox b = pool_box(pooling);
  if (b.kernel[1] != 2 || b.kernel[2] != 2 || (b.kernel[0] != 1 && b.kernel[0] != 2) || b.out[2] < kPooledRowWindows)
    return false;
  // Windows at their own stride from the local input's first element, tiling it exactly, inside
  // the global input: each output of the convolution lies in one window.
  for (int d = 0; d < 3; ++d) {
    const std::int64_t first = b.out_origin[d] * b.stride[d] - b.padding[d];
    if (b.stride[d] != b.kernel[d] || b.padding[d] != 0 || first != b.in_origin[d] ||
        b.out[d] * b.kernel[d] != b.in[d] || b.in_origin[d] + b.in[d] > b.limit[d])
      return false;
  }
  return true;
}

}  // namespace tessera::host
