// Max and average pooling on plain N x C x (D) x H x W buffers, as Kokkos loops over the
// (sample, channel) planes. oneDNN 2.6 pools plain layouts only with its generic simple_nchw
// kernel, which measured ~10x slower than these loops on the Fashion-MNIST shapes, and
// converting to its blocked layout and back costs two extra passes over the activations.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "layers/host_loops.hpp"
#include "layers/host_stream.hpp"
#include "layers/onednn_common.hpp"
#include "layers/pool_box.hpp"

namespace tessera::onednn {
namespace {

using Box = PoolBox;

/// The local input range [begin, end) a window covers in one dimension: the window of global
/// output position out_origin + out_index, clipped to the global input, in local coordinates.
struct Span {
  std::int64_t begin, end;
};
inline Span window(const Box& b, int dim, std::int64_t out_index) {
  const std::int64_t start = (b.out_origin[dim] + out_index) * b.stride[dim] - b.padding[dim];
  return {std::max<std::int64_t>(start, 0) - b.in_origin[dim],
          std::min(start + b.kernel[dim], b.limit[dim]) - b.in_origin[dim]};
}

/// Calls body(output_index, output_at, d_span, h_span, w_span) for every output element of one
/// plane: its index among the plane's outputs (the maxima's positions are stored so) and its
/// place in the plane's output layout (PoolBox::out_at).
template <typename Body>
inline void for_each_window(const Box& b, const Body& body) {
  std::int64_t o = 0;
  for (std::int64_t od = 0; od < b.out[0]; ++od) {
    const Span d = window(b, 0, od);
    for (std::int64_t oh = 0; oh < b.out[1]; ++oh) {
      const Span h = window(b, 1, oh);
      const std::int64_t at = b.out_at(0, od, oh);
      for (std::int64_t ow = 0; ow < b.out[2]; ++ow, ++o) body(o, at + ow, d, h, window(b, 2, ow));
    }
  }
}

/// Calls body(output_index, output_at) for every output element of one plane (as for_each_window).
template <typename Body>
inline void for_each_output(const Box& b, const Body& body) {
  std::int64_t o = 0;
  for (std::int64_t od = 0; od < b.out[0]; ++od)
    for (std::int64_t oh = 0; oh < b.out[1]; ++oh) {
      const std::int64_t at = b.out_at(0, od, oh);
      for (std::int64_t ow = 0; ow < b.out[2]; ++ow, ++o) body(o, at + ow);
    }
}

/// Whether no window is clipped: none reaches into the padding or past the global input or the
/// local one. Then the windows need no clipping (CosmoFlow's 2x2x2 pools, Fashion-MNIST's 2x2).
bool unclipped(const Box& b) {
  for (int d = 0; d < 3; ++d) {
    if (b.out[d] == 0) continue;
    const std::int64_t first = b.out_origin[d] * b.stride[d] - b.padding[d];
    const std::int64_t last_end = (b.out_origin[d] + b.out[d] - 1) * b.stride[d] - b.padding[d] + b.kernel[d];
    if (first < 0 || first < b.in_origin[d] || last_end > b.limit[d] || last_end - b.in_origin[d] > b.in[d]) return false;
  }
  return true;
}

/// One output row of 2 x 2 windows (Depth2 false: a 2-D pool, or a 1 x 2 x 2 one) or 2 x 2 x 2
/// windows with stride 2: the candidates of each window in scan order, kept with selects on 32-bit
/// values only, so the compiler vectorises across the row. `x` points at the window row's first
/// element (depth d0, height h0); `base` is its position; `rows` is a depth plane, `row` a row.
template <bool Depth2>
inline void max_pool_row_2x2(const float* x, std::int32_t base, std::int32_t rows, std::int32_t row,
                             std::int64_t count, float* y, std::int32_t* where) {
  for (std::int64_t ow = 0; ow < count; ++ow) {
    const std::int64_t w = 2 * ow;
    float best = -std::numeric_limits<float>::infinity();
    std::int32_t offset = 0;
    auto consider = [&](std::int32_t at) {
      const float value = x[w + at];
      const bool larger = value > best;
      best = larger ? value : best;
      offset = larger ? at : offset;
    };
    consider(0);
    consider(1);
    consider(row);
    consider(row + 1);
    if constexpr (Depth2) {
      consider(rows);
      consider(rows + 1);
      consider(rows + row);
      consider(rows + row + 1);
    }
    y[ow] = best;
    where[ow] = base + static_cast<std::int32_t>(w) + offset;
  }
}

/// Rows of at least this many outputs run the row functions built for the CPU's widest vectors
/// (target_clones, chosen at load); shorter ones run them inline (a call and a vector loop's set-up
/// cost more than they gain on Fashion-MNIST's rows of 7 and 14).
constexpr std::int64_t kWideRow = 32;

/// max_pool_row_2x2 for rows of kWideRow outputs or more (the compilers take no template here).
__attribute__((target_clones("avx512f", "avx2", "default"))) void max_pool_row_2x2_wide(
    const float* x, std::int32_t base, std::int32_t rows, std::int32_t row, std::int64_t count, float* y,
    std::int32_t* where) {
  max_pool_row_2x2<false>(x, base, rows, row, count, y, where);
}
__attribute__((target_clones("avx512f", "avx2", "default"))) void max_pool_row_2x2x2_wide(
    const float* x, std::int32_t base, std::int32_t rows, std::int32_t row, std::int64_t count, float* y,
    std::int32_t* where) {
  max_pool_row_2x2<true>(x, base, rows, row, count, y, where);
}

/// Max pooling forward where no window is clipped: the same scan (depth, then height, then width;
/// the first of equal maxima) as the general loop, without clipping each window. Kernel extents
/// K0, K1, K2 > 0 are fixed at compile time (0: the box's).
template <int K0, int K1, int K2>
void max_pool_unclipped(const Box& b, const float* input, float* output, std::int32_t* argmax) {
  const std::int64_t in_plane = b.in_plane(), out_plane = b.out_plane(), rows = b.in[1] * b.in[2], row = b.in[2];
  const std::int64_t k0 = K0 ? K0 : b.kernel[0], k1 = K1 ? K1 : b.kernel[1], k2 = K2 ? K2 : b.kernel[2];
  std::int64_t first[3];
  for (int d = 0; d < 3; ++d) first[d] = b.out_origin[d] * b.stride[d] - b.padding[d] - b.in_origin[d];
  host_for(
      "max pool forward", b.planes,
      [=](std::int64_t p) {
        const float* x = input + p * in_plane;
        std::int32_t* where = argmax + p * out_plane;
        std::int64_t o = 0;
        for (std::int64_t od = 0; od < b.out[0]; ++od) {
          const std::int64_t d0 = first[0] + od * b.stride[0];
          for (std::int64_t oh = 0; oh < b.out[1]; ++oh) {
            const std::int64_t base = d0 * rows + (first[1] + oh * b.stride[1]) * row + first[2];
            float* y = output + b.out_at(p, od, oh);  // this output row
            if constexpr ((K0 == 1 || K0 == 2) && K1 == 2 && K2 == 2) {
              if ((K0 == 1 || b.stride[0] == 2) && b.stride[1] == 2 && b.stride[2] == 2) {
                const auto at = static_cast<std::int32_t>(base);
                const auto plane = static_cast<std::int32_t>(rows), width = static_cast<std::int32_t>(row);
                if (b.out[2] < kWideRow)
                  max_pool_row_2x2<K0 == 2>(x + base, at, plane, width, b.out[2], y, where + o);
                else if constexpr (K0 == 2)
                  max_pool_row_2x2x2_wide(x + base, at, plane, width, b.out[2], y, where + o);
                else
                  max_pool_row_2x2_wide(x + base, at, plane, width, b.out[2], y, where + o);
                o += b.out[2];
                continue;
              }
            }
            for (std::int64_t ow = 0; ow < b.out[2]; ++ow, ++o) {
              const std::int64_t start = base + ow * b.stride[2];
              float best = -std::numeric_limits<float>::infinity();
              std::int64_t best_at = start;
              for (std::int64_t i = 0; i < k0; ++i)
                for (std::int64_t j = 0; j < k1; ++j)
                  for (std::int64_t k = 0; k < k2; ++k) {
                    // Selects instead of branches: on real data the larger of two neighbours is a
                    // coin toss, and mispredicted branches cost more than the loads.
                    const std::int64_t at = start + i * rows + j * row + k;
                    const float value = x[at];
                    const bool larger = value > best;
                    best = larger ? value : best;
                    best_at = larger ? at : best_at;
                  }
              y[ow] = best;
              where[o] = static_cast<std::int32_t>(best_at);
            }
          }
        }
      },
      in_plane);
}

/// Whether the windows tile the local input exactly (stride = kernel, the first window at local 0,
/// the last ending at the local input's end, no padding reached), are 2 wide and make rows of at
/// least kWideRow outputs: then every input element lies in one window, and a row of them in
/// windows of one output row (shorter rows scatter faster).
bool tiles_input_in_pairs(const Box& b) {
  if (b.kernel[2] != 2 || b.out[2] < kWideRow || !unclipped(b)) return false;
  for (int d = 0; d < 3; ++d) {
    const std::int64_t first = b.out_origin[d] * b.stride[d] - b.padding[d] - b.in_origin[d];
    if (b.stride[d] != b.kernel[d] || first != 0 || b.out[d] * b.kernel[d] != b.in[d]) return false;
  }
  return true;
}

/// One input row's gradient under windows 2 wide that tile it: element 2 ow + k gets grad[ow]
/// where it is window ow's maximum (`where`, positions within the plane; `base`, the row's), else 0.
__attribute__((target_clones("avx512f", "avx2", "default"))) void max_backward_row_2(
    const float* grad, const std::int32_t* where, std::int32_t base, std::int64_t count, float* x) {
  for (std::int64_t ow = 0; ow < count; ++ow) {
    const std::int32_t at = where[ow] - base - 2 * static_cast<std::int32_t>(ow);
    x[2 * ow] = at == 0 ? grad[ow] : 0.0f;
    x[2 * ow + 1] = at == 1 ? grad[ow] : 0.0f;
  }
}

/// Max pooling backward where tiles_input_in_pairs: every input gradient written once (rather than
/// zeroing the plane and scattering into it, two passes over a plane larger than the caches).
/// With `output` (the pooled leaky ReLU output), through the activation's backward of `slope`.
void max_backward_tiled(const char* label, const Box& b, const std::int32_t* argmax, const float* grad_output,
                        const float* output, float slope, float* grad_input) {
  const std::int64_t in_plane = b.in_plane(), out_plane = b.out_plane(), rows = b.in[1] * b.in[2], row = b.in[2];
  // A gradient larger than the caches is written a row at a time in streaming stores.
  const bool stream = host::streams_output(b.planes * in_plane * static_cast<std::int64_t>(sizeof(float)));
  host_for(
      label, b.planes,
      [=](std::int64_t p) {
        float* dx = grad_input + p * in_plane;
        const std::int32_t* where = argmax + p * out_plane;
        std::vector<float> through(output ? static_cast<std::size_t>(b.out[2]) : 0);
        std::vector<float> line(stream ? static_cast<std::size_t>(row) : 0);
        for (std::int64_t od = 0; od < b.out[0]; ++od)
          for (std::int64_t oh = 0; oh < b.out[1]; ++oh) {
            const std::int64_t o = (od * b.out[1] + oh) * b.out[2];
            const float* g = grad_output + b.out_at(p, od, oh);
            if (output) {
              const float* y = output + b.out_at(p, od, oh);
              for (std::int64_t ow = 0; ow < b.out[2]; ++ow)
                through[static_cast<std::size_t>(ow)] = g[ow] * (y[ow] > 0 ? 1.0f : slope);
              g = through.data();
            }
            for (std::int64_t i = 0; i < b.kernel[0]; ++i)
              for (std::int64_t j = 0; j < b.kernel[1]; ++j) {
                const std::int64_t base = (od * b.kernel[0] + i) * rows + (oh * b.kernel[1] + j) * row;
                if (!stream) {
                  max_backward_row_2(g, where + o, static_cast<std::int32_t>(base), b.out[2], dx + base);
                  continue;
                }
                max_backward_row_2(g, where + o, static_cast<std::int32_t>(base), b.out[2], line.data());
                host::stream_copy(dx + base, line.data(), row, true);
              }
          }
        if (stream) host::stream_fence();
      },
      in_plane);
}

class HostPooling final : public PoolingKernels {
 public:
  std::size_t workspace_bytes(const PoolingGeometry& g) override { return pooling_workspace_bytes(g); }

