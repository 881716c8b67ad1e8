// Winograd kernels for 3 x 3 x 3 convolutions (see host_winograd_convolution.hpp). A block is 16
// tiles of 2 x 2 x 2 outputs, one per vector lane. Per input channel the block's 4 x 4 x 4 input
// windows are read (two deinterleaved row loads where the lanes' tiles lie in at most two rows,
// else lane by lane) and transformed into 64 points; per point, the products with the transformed
// weights of 16 output channels at a time are summed over the input channels in registers; per
// output channel the 64 sums are transformed back into the 8 outputs of each lane's tile.
// Built for AVX-512, AVX2 and the baseline, the variant chosen when the library loads.
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

using Vec = float __attribute__((vector_size(64)));
using Mask = int __attribute__((vector_size(64)));
// Vectors pass only by reference and move through memcpy (unaligned loads and stores): 64-byte
// vectors by value change the calling convention between the variants.
[[gnu::always_inline]] inline void load(Vec& v, const float* p) { std::memcpy(&v, p, sizeof v); }
[[gnu::always_inline]] inline void store(float* p, const Vec& v) { std::memcpy(p, &v, sizeof v); }

// Lane selections: the even and odd elements of two vectors, and two vectors interleaved.
constexpr Mask kEvens = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
constexpr Mask kOdds = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
constexpr Mask kLow = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
constexpr Mask kHigh = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

