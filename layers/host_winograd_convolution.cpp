// Winograd kernels for 3 x 3 x 3 convolutions (see host_winograd_convolution.hpp). The input is
// first copied with its padding written out (unless it is that already: a spatial tile's window
// of whole tiles). A block is 16 tiles of 2 x 2 x 2 outputs, one per
// vector lane. Per input channel the block's 4 x 4 x 4 input windows are read (two deinterleaved
// row loads where lanes 0-7 and 8-15 each lie along one row of tiles, else lane by lane) and
// transformed into 64 points. Forward: per point, the products with the transformed weights of 16
// output channels at a time are summed over the input channels in registers; per output channel
// the 64 sums are transformed back into the 8 outputs of each lane's tile. Backward-weights: per
// chunk of blocks, per point, the products of transformed inputs and output gradients summed over
// the chunk's tiles, then over lanes. Built for AVX-512, AVX2 and the baseline, the variant chosen
// when the library loads.
#include "layers/host_winograd_convolution.hpp"

#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#include "tessera/core/error.hpp"

namespace tessera::host {
namespace {

constexpr std::int64_t kLanes = 16;   ///< tiles per block, one per lane
constexpr std::int64_t kPoints = 64;  ///< transformed points of a tile (4 x 4 x 4)
constexpr std::int64_t kGroup = 16;   ///< output channels summed at once
constexpr std::int64_t kSegment = 8;  ///< consecutive tiles of a row in half a block
constexpr std::int64_t kSlack = 32;   ///< floats past the padded input that a short segment's loads may read
constexpr std::int64_t kChunk = 16;  ///< blocks whose weight-gradient products are summed at once

using Vec = float __attribute__((vector_size(64)));
using Mask = int __attribute__((vector_size(64)));
// Vectors pass only by reference and move through memcpy (unaligned loads and stores): 64-byte
// vectors by value change the calling convention between the variants.
[[gnu::always_inline]] inline void load(Vec& v, const float* p) { std::memcpy(&v, p, sizeof v); }
[[gnu::always_inline]] inline void store(float* p, const Vec& v) { std::memcpy(p, &v, sizeof v); }

// Lane selections of two vectors a, b (GCC and Clang both build __builtin_shufflevector).
/// The even elements of a then b, and the odd ones.
[[gnu::always_inline]] inline void evens(const Vec& a, const Vec& b, Vec& out) {
  out = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
}
[[gnu::always_inline]] inline void odds(const Vec& a, const Vec& b, Vec& out) {
  out = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
/// a's and b's first 8 lanes interleaved, and their last 8.
[[gnu::always_inline]] inline void interleave_low(const Vec& a, const Vec& b, Vec& out) {
  out = __builtin_shufflevector(a, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
}
[[gnu::always_inline]] inline void interleave_high(const Vec& a, const Vec& b, Vec& out) {
  out = __builtin_shufflevector(a, b, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
}

/// The 16 lane sums of 16 vectors, lane i holding v[i]'s: four rounds, each adding two vectors'
/// halves of every group (16 groups of 1 lane, 8 of 2, 4 of 4, 2 of 8 at the end).
[[gnu::always_inline]] inline void lane_sums(const Vec* v, Vec& sums) {
  Vec r[8], q[4], w[2];
  for (int i = 0; i < 8; ++i)
    r[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    q[i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(r[2 * i], r[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    w[i] = __builtin_shufflevector(q[2 * i], q[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(q[2 * i], q[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  Vec even, odd;
  evens(w[0], w[1], even);
  odds(w[0], w[1], odd);
  sums = even + odd;
}

std::int64_t round_up(std::int64_t value, std::int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

/// A stride of an odd number of vectors (cache lines): a power of 2 would put a tile's 64 points
/// into the same few cache sets.
std::int64_t odd(std::int64_t vectors) { return vectors | 1; }

/// B^T d over 4 values at stride s.
template <class T>
[[gnu::always_inline]] inline void input_transform_1d(T* a, int s) {
  const T d0 = a[0], d1 = a[s], d2 = a[2 * s], d3 = a[3 * s];
  a[0] = d0 - d2;
  a[s] = d1 + d2;
  a[2 * s] = d2 - d1;
  a[3 * s] = d1 - d3;
}

/// A^T m A along each axis: 64 sums ([z][y][x], at stride `stride`) to 8 outputs ([a][b][c]),
/// one z-slice of sums at a time (a whole tile's do not fit the registers).
[[gnu::always_inline]] inline void output_transform(const Vec* m, std::int64_t stride, Vec* y) {
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) y[i] = Vec{};
#pragma GCC unroll 4
  for (int z = 0; z < 4; ++z) {
    Vec t[8];  // [y][c]
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const Vec* row = m + (z * 16 + r * 4) * stride;
      t[r * 2] = row[0] + row[stride] + row[2 * stride];
      t[r * 2 + 1] = row[stride] - row[2 * stride] - row[3 * stride];
    }
    Vec u[4];  // [b][c]
    for (int c = 0; c < 2; ++c) {
      u[c] = t[c] + t[2 + c] + t[4 + c];
      u[2 + c] = t[2 + c] - t[4 + c] - t[6 + c];
    }
    // A^T's rows: output a = 0 sums z = 0, 1, 2; a = 1 takes z = 1, -z = 2, -z = 3.
    for (int bc = 0; bc < 4; ++bc) {
      if (z < 3) y[bc] += u[bc];
      if (z == 1) y[4 + bc] += u[bc];
      if (z >= 2) y[4 + bc] -= u[bc];
    }
  }
}

/// G g G^T along each axis: 16 3 x 3 x 3 kernels ([z][y][x], one per lane) to 64 points.
[[gnu::always_inline]] inline void weight_transform(const Vec* g, Vec* out) {
  Vec a[36], b[48];  // [z][y][4], [z][4][4]
  for (int zy = 0; zy < 9; ++zy) {
    const Vec* r = g + zy * 3;
    a[zy * 4] = r[0];
    a[zy * 4 + 1] = (r[0] + r[1] + r[2]) * 0.5f;
    a[zy * 4 + 2] = (r[0] - r[1] + r[2]) * 0.5f;
    a[zy * 4 + 3] = r[2];
  }
  for (int z = 0; z < 3; ++z)
    for (int x = 0; x < 4; ++x) {
      const Vec* c = a + z * 12 + x;
      b[z * 16 + x] = c[0];
      b[z * 16 + 4 + x] = (c[0] + c[4] + c[8]) * 0.5f;
      b[z * 16 + 8 + x] = (c[0] - c[4] + c[8]) * 0.5f;
      b[z * 16 + 12 + x] = c[8];
    }
  for (int yx = 0; yx < 16; ++yx) {
    out[yx] = b[yx];
    out[16 + yx] = (b[yx] + b[16 + yx] + b[32 + yx]) * 0.5f;
    out[32 + yx] = (b[yx] - b[16 + yx] + b[32 + yx]) * 0.5f;
    out[48 + yx] = b[32 + yx];
  }
}

/// U [64][in][out] from weights [filters][channels][27]: forward's convolution takes the channels
/// in and the filters out; backward-data's (flipped) the filters in, the kernels flipped.
__attribute__((target_clones("avx512f", "avx2", "default")))
void transform_weights(const float* weights, std::int64_t filters, std::int64_t channels, bool flipped, float* U) {
  const std::int64_t in = flipped ? filters : channels, out = flipped ? channels : filters;
  for (std::int64_t i = 0; i < in; ++i)
    for (std::int64_t o0 = 0; o0 < out; o0 += kLanes) {
      const std::int64_t lanes = std::min(kLanes, out - o0);
      Vec g[27], points[kPoints];
      for (int r = 0; r < 27; ++r) {
        g[r] = Vec{};
        for (std::int64_t l = 0; l < lanes; ++l) {
          const std::int64_t o = o0 + l;
          g[r][l] = flipped ? weights[(i * channels + o) * 27 + 26 - r] : weights[(o * channels + i) * 27 + r];
        }
      }
      weight_transform(g, points);
      for (int p = 0; p < kPoints; ++p)
        for (std::int64_t l = 0; l < lanes; ++l) U[(p * in + i) * out + o0 + l] = points[p][l];
    }
}

}  // namespace

/// One convolution as the kernels see it: backward-data is the forward convolution of the output
/// gradient with the flipped, transposed weights. A call computes the outputs of a region of its
/// output array: `out` extents from `origin` in an array of `dims` extents (by default all of it),
/// its input padded by `pad` before the first element and by zeros after the last.
struct WinogradShape {
  std::int64_t batch, in_channels, out_channels;
  std::int64_t in[3], out[3], pad[3], tiles[3], padded[3], dims[3], origin[3];

  WinogradShape(std::int64_t n, std::int64_t c, std::int64_t k, const std::vector<std::int64_t>& input_size,
                const std::int64_t* padding)
      : batch(n), in_channels(c), out_channels(k) {
    for (int i = 0; i < 3; ++i) {
      in[i] = input_size[static_cast<std::size_t>(i)];
      pad[i] = padding[i];
      out[i] = dims[i] = in[i] + 2 * pad[i] - 2;
      origin[i] = 0;
      tiles[i] = (out[i] + 1) / 2;
      padded[i] = 2 * tiles[i] + 2;  // every tile's window lies inside
    }
  }
  /// The outputs [begin, begin + extent) of this shape's output array only, per dimension.
  WinogradShape region(const std::int64_t* begin, const std::int64_t* extent) const {
    WinogradShape r = *this;
    for (int i = 0; i < 3; ++i) {
      r.pad[i] = pad[i] - begin[i];
      r.origin[i] = begin[i];
      r.out[i] = extent[i];
      r.tiles[i] = (extent[i] + 1) / 2;
      r.padded[i] = 2 * r.tiles[i] + 2;
    }
    return r;
  }
  std::int64_t in_volume() const { return in[0] * in[1] * in[2]; }
  std::int64_t out_volume() const { return out[0] * out[1] * out[2]; }
  std::int64_t dims_volume() const { return dims[0] * dims[1] * dims[2]; }
  std::int64_t origin_offset() const { return (origin[0] * dims[1] + origin[1]) * dims[2] + origin[2]; }
  std::int64_t padded_volume() const { return padded[0] * padded[1] * padded[2]; }
  std::int64_t tile_count() const { return batch * tiles[0] * tiles[1] * tiles[2]; }
  /// Rows of 8 or more tiles are cut into segments of 8 (the last may be shorter), two per block;
  /// shorter rows are taken 16 consecutive tiles a block, across rows.
  bool by_segments() const { return tiles[2] >= kSegment; }
  std::int64_t segments_per_row() const { return (tiles[2] + kSegment - 1) / kSegment; }
  /// Whether the input itself is its padded copy: no padding, every tile whole, and no short
  /// segment whose row loads would read past the input's end (a spatial tile's window usually).
  bool padded_in_place() const {
    for (int i = 0; i < 3; ++i)
      if (pad[i] != 0 || padded[i] != in[i]) return false;
    return !by_segments() || tiles[2] % kSegment == 0;
  }
  std::int64_t block_count() const {
    return by_segments() ? (batch * tiles[0] * tiles[1] * segments_per_row() + 1) / 2 : (tile_count() + kLanes - 1) / kLanes;
  }
  /// Floats of one block's buffers: transformed inputs [64][in channels] and sums
  /// [64][out channels], one vector each.
  std::int64_t block_floats() const { return kPoints * (odd(in_channels) + odd(round_up(out_channels, kGroup))) * kLanes; }
};

namespace {

using Shape = WinogradShape;

/// Sums G output channels of point p's products: m[j] = sum over c of v[c] * u[c][j].
template <int G>
[[gnu::always_inline]] inline void point_sums(const Vec* v, const float* u, std::int64_t in_channels,
                                              std::int64_t stride, Vec* m) {
  Vec acc[G];
#pragma GCC unroll 16
  for (int j = 0; j < G; ++j) acc[j] = Vec{};
  for (std::int64_t c = 0; c < in_channels; ++c) {
    const Vec x = v[c];
    const float* w = u + c * stride;
#pragma GCC unroll 16
    for (int j = 0; j < G; ++j) acc[j] += x * w[j];
  }
#pragma GCC unroll 16
  for (int j = 0; j < G; ++j) m[j] = acc[j];
}

/// Where a block's 16 tiles lie: each lane's window in the padded input and first output, which
/// of its 8 outputs exist, and whether lanes 0-7 and 8-15 each run along one row of tiles (their
/// windows are then two row loads, their outputs two row stores when all exist). Lanes past a
/// short segment's end (or the last block's missing segment) compute nothing that is kept.
struct Lanes {
  std::int64_t in_at[kLanes], out_at[kLanes];
  unsigned valid[kLanes];
  bool two_rows, all_valid;

  [[gnu::always_inline]] Lanes(const Shape& s, std::int64_t block) {
    const std::int64_t T0 = s.tiles[0], T1 = s.tiles[1], T2 = s.tiles[2], total = s.tile_count();
    const std::int64_t P2 = s.padded[2], P12 = s.padded[1] * P2, D1 = s.dims[1], D2 = s.dims[2];
    const std::int64_t per_row = s.segments_per_row(), segments = s.batch * T0 * T1 * per_row;
    all_valid = true;
    two_rows = s.by_segments();
    for (std::int64_t l = 0; l < kLanes; ++l) {
      std::int64_t row, tx;  // row: (n, tz, ty) flattened
      bool exists;
      if (two_rows) {
        std::int64_t segment = 2 * block + l / kSegment;
        exists = segment < segments;
        if (!exists) segment = 2 * block;
        row = segment / per_row;
        tx = segment % per_row * kSegment + l % kSegment;
        exists = exists && tx < T2;
      } else {
        const std::int64_t index = block * kLanes + l, f = std::min(index, total - 1);
        row = f / T2, tx = f % T2;
        exists = index < total;
      }
      const std::int64_t n = row / (T0 * T1), tz = row % (T0 * T1) / T1, ty = row % T1;
      in_at[l] = n * s.in_channels * s.padded_volume() + 2 * tz * P12 + 2 * ty * P2 + 2 * tx;
      out_at[l] = n * s.out_channels * s.dims_volume() + s.origin_offset() + 2 * tz * D1 * D2 + 2 * ty * D2 + 2 * tx;
      unsigned bits = 0;
      if (exists)
        for (int abc = 0; abc < 8; ++abc)
          if (2 * tz + abc / 4 < s.out[0] && 2 * ty + abc / 2 % 2 < s.out[1] && 2 * tx + abc % 2 < s.out[2])
            bits |= 1u << abc;
      valid[l] = bits;
      all_valid = all_valid && bits == 0xFFu;
    }
  }
  /// Offset of output (a, b, c) of a tile from its first.
  static std::int64_t output_offset(const Shape& s, int abc) {
    return abc / 4 * s.dims[1] * s.dims[2] + abc / 2 % 2 * s.dims[2] + abc % 2;
  }
};

/// The block's transformed input windows: V[p * point_stride + c * channel_stride] for point p and
/// channel c.
[[gnu::always_inline]] inline void transform_inputs(const Shape& s, const float* padded, const Lanes& lanes, Vec* V,
                                                    std::int64_t point_stride, std::int64_t channel_stride) {
  const std::int64_t P2 = s.padded[2], P12 = s.padded[1] * P2, pvol = s.padded_volume();
  for (std::int64_t c = 0; c < s.in_channels; ++c) {
    const float* plane = padded + c * pvol;
    Vec slab[kPoints];  // [z][y][x], transformed along x and y
    for (int z = 0; z < 4; ++z) {
      Vec* d = slab + z * 16;
      if (lanes.two_rows) {
        for (int r = 0; r < 4; ++r) {
          const std::int64_t row = z * P12 + r * P2;
          const float* a = plane + lanes.in_at[0] + row;
          const float* b = plane + lanes.in_at[8] + row;
          Vec a0, b0, a2, b2;
          load(a0, a);
          load(b0, b);
          load(a2, a + 2);
          load(b2, b + 2);
          // Lanes 0-7 take a's elements, lanes 8-15 b's: only the first 16 of each matter.
          evens(a0, b0, d[r * 4]);
          odds(a0, b0, d[r * 4 + 1]);
          evens(a2, b2, d[r * 4 + 2]);
          odds(a2, b2, d[r * 4 + 3]);
        }
      } else {
        for (int i = 0; i < 16; ++i) {
          const std::int64_t at = z * P12 + i / 4 * P2 + i % 4;
          for (int l = 0; l < kLanes; ++l) d[i][l] = plane[lanes.in_at[l] + at];
        }
      }
      for (int r = 0; r < 4; ++r) input_transform_1d(d + r * 4, 1);
      for (int x = 0; x < 4; ++x) input_transform_1d(d + x, 4);
    }
    Vec* v = V + c * channel_stride;
    for (int yx = 0; yx < 16; ++yx) {  // along z
      const Vec d0 = slab[yx], d1 = slab[16 + yx], d2 = slab[32 + yx], d3 = slab[48 + yx];
      v[yx * point_stride] = d0 - d2;
      v[(16 + yx) * point_stride] = d1 + d2;
      v[(32 + yx) * point_stride] = d2 - d1;
      v[(48 + yx) * point_stride] = d1 - d3;
    }
  }
}

/// Blocks [begin, end) of a convolution: U [64][in][out] transformed weights, padded input.
__attribute__((target_clones("avx512f", "avx2", "default")))
void run_blocks(const Shape& s, const float* padded, const float* U, const float* bias, bool leaky, float slope,
                float* output, float* buffer, std::int64_t begin, std::int64_t end) {
  const std::int64_t C = s.in_channels, K = s.out_channels, VS = odd(C), MS = odd(round_up(K, kGroup));
  const std::int64_t O2 = s.dims[2], O12 = s.dims[1] * O2, ovol = s.dims_volume();
  Vec* V = reinterpret_cast<Vec*>(buffer);  // [64][C], points VS apart
  Vec* M = V + kPoints * VS;                // [64][K], points MS apart
  for (std::int64_t block = begin; block < end; ++block) {
    const Lanes lanes(s, block);
    transform_inputs(s, padded, lanes, V, VS, 1);
    for (int p = 0; p < kPoints; ++p) {
      const float* u = U + p * C * K;
      std::int64_t k = 0;
      for (; k + kGroup <= K; k += kGroup) point_sums<kGroup>(V + p * VS, u + k, C, K, M + p * MS + k);
      for (; k + 4 <= K; k += 4) point_sums<4>(V + p * VS, u + k, C, K, M + p * MS + k);
      for (; k < K; ++k) point_sums<1>(V + p * VS, u + k, C, K, M + p * MS + k);
    }
    for (std::int64_t k = 0; k < K; ++k) {
      Vec y[8];
      output_transform(M + k, MS, y);
      const float b = bias ? bias[k] : 0.0f;
      for (int i = 0; i < 8; ++i) {
        Vec v = y[i] + b;
        if (leaky) {  // v > 0 ? v : slope * v, as a select on the bits
          const Mask positive = v > 0;
          v = reinterpret_cast<Vec>((reinterpret_cast<Mask>(v) & positive) |
                                    (reinterpret_cast<Mask>(v * slope) & ~positive));
        }
        y[i] = v;
      }
      float* out = output + k * ovol;
      if (lanes.two_rows && lanes.all_valid) {
        for (int ab = 0; ab < 4; ++ab) {
          const std::int64_t row = ab / 2 * O12 + ab % 2 * O2;
          Vec low, high;
          interleave_low(y[ab * 2], y[ab * 2 + 1], low);
          interleave_high(y[ab * 2], y[ab * 2 + 1], high);
          store(out + lanes.out_at[0] + row, low);
          store(out + lanes.out_at[8] + row, high);
        }
      } else {
        for (int l = 0; l < kLanes; ++l)
          for (int abc = 0; abc < 8; ++abc)
            if (lanes.valid[l] >> abc & 1u) out[lanes.out_at[l] + Lanes::output_offset(s, abc)] = y[abc][l];
      }
    }
  }
}

/// The weights' gradient of blocks [begin, end), in chunks of up to kChunk blocks: per chunk the
/// transformed inputs Vc [64][C][chunk] and output gradients Gc [64][K][chunk] (A dY A^T), then
/// per point the lanes' products summed over the chunk, 4 x 4 (channel, filter) pairs at a time,
/// their lanes added up and the sums added to S [64][C][K].
__attribute__((target_clones("avx512f", "avx2", "default")))
void weight_gradient_blocks(const Shape& s, const float* padded, const float* grad_output, float* buffer,
                            std::int64_t begin, std::int64_t end) {
  const std::int64_t C = s.in_channels, K = s.out_channels, ovol = s.dims_volume();
  const std::int64_t O2 = s.dims[2], O12 = s.dims[1] * O2, VcS = odd(C * kChunk), GcS = odd(K * kChunk);
  float* S = buffer;
  Vec* Vc = reinterpret_cast<Vec*>(buffer + round_up(kPoints * C * K, kLanes));
  Vec* Gc = Vc + kPoints * VcS;
  std::fill(S, S + kPoints * C * K, 0.0f);
  for (std::int64_t first = begin; first < end; first += kChunk) {
    const std::int64_t count = std::min(kChunk, end - first);
    for (std::int64_t j = 0; j < count; ++j) {
      const Lanes lanes(s, first + j);
      transform_inputs(s, padded, lanes, Vc + j, VcS, kChunk);
      for (std::int64_t k = 0; k < K; ++k) {
        const float* dy = grad_output + k * ovol;
        Vec y[8];  // [a][b][c]
        if (lanes.two_rows && lanes.all_valid) {
          for (int ab = 0; ab < 4; ++ab) {
            const std::int64_t row = ab / 2 * O12 + ab % 2 * O2;
            Vec lo, hi;
            load(lo, dy + lanes.out_at[0] + row);
            load(hi, dy + lanes.out_at[8] + row);
            evens(lo, hi, y[ab * 2]);
            odds(lo, hi, y[ab * 2 + 1]);
          }
        } else {
          for (int abc = 0; abc < 8; ++abc) {
            y[abc] = Vec{};
            for (int l = 0; l < kLanes; ++l)
              if (lanes.valid[l] >> abc & 1u) y[abc][l] = dy[lanes.out_at[l] + Lanes::output_offset(s, abc)];
          }
        }
        // A dY A^T along each axis: (y0, y1) -> (y0, y0 + y1, y0 - y1, -y1).
        Vec zc[4][4];  // [z point][b c] after the z axis
        for (int bc = 0; bc < 4; ++bc) {
          const Vec y0 = y[bc], y1 = y[4 + bc];
          zc[0][bc] = y0, zc[1][bc] = y0 + y1, zc[2][bc] = y0 - y1, zc[3][bc] = -y1;
        }
        Vec* g = Gc + k * kChunk + j;
        for (int z = 0; z < 4; ++z) {
          Vec yc[4][2];  // [y point][c]
          for (int c = 0; c < 2; ++c) {
            const Vec y0 = zc[z][c], y1 = zc[z][2 + c];
            yc[0][c] = y0, yc[1][c] = y0 + y1, yc[2][c] = y0 - y1, yc[3][c] = -y1;
          }
          for (int r = 0; r < 4; ++r) {
            const Vec y0 = yc[r][0], y1 = yc[r][1];
            const std::int64_t p = z * 16 + r * 4;
            g[p * GcS] = y0;
            g[(p + 1) * GcS] = y0 + y1;
            g[(p + 2) * GcS] = y0 - y1;
            g[(p + 3) * GcS] = -y1;
          }
        }
      }
    }
    for (int p = 0; p < kPoints; ++p) {
      const Vec* v = Vc + p * VcS;
      const Vec* g = Gc + p * GcS;
      float* sums = S + p * C * K;
      for (std::int64_t c0 = 0; c0 < C; c0 += 4)
        for (std::int64_t k0 = 0; k0 < K; k0 += 4) {
          const int cn = static_cast<int>(std::min<std::int64_t>(4, C - c0));
          const int kn = static_cast<int>(std::min<std::int64_t>(4, K - k0));
          Vec acc[16] = {};  // [channel][filter]
          if (cn == 4 && kn == 4) {
            for (std::int64_t j = 0; j < count; ++j) {
              const Vec x0 = v[c0 * kChunk + j], x1 = v[(c0 + 1) * kChunk + j], x2 = v[(c0 + 2) * kChunk + j],
                        x3 = v[(c0 + 3) * kChunk + j];
#pragma GCC unroll 4
              for (int b = 0; b < 4; ++b) {
                const Vec w = g[(k0 + b) * kChunk + j];
                acc[b] += x0 * w, acc[4 + b] += x1 * w, acc[8 + b] += x2 * w, acc[12 + b] += x3 * w;
              }
            }
          } else {
            for (std::int64_t j = 0; j < count; ++j)
              for (int a = 0; a < cn; ++a)
                for (int b = 0; b < kn; ++b) acc[a * 4 + b] += v[(c0 + a) * kChunk + j] * g[(k0 + b) * kChunk + j];
          }
          Vec total;
          lane_sums(acc, total);
          for (int a = 0; a < cn; ++a)
            for (int b = 0; b < kn; ++b) sums[(c0 + a) * K + k0 + b] += total[a * 4 + b];
        }
    }
  }
}

/// Zeros in the output array of `s` (of out_channels channels) outside the region it computes.
void zero_outside_region(const Shape& s, float* output) {
  const std::int64_t planes = s.batch * s.out_channels, D1 = s.dims[1], D2 = s.dims[2], volume = s.dims_volume();
  auto zero = [](float* p, std::int64_t n) {
    if (n > 0) std::memset(p, 0, static_cast<std::size_t>(n) * sizeof(float));
  };
#pragma omp parallel for schedule(static)
  for (std::int64_t plane = 0; plane < planes; ++plane) {
    float* p = output + plane * volume;
    zero(p, s.origin[0] * D1 * D2);
    zero(p + (s.origin[0] + s.out[0]) * D1 * D2, (s.dims[0] - s.origin[0] - s.out[0]) * D1 * D2);
    for (std::int64_t z = s.origin[0]; z < s.origin[0] + s.out[0]; ++z) {
      float* slice = p + z * D1 * D2;
      zero(slice, s.origin[1] * D2);
      zero(slice + (s.origin[1] + s.out[1]) * D2, (D1 - s.origin[1] - s.out[1]) * D2);
      for (std::int64_t y = s.origin[1]; y < s.origin[1] + s.out[1]; ++y) {
        zero(slice + y * D2, s.origin[2]);
        zero(slice + y * D2 + s.origin[2] + s.out[2], D2 - s.origin[2] - s.out[2]);
      }
    }
  }
}

}  // namespace

void WinogradConvolution::AlignedFree::operator()(float* p) const { std::free(p); }

std::int64_t winograd_tiles(const ConvolutionGeometry& g) {
  std::int64_t count = g.batch;
  for (auto extent : g.output_size) count *= (extent + 1) / 2;
  return count;
}

bool winograd_convolution_applies(const ConvolutionGeometry& g) {
  if (g.input_size.size() != 3 || g.precision != Precision::F32 || g.in_channels < 8 || g.out_channels < 8)
    return false;
  for (std::size_t i = 0; i < 3; ++i)
    if (g.kernel[i] != 3 || g.stride[i] != 1 || g.dilation[i] != 1 || g.padding[i] < 0 || g.padding[i] > 2 ||
        g.input_size[i] + 2 * g.padding[i] < 3)
      return false;
  return true;
}

/// A buffer of at least `floats` floats, 64-byte aligned, kept for later calls.
float* WinogradConvolution::buffer(std::unique_ptr<float[], AlignedFree>& kept, std::int64_t& capacity,
                                   std::int64_t floats) {
  if (floats > capacity) {
    kept.reset(static_cast<float*>(std::aligned_alloc(64, static_cast<std::size_t>(round_up(floats, 16)) * sizeof(float))));
    if (!kept) throw std::bad_alloc();
    capacity = floats;
  }
  return kept.get();
}

const float* WinogradConvolution::pad(const WinogradShape& s, const float* input) {
  if (s.padded_in_place()) return input;
  const std::int64_t planes = s.batch * s.in_channels, pvol = s.padded_volume();
  float* padded = buffer(padded_, padded_capacity_, planes * pvol + kSlack);
  std::memset(padded + planes * pvol, 0, kSlack * sizeof(float));
  const std::int64_t ivol = s.in_volume(), P2 = s.padded[2], P12 = s.padded[1] * P2;
  const std::int64_t copied = std::min(s.in[2], P2 - s.pad[2]);  // a region's windows may end before the row
#pragma omp parallel for schedule(static)
  for (std::int64_t plane = 0; plane < planes; ++plane) {
    // Each padded row written once: zeros, or zeros around an input row.
    const float* from = input + plane * ivol;
    for (std::int64_t z = 0; z < s.padded[0]; ++z)
      for (std::int64_t y = 0; y < s.padded[1]; ++y) {
        float* row = padded + plane * pvol + z * P12 + y * P2;
        const std::int64_t iz = z - s.pad[0], iy = y - s.pad[1];
        if (iz < 0 || iz >= s.in[0] || iy < 0 || iy >= s.in[1]) {
          std::memset(row, 0, static_cast<std::size_t>(P2) * sizeof(float));
          continue;
        }
        std::memset(row, 0, static_cast<std::size_t>(s.pad[2]) * sizeof(float));
        std::memcpy(row + s.pad[2], from + (iz * s.in[1] + iy) * s.in[2], static_cast<std::size_t>(copied) * sizeof(float));
        std::memset(row + s.pad[2] + copied, 0, static_cast<std::size_t>(P2 - s.pad[2] - copied) * sizeof(float));
      }
  }
  return padded;
}

void WinogradConvolution::run(const WinogradShape& s, const float* input, const float* bias, bool leaky, float slope,
                              float* output) {
  const float* padded = pad(s, input);
  const int threads = omp_get_max_threads();
  const std::int64_t block_floats = s.block_floats();
  float* buffers = buffer(blocks_, blocks_capacity_, threads * block_floats);
  const std::int64_t blocks = s.block_count();
  const float* U = transformed_.data();
#pragma omp parallel num_threads(threads)
  {
    const std::int64_t count = omp_get_num_threads(), thread = omp_get_thread_num();
    run_blocks(s, padded, U, bias, leaky, slope, output, buffers + thread * block_floats, blocks * thread / count,
               blocks * (thread + 1) / count);
  }
}

void WinogradConvolution::forward(const ConvolutionGeometry& geometry, const float* input, const float* weights,
                                  const float* bias, float* output) {
  TESSERA_CHECK(winograd_convolution_applies(geometry), "Winograd convolution kernels asked for {}",
                geometry.to_string());
  const std::int64_t C = geometry.in_channels, K = geometry.out_channels;
  const WinogradShape s(geometry.batch, C, K, geometry.input_size, geometry.padding.data());
  transformed_.resize(static_cast<std::size_t>(kPoints * C * K));
  transform_weights(weights, K, C, false, transformed_.data());
  run(s, input, geometry.bias ? bias : nullptr, geometry.leaky_relu, geometry.leaky_slope, output);
}

void WinogradConvolution::backward_data(const ConvolutionGeometry& geometry, const float* grad_output,
                                        const float* weights, float* grad_input) {
  TESSERA_CHECK(winograd_convolution_applies(geometry), "Winograd convolution kernels asked for {}",
                geometry.to_string());
  const std::int64_t C = geometry.in_channels, K = geometry.out_channels;
  const std::int64_t padding[3] = {2 - geometry.padding[0], 2 - geometry.padding[1], 2 - geometry.padding[2]};
  const WinogradShape whole(geometry.batch, K, C, geometry.output_size, padding);
  // Only the input window's data region, where it starts within the padding of grad_output's copy.
  std::int64_t begin[3] = {0, 0, 0}, extent[3] = {whole.out[0], whole.out[1], whole.out[2]};
  bool part = false;
  if (!geometry.data_begin.empty()) {
    TESSERA_CHECK(geometry.data_begin.size() == 3 && geometry.data_extent.size() == 3,
                  "Winograd backward-data: a data region of {} dimensions", geometry.data_begin.size());
    for (std::size_t i = 0; i < 3; ++i) {
      const std::int64_t b = geometry.data_begin[i], e = geometry.data_extent[i];
      TESSERA_CHECK(b >= 0 && e > 0 && b + e <= whole.out[i], "Winograd backward-data: data region outside {}",
                    geometry.to_string());
      if (b > whole.pad[i]) continue;
      begin[i] = b, extent[i] = e;
      part = part || b > 0 || e < whole.out[i];
    }
  }
  const WinogradShape s = part ? whole.region(begin, extent) : whole;
  transformed_.resize(static_cast<std::size_t>(kPoints * C * K));
  transform_weights(weights, K, C, true, transformed_.data());
  run(s, grad_output, nullptr, false, 0.0f, grad_input);
  if (part) zero_outside_region(s, grad_input);
}

void WinogradConvolution::backward_weights(const ConvolutionGeometry& geometry, const float* input,
                                           const float* grad_output, float* grad_weights, float* grad_bias) {
  TESSERA_CHECK(winograd_convolution_applies(geometry), "Winograd convolution kernels asked for {}",
                geometry.to_string());
  const std::int64_t C = geometry.in_channels, K = geometry.out_channels;
  const WinogradShape s(geometry.batch, C, K, geometry.input_size, geometry.padding.data());
  const float* padded = pad(s, input);
  const int threads = omp_get_max_threads();
  const std::int64_t sums = kPoints * C * K;
  const std::int64_t thread_floats = round_up(sums, kLanes) + kPoints * (odd(C * kChunk) + odd(K * kChunk)) * kLanes;
  float* buffers = buffer(blocks_, blocks_capacity_, threads * thread_floats);
  const std::int64_t blocks = s.block_count();
#pragma omp parallel num_threads(threads)
  {
    const std::int64_t count = omp_get_num_threads(), thread = omp_get_thread_num();
    weight_gradient_blocks(s, padded, grad_output, buffers + thread * thread_floats, blocks * thread / count,
                           blocks * (thread + 1) / count);
  }
  // dU: each point's sums over threads, in double; then dW = G^T dU G along each axis.
  std::vector<double>& dU = sums_;
  dU.assign(static_cast<std::size_t>(sums), 0.0);
  for (int t = 0; t < threads; ++t) {
    const float* S = buffers + t * thread_floats;
    for (std::int64_t i = 0; i < sums; ++i) dU[static_cast<std::size_t>(i)] += S[i];
  }
  auto back = [](double u0, double u1, double u2, double u3, double* r, int stride) {
    r[0] = u0 + (u1 + u2) / 2;
    r[stride] = (u1 - u2) / 2;
    r[2 * stride] = (u1 + u2) / 2 + u3;
  };
  for (std::int64_t k = 0; k < K; ++k)
    for (std::int64_t c = 0; c < C; ++c) {
      double u[kPoints], x[48], y[36], w[27];  // [z][y][x] points; x: [4][4][3]; y: [4][3][3]; w: [3][3][3]
      for (int p = 0; p < kPoints; ++p) u[p] = dU[static_cast<std::size_t>((p * C + c) * K + k)];
      for (int zy = 0; zy < 16; ++zy) back(u[zy * 4], u[zy * 4 + 1], u[zy * 4 + 2], u[zy * 4 + 3], x + zy * 3, 1);
      for (int z = 0; z < 4; ++z)
        for (int i = 0; i < 3; ++i) {
          const double* col = x + z * 12 + i;
          back(col[0], col[3], col[6], col[9], y + z * 9 + i, 3);
        }
      for (int yx = 0; yx < 9; ++yx) back(y[yx], y[9 + yx], y[18 + yx], y[27 + yx], w + yx, 9);
      for (int r = 0; r < 27; ++r) grad_weights[(k * C + c) * 27 + r] = static_cast<float>(w[r]);
    }
  if (geometry.bias) {
    const std::int64_t ovol = s.out_volume();
#pragma omp parallel for schedule(static) num_threads(threads)
    for (std::int64_t k = 0; k < K; ++k) {
      double sum = 0;
      for (std::int64_t n = 0; n < s.batch; ++n) {
        const float* dy = grad_output + (n * K + k) * ovol;
        for (std::int64_t i = 0; i < ovol; ++i) sum += dy[i];
      }
      grad_bias[k] = static_cast<float>(sum);
    }
  }
}

}  // namespace tessera::host