  void forward(const PoolingGeometry& g, const float* input, float* output, void* workspace) override {
    const Box b = pool_box(g);
    const std::int64_t in_plane = b.in_plane(), out_plane = b.out_plane(), rows = b.in[1] * b.in[2], row = b.in[2];
    if (g.mode == PoolingMode::Max && unclipped(b)) {
      auto* argmax = static_cast<std::int32_t*>(workspace);
      const bool two = b.kernel[1] == 2 && b.kernel[2] == 2;
      if (two && b.kernel[0] == 2)
        max_pool_unclipped<2, 2, 2>(b, input, output, argmax);
      else if (two && b.kernel[0] == 1)
        max_pool_unclipped<1, 2, 2>(b, input, output, argmax);
      else
        max_pool_unclipped<0, 0, 0>(b, input, output, argmax);
    } else if (g.mode == PoolingMode::Max) {
      // The position of each maximum (within its plane) is what backward needs.
      auto* argmax = static_cast<std::int32_t*>(workspace);
      host_for(
          "max pool forward", b.planes,
          [=](std::int64_t p) {
            const float* x = input + p * in_plane;
            float* y = output + p * b.out_planes;
            std::int32_t* where = argmax + p * out_plane;
            for_each_window(b, [&](std::int64_t o, std::int64_t at_y, Span d, Span h, Span w) {
              float best = -std::numeric_limits<float>::infinity();
              std::int64_t best_at = d.begin * rows + h.begin * row + w.begin;
              for (std::int64_t i = d.begin; i < d.end; ++i)
                for (std::int64_t j = h.begin; j < h.end; ++j)
                  for (std::int64_t k = w.begin; k < w.end; ++k) {
                    const std::int64_t at = i * rows + j * row + k;
                    if (x[at] > best) {
                      best = x[at];
                      best_at = at;
                    }
                  }
              y[at_y] = best;
              where[o] = static_cast<std::int32_t>(best_at);
            });
          },
          in_plane);
    } else {
      host_for(
          "average pool forward", b.planes,
          [=](std::int64_t p) {
            const float* x = input + p * in_plane;
            float* y = output + p * b.out_planes;
            for_each_window(b, [&](std::int64_t, std::int64_t at_y, Span d, Span h, Span w) {
              float sum = 0.0f;
              for (std::int64_t i = d.begin; i < d.end; ++i)
                for (std::int64_t j = h.begin; j < h.end; ++j)
                  for (std::int64_t k = w.begin; k < w.end; ++k) sum += x[i * rows + j * row + k];
              y[at_y] = sum / static_cast<float>((d.end - d.begin) * (h.end - h.begin) * (w.end - w.begin));
            });
          },
          in_plane);
    }
  }