std::int64_t round_up(std::int64_t value, std::int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

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
/// gradient with the flipped, transposed weights.
struct WinogradShape {
  std::int64_t batch, in_channels, out_channels;
  std::int64_t in[3], out[3], pad[3], tiles[3], padded[3];

  WinogradShape(std::int64_t n, std::int64_t c, std::int64_t k, const std::vector<std::int64_t>& input_size,
        const std::int64_t* padding)
      : batch(n), in_channels(c), out_channels(k) {
    for (int i = 0; i < 3; ++i) {
      in[i] = input_size[static_cast<std::size_t>(i)];
      pad[i] = padding[i];
      out[i] = in[i] + 2 * pad[i] - 2;
      tiles[i] = (out[i] + 1) / 2;
      padded[i] = 2 * tiles[i] + 2;  // every tile's window lies inside
    }
  }
  std::int64_t in_volume() const { return in[0] * in[1] * in[2]; }
  std::int64_t out_volume() const { return out[0] * out[1] * out[2]; }
  std::int64_t padded_volume() const { return padded[0] * padded[1] * padded[2]; }
  std::int64_t tile_count() const { return batch * tiles[0] * tiles[1] * tiles[2]; }
  /// Floats of one block's buffers: transformed inputs [64][in channels] and sums
  /// [64][out channels], one vector each.
  std::int64_t block_floats() const { return kPoints * (in_channels + round_up(out_channels, kGroup)) * kLanes; }
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

/// Blocks [begin, end) of a convolution: U [64][in][out] transformed weights, padded input.
__attribute__((target_clones("avx512f", "avx2", "default")))
void run_blocks(const Shape& s, const float* padded, const float* U, const float* bias, bool leaky, float slope,
                float* output, float* buffer, std::int64_t begin, std::int64_t end) {
  const std::int64_t C = s.in_channels, K = s.out_channels, KG = round_up(K, kGroup);
  const std::int64_t T1 = s.tiles[1], T2 = s.tiles[2], T012 = s.tiles[0] * T1 * T2, total = s.tile_count();
  const std::int64_t P2 = s.padded[2], P12 = s.padded[1] * P2, pvol = s.padded_volume();
  const std::int64_t O1 = s.out[1], O2 = s.out[2], O12 = O1 * O2, ovol = s.out_volume();
  Vec* V = reinterpret_cast<Vec*>(buffer);  // [64][C]
  Vec* M = V + kPoints * C;                 // [64][KG]
  for (std::int64_t block = begin; block < end; ++block) {
    std::int64_t in_at[kLanes], out_at[kLanes], tx_of[kLanes];
    unsigned valid[kLanes];
    bool all_valid = true;
    for (std::int64_t l = 0; l < kLanes; ++l) {
      const std::int64_t index = block * kLanes + l, f = std::min(index, total - 1);
      const std::int64_t n = f / T012, tz = f % T012 / (T1 * T2), ty = f % (T1 * T2) / T2, tx = f % T2;
      in_at[l] = n * C * pvol + 2 * tz * P12 + 2 * ty * P2 + 2 * tx;
      out_at[l] = n * K * ovol + 2 * tz * O12 + 2 * ty * O2 + 2 * tx;
      tx_of[l] = tx;
      unsigned bits = 0;
      if (index < total)
        for (int abc = 0; abc < 8; ++abc)
          if (2 * tz + abc / 4 < s.out[0] && 2 * ty + abc / 2 % 2 < O1 && 2 * tx + abc % 2 < O2) bits |= 1u << abc;
      valid[l] = bits;
      all_valid = all_valid && bits == 0xFFu;
    }
    // Lanes 0-7 and 8-15 each run along one row of tiles: their windows are two row loads.
    const bool two_rows = block * kLanes + kLanes <= total && tx_of[0] + 7 < T2 && tx_of[8] + 7 < T2 &&
                          tx_of[7] == tx_of[0] + 7 && tx_of[15] == tx_of[8] + 7;
    for (std::int64_t c = 0; c < C; ++c) {
      const float* plane = padded + c * pvol;
      Vec slab[kPoints];  // [z][y][x], transformed along x and y
      for (int z = 0; z < 4; ++z) {
        Vec* d = slab + z * 16;
        if (two_rows) {
          for (int r = 0; r < 4; ++r) {
            const std::int64_t row = z * P12 + r * P2;
            const float* a = plane + in_at[0] + row;
            const float* b = plane + in_at[8] + row;
            Vec a0, b0, a2, b2;
            load(a0, a);
            load(b0, b);
            load(a2, a + 2);
            load(b2, b + 2);
            // Lanes 0-7 take a's elements, lanes 8-15 b's: only the first 16 of each matter.
            d[r * 4] = __builtin_shuffle(a0, b0, kEvens);
            d[r * 4 + 1] = __builtin_shuffle(a0, b0, kOdds);
            d[r * 4 + 2] = __builtin_shuffle(a2, b2, kEvens);
            d[r * 4 + 3] = __builtin_shuffle(a2, b2, kOdds);
          }
        } else {
          for (int i = 0; i < 16; ++i) {
            const std::int64_t at = z * P12 + i / 4 * P2 + i % 4;
            for (int l = 0; l < kLanes; ++l) d[i][l] = plane[in_at[l] + at];
          }
        }
        for (int r = 0; r < 4; ++r) input_transform_1d(d + r * 4, 1);
        for (int x = 0; x < 4; ++x) input_transform_1d(d + x, 4);
      }
      for (int yx = 0; yx < 16; ++yx) {  // along z, into the block's [point][channel] vectors
        const Vec d0 = slab[yx], d1 = slab[16 + yx], d2 = slab[32 + yx], d3 = slab[48 + yx];
        V[yx * C + c] = d0 - d2;
        V[(16 + yx) * C + c] = d1 + d2;
        V[(32 + yx) * C + c] = d2 - d1;
        V[(48 + yx) * C + c] = d1 - d3;
      }
    }
    for (int p = 0; p < kPoints; ++p) {
      const float* u = U + p * C * K;
      std::int64_t k = 0;
      for (; k + kGroup <= K; k += kGroup) point_sums<kGroup>(V + p * C, u + k, C, K, M + p * KG + k);
      for (; k + 4 <= K; k += 4) point_sums<4>(V + p * C, u + k, C, K, M + p * KG + k);
      for (; k < K; ++k) point_sums<1>(V + p * C, u + k, C, K, M + p * KG + k);
    }
    for (std::int64_t k = 0; k < K; ++k) {
      Vec y[8];
      output_transform(M + k, KG, y);
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
      if (two_rows && all_valid) {
        for (int ab = 0; ab < 4; ++ab) {
          const std::int64_t row = ab / 2 * O12 + ab % 2 * O2;
          store(out + out_at[0] + row, __builtin_shuffle(y[ab * 2], y[ab * 2 + 1], kLow));
          // Lanes 8-15 write after lanes 0-7: where both lie in one row, b's vector starts 16 later.
          Vec high = __builtin_shuffle(y[ab * 2], y[ab * 2 + 1], kHigh);
          store(out + out_at[8] + row, high);
        }
      } else {
        for (int l = 0; l < kLanes; ++l)
          for (int abc = 0; abc < 8; ++abc)
            if (valid[l] >> abc & 1u) out[out_at[l] + abc / 4 * O12 + abc / 2 % 2 * O2 + abc % 2] = y[abc][l];
      }
    }
  }
}

}  // namespace

void WinogradConvolution::AlignedFree::operator()(float* p) const { std::free(p); }

bool winograd_convolution_applies(const ConvolutionGeometry& g) {
  if (g.input_size.size() != 3 || g.precision != Precision::F32 || g.in_channels < 8 || g.out_channels < 8)
    return false;
  for (std::size_t i = 0; i < 3; ++i)
    if (g.kernel[i] != 3 || g.stride[i] != 1 || g.dilation[i] != 1 || g.padding[i] < 0 || g.padding[i] > 2 ||
        g.input_size[i] + 2 * g.padding[i] < 3)
      return false;
  return true;
}

void WinogradConvolution::run(const WinogradShape& s, const float* input, const float* bias, bool leaky, float slope,
                              float* output) {
  // The input with its padding written out, each tile's window inside.
  const std::int64_t planes = s.batch * s.in_channels, pvol = s.padded_volume();
  if (planes * pvol > padded_capacity_) {
    padded_.reset(static_cast<float*>(std::aligned_alloc(64, static_cast<std::size_t>(round_up(planes * pvol, 16)) *
                                                                 sizeof(float))));
    if (!padded_) throw std::bad_alloc();
    padded_capacity_ = planes * pvol;
  }
  float* padded = padded_.get();
  const std::int64_t ivol = s.in_volume(), P2 = s.padded[2], P12 = s.padded[1] * P2;
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
        std::memcpy(row + s.pad[2], from + (iz * s.in[1] + iy) * s.in[2], static_cast<std::size_t>(s.in[2]) * sizeof(float));
        std::memset(row + s.pad[2] + s.in[2], 0, static_cast<std::size_t>(P2 - s.pad[2] - s.in[2]) * sizeof(float));
      }
  }
  const int threads = omp_get_max_threads();
  const std::int64_t block_floats = s.block_floats();
  if (threads * block_floats > blocks_capacity_) {
    blocks_.reset(static_cast<float*>(std::aligned_alloc(64, static_cast<std::size_t>(threads * block_floats) *
                                                                 sizeof(float))));
    if (!blocks_) throw std::bad_alloc();
    blocks_capacity_ = threads * block_floats;
  }
  const std::int64_t blocks = (s.tile_count() + kLanes - 1) / kLanes;
  const float* U = transformed_.data();
  float* buffers = blocks_.get();
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
  const WinogradShape s(geometry.batch, K, C, geometry.output_size, padding);
  transformed_.resize(static_cast<std::size_t>(kPoints * C * K));
  transform_weights(weights, K, C, true, transformed_.data());
  run(s, grad_output, nullptr, false, 0.0f, grad_input);
}

}  // namespace tessera::host