  void max_backward_through_leaky_relu(const PoolingGeometry& g, const float* grad_output, const void* workspace,
                                       const float* output, float slope, float* grad_input) override {
    const Box b = pool_box(g);
    const std::int64_t in_plane = b.in_plane(), out_plane = b.out_plane();
    const auto* argmax = static_cast<const std::int32_t*>(workspace);
    if (tiles_input_in_pairs(b))
      return max_backward_tiled("max pool backward through leaky relu", b, argmax, grad_output, output, slope,
                                grad_input);
    host_for(
        "max pool backward through leaky relu", b.planes,
        [=](std::int64_t p) {
          float* dx = grad_input + p * in_plane;
          const float* y = output + p * b.out_planes;  // the input at each maximum
          const float* dy = grad_output + p * b.out_planes;
          const std::int32_t* where = argmax + p * out_plane;
          std::fill(dx, dx + in_plane, 0.0f);
          for_each_output(
              b, [&](std::int64_t o, std::int64_t at) { dx[where[o]] += dy[at] * (y[at] > 0 ? 1.0f : slope); });
        },
        in_plane);
  }

  void backward(const PoolingGeometry& g, const float* grad_output, const void* workspace,
                float* grad_input) override {
    const Box b = pool_box(g);
    const std::int64_t in_plane = b.in_plane(), out_plane = b.out_plane(), rows = b.in[1] * b.in[2], row = b.in[2];
    // One plane per iteration: windows may overlap, but never across planes, so the
    // accumulation below has no races however the planes are spread over threads.
    if (g.mode == PoolingMode::Max && tiles_input_in_pairs(b)) {
      max_backward_tiled("max pool backward", b, static_cast<const std::int32_t*>(workspace), grad_output, nullptr,
                         0.0f, grad_input);
    } else if (g.mode == PoolingMode::Max) {
      const auto* argmax = static_cast<const std::int32_t*>(workspace);
      host_for(
          "max pool backward", b.planes,
          [=](std::int64_t p) {
            float* dx = grad_input + p * in_plane;
            const float* dy = grad_output + p * b.out_planes;
            const std::int32_t* where = argmax + p * out_plane;
            std::fill(dx, dx + in_plane, 0.0f);
            for_each_output(b, [&](std::int64_t o, std::int64_t at) { dx[where[o]] += dy[at]; });
          },
          in_plane);
    } else {
      host_for(
          "average pool backward", b.planes,
          [=](std::int64_t p) {
            float* dx = grad_input + p * in_plane;
            const float* dy = grad_output + p * b.out_planes;
            std::fill(dx, dx + in_plane, 0.0f);
            for_each_window(b, [&](std::int64_t, std::int64_t at_y, Span d, Span h, Span w) {
              const float share =
                  dy[at_y] / static_cast<float>((d.end - d.begin) * (h.end - h.begin) * (w.end - w.begin));
              for (std::int64_t i = d.begin; i < d.end; ++i)
                for (std::int64_t j = h.begin; j < h.end; ++j)
                  for (std::int64_t k = w.begin; k < w.end; ++k) dx[i * rows + j * row + k] += share;
            });
          },
          in_plane);
    }
  }
};

}  // namespace

std::unique_ptr<PoolingKernels> make_pooling_kernels(Context&) { return std::make_unique<HostPooling>(); }

}  // namespace tessera::onednn
