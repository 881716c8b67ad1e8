// Forward results against direct loops, dropout masks across batch splits, empty batches,
// option parsing, and the errors users see for bad models.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>

#include <fmt/format.h>

#include "layer_test_utils.hpp"
#include "tessera/core/error.hpp"

namespace tessera::testing {
namespace {

/// The convolution by its definition, in double.
Tensor naive_convolution(const Tensor& input, const Tensor& weights, const Tensor* bias, const std::vector<std::int64_t>& stride,
                         const std::vector<std::int64_t>& padding, const std::vector<std::int64_t>& dilation,
                         const Shape& output_shape) {
  Tensor output(output_shape);
  const std::int64_t n_count = input.dim(0), c_count = input.dim(1), f_count = weights.dim(0);
  const std::int64_t ih = input.dim(2), iw = input.dim(3), kh = weights.dim(2), kw = weights.dim(3);
  for (std::int64_t n = 0; n < n_count; ++n)
    for (std::int64_t f = 0; f < f_count; ++f)
      for (std::int64_t oy = 0; oy < output_shape[2]; ++oy)
        for (std::int64_t ox = 0; ox < output_shape[3]; ++ox) {
          double sum = bias ? bias->data()[f] : 0.0;
          for (std::int64_t c = 0; c < c_count; ++c)
            for (std::int64_t ky = 0; ky < kh; ++ky)
              for (std::int64_t kx = 0; kx < kw; ++kx) {
                const std::int64_t y = oy * stride[0] - padding[0] + ky * dilation[0];
                const std::int64_t x = ox * stride[1] - padding[1] + kx * dilation[1];
                if (y < 0 || y >= ih || x < 0 || x >= iw) continue;
                sum += static_cast<double>(input.at({n, c, y, x})) * weights.at({f, c, ky, kx});
              }
          output.at({n, f, oy, ox}) = static_cast<float>(sum);
        }
  return output;
}

TEST(LayerForward, ConvolutionMatchesDirectLoops) {
  for (auto layout : {HostConvolutionLayout::Plain, HostConvolutionLayout::Blocked, HostConvolutionLayout::Automatic}) {
    auto backend = make_host_backend({layout});
    for (std::int64_t channels : {3, 16}) {
      auto layer = make_layer("conv", {{"filters", {"8"}}, {"kernel", {"3", "2"}}, {"stride", {"2", "1"}},
                                       {"padding", {"1", "2"}}, {"dilation", {"2", "1"}}});
      const Tensor input = random_tensor(Shape::image(3, channels, {9, 7}), 40);
      const Shape output_shape = layer->setup({input.shape()});
      layer->init_parameters(1);
      layer->parameters()[1]->value.copy_from(random_tensor(Shape{8}, 41));
      LayerContext context;
      context.backend = backend.get();
      Tensor output;
      const Tensor* inputs[] = {&input};
      layer->forward(inputs, output, context);
      EXPECT_EQ(output.shape().dims(), output_shape.dims());
      EXPECT_EQ(output.shape().kind(1), DimKind::Channel);
      const Tensor expected = naive_convolution(input, layer->parameters()[0]->value, &layer->parameters()[1]->value,
                                                {2, 1}, {1, 2}, {2, 1}, output_shape);
      EXPECT_LT(max_relative_difference(output, expected, 1e-3), 1e-4) << "channels " << channels;
    }
  }
}

TEST(LayerForward, ConvolutionRegionsOfATileEqualTheWholeTile) {
  // What the executor does to overlap a halo exchange: forward over the tile's window, then
  // forward_region over parts of it. Each region must equal the same outputs of the whole tile,
  // in either layout, and leave the other outputs alone.
  for (auto layout : {HostConvolutionLayout::Plain, HostConvolutionLayout::Blocked}) {
    auto backend = make_host_backend({layout});
    for (std::int64_t channels : {2, 9}) {
      auto layer = make_layer("conv", {{"filters", {"5"}}, {"kernel", {"3", "2", "3"}}, {"stride", {"1", "2", "1"}},
                                       {"padding", {"1"}}, {"dilation", {"2", "1", "1"}}});
      layer->setup({Shape::image(2, channels, {12, 12, 9})});
      layer->init_parameters(4);
      layer->parameters()[1]->value.copy_from(random_tensor(Shape{5}, 45));
      // A tile of 6 x 3 x 5 outputs: its window spans (6-1)*1 + 5 = 10, (3-1)*2 + 2 = 6, 5-1+3 = 7.
      SpatialTile tile;
      tile.output_extent = {6, 3, 5};
      tile.window_begin = {0, 0, 0};
      tile.input_global = {12, 12, 9};
      LayerContext context;
      context.backend = backend.get();
      context.tile = &tile;
      const Tensor window = random_tensor(Shape::image(2, channels, {10, 6, 7}), 46);
      const Tensor* inputs[] = {&window};
      Tensor whole;
      layer->forward(inputs, whole, context);
      ASSERT_EQ(whole.shape().dims(), (std::vector<std::int64_t>{2, 5, 6, 3, 5}));
      const std::vector<std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>>> regions = {
          {{0, 0, 0}, {1, 3, 5}}, {{5, 0, 0}, {1, 3, 5}}, {{1, 0, 0}, {4, 1, 5}}, {{1, 2, 4}, {4, 1, 1}}, {{0, 0, 0}, {6, 3, 5}}};
      for (const auto& [begin, extent] : regions) {
        Tensor output = whole.clone();
        // Spoil the region's outputs: forward_region must write all of them.
        for (std::int64_t i = 0; i < output.numel(); ++i) {
          std::int64_t rest = i / 5 / 3 % 6;  // D index of flat i in [2, 5, 6, 3, 5]
          const std::int64_t w = i % 5, h = i / 5 % 3, d = rest;
          const bool inside = d >= begin[0] && d < begin[0] + extent[0] && h >= begin[1] && h < begin[1] + extent[1] &&
                              w >= begin[2] && w < begin[2] + extent[2];
          if (inside) output.data()[i] = 1e6f;
        }
        layer->forward_region(inputs, output, context, begin, extent);
        // Relative to the outputs' scale: the region may sum in another order (a gemm blocked
        // for its shape), so outputs near zero differ by rounding relative to themselves.
        EXPECT_LT(max_relative_difference(output, whole, 1.0), 1e-5)
            << "channels " << channels << ", region at " << begin[0] << "," << begin[1] << "," << begin[2];
      }
    }
  }
}

// A convolution applying the leaky ReLU the executor fused into it (LayerContext::leaky_relu_after)
// computes what the convolution and then the leaky_relu layer compute, to the bit (a zero's
// sign aside), NaNs kept, in each host layout, fp32 and bf16, 2-D and 3-D, with and without a
// bias (relu, slope 0, does not fuse on the host); and the leaky ReLU run in place (its output
// over its input, its input gradient over its output gradient) equals it run apart.
TEST(LayerForward, FusedAndInPlaceLeakyReluEqualTheLayerApart) {
  for (auto layout : {HostConvolutionLayout::Plain, HostConvolutionLayout::Blocked}) {
    auto backend = make_host_backend({layout});
    for (const char* precision : {"fp32", "bf16"})
      for (const char* bias : {"true", "false"})
        for (const Shape& shape : {Shape::image(2, 3, {9, 8}), Shape::image(2, 8, {6, 5, 7})})
          for (float slope : {0.0f, 0.01f, 0.3f}) {
            SCOPED_TRACE(fmt::format("{} {} bias {} slope {} {}", shape.to_string(), precision, bias, slope,
                                     layout == HostConvolutionLayout::Plain ? "plain" : "blocked"));
            auto conv = make_layer("conv", {{"filters", {"16"}}, {"kernel", {"3"}}, {"padding", {"1"}},
                                            {"bias", {bias}}, {"precision", {precision}}});
            auto act = make_layer("leaky_relu", {{"slope", {fmt::format("{}", slope)}}}, 4);
            const Shape out_shape = conv->setup({shape});
            act->setup({out_shape});
            ASSERT_TRUE(act->traits().runs_in_place);
            ASSERT_EQ(act->traits().leaky_relu_slope, slope);
            conv->init_parameters(1);
            if (conv->parameters().size() > 1) conv->parameters()[1]->value.copy_from(random_tensor(Shape{16}, 41));
            Tensor input = random_tensor(shape, 40);
            input.data()[5] = std::numeric_limits<float>::quiet_NaN();  // NaNs go on, as the layer apart lets them
            LayerContext ctx;
            ctx.backend = backend.get();
            const Tensor* inputs[] = {&input};
            Tensor conv_out, apart, fused;
            conv->forward(inputs, conv_out, ctx);
            const Tensor* act_in[] = {&conv_out};
            act->forward(act_in, apart, ctx);
            // oneDNN's relu post-op turns NaNs into 0: only leaky ReLUs with a slope fuse here.
            const bool fuses = conv->traits().fuses_leaky_relu && backend->convolution().fuses_leaky_relu(slope);
            EXPECT_EQ(fuses, slope > 0.0f);
            if (fuses) {
              ctx.leaky_relu_after = slope;
              conv->forward(inputs, fused, ctx);
              ASSERT_EQ(fused.shape().dims(), apart.shape().dims());
              std::int64_t differing = 0, negative = 0, nans = 0;
              for (std::int64_t i = 0; i < fused.numel(); ++i) {
                const float a = apart.data()[i], f = fused.data()[i];
                differing += std::isnan(a) ? !std::isnan(f) : f != a;  // -0 == 0
                negative += conv_out.data()[i] < 0;
                nans += std::isnan(a);
              }
              EXPECT_GT(nans, 0);
              EXPECT_EQ(differing, 0);
              EXPECT_GT(negative, 0) << "the activation would change nothing";
            }

            // In place: the same output, and the same input gradient from the output.
            ctx.leaky_relu_after.reset();
            const Tensor dy = random_tensor(out_shape, 42);
            Tensor dx_apart, shared = conv_out.clone(), dy_shared = dy.clone();
            Tensor* grad_apart[] = {&dx_apart};
            act->backward(act_in, apart, dy, grad_apart, ctx);
            const Tensor* shared_in[] = {&shared};
            act->forward(shared_in, shared, ctx);
            Tensor* grad_shared[] = {&dy_shared};
            act->backward(shared_in, shared, dy_shared, grad_shared, ctx);
            for (std::int64_t i = 0; i < shared.numel(); ++i) {
              ASSERT_EQ(std::isnan(shared.data()[i]), std::isnan(apart.data()[i])) << i;
              if (!std::isnan(apart.data()[i])) {
                ASSERT_EQ(shared.data()[i], apart.data()[i]) << i;
              }
              ASSERT_EQ(std::isnan(dy_shared.data()[i]), std::isnan(dx_apart.data()[i])) << i;
              if (!std::isnan(dx_apart.data()[i])) {
                ASSERT_EQ(dy_shared.data()[i], dx_apart.data()[i]) << i;
              }
            }
          }
  }
  EXPECT_FALSE(make_layer("leaky_relu", {{"slope", {"-0.5"}}})->traits().runs_in_place) << "its output's sign is not its input's";
  EXPECT_FALSE(make_layer("leaky_relu", {{"slope", {"-0.5"}}})->traits().leaky_relu_slope);
  EXPECT_FALSE(make_layer("conv", {{"filters", {"2"}}, {"kernel", {"1"}}})->traits().runs_in_place);
}

// Max pooling whose windows do not overlap, doing the backward of the leaky ReLU before it
// (LayerContext::leaky_relu_before), writes what the pooling's and then the activation's backward
// write, to the bit (a zero's sign aside), 2-D and 3-D, relu and a slope; overlapping windows
// do not fuse.
TEST(LayerForward, MaxPoolingThroughALeakyReluEqualsTheTwoBackwardPasses) {
  auto backend = make_host_backend();
  for (const Shape& shape : {Shape::image(2, 3, {8, 6}), Shape::image(2, 2, {6, 4, 5})})
    for (float slope : {0.0f, 0.05f}) {
      SCOPED_TRACE(fmt::format("{} slope {}", shape.to_string(), slope));
      auto act = make_layer("leaky_relu", {{"slope", {fmt::format("{}", slope)}}});
      auto pool = make_layer("maxpool", {{"kernel", {"2"}}}, 4);
      act->setup({shape});
      const Shape pooled = pool->setup({shape});
      ASSERT_TRUE(pool->traits().fuses_leaky_relu_backward);
      Tensor x = random_tensor(shape, 50);
      for (std::int64_t i = 0; i < x.numel(); ++i) x.data()[i] -= 0.6f;  // windows with no positive value too
      const Tensor dy = random_tensor(pooled, 51);
      LayerContext ctx;
      ctx.backend = backend.get();
      Tensor y, z;
      const Tensor* act_in[] = {&x};
      act->forward(act_in, y, ctx);
      const Tensor* pool_in[] = {&y};
      pool->forward(pool_in, z, ctx);
      Tensor dz_pool, dx_apart, dx_fused;
      Tensor* pool_grad[] = {&dz_pool};
      pool->backward(pool_in, z, dy, pool_grad, ctx);
      Tensor* act_grad[] = {&dx_apart};
      act->backward(act_in, y, dz_pool, act_grad, ctx);
      ctx.leaky_relu_before = slope;
      Tensor* fused_grad[] = {&dx_fused};
      pool->backward(pool_in, z, dy, fused_grad, ctx);
      ASSERT_EQ(dx_fused.shape().dims(), dx_apart.shape().dims());
      std::int64_t differing = 0, scaled = 0;
      for (std::int64_t i = 0; i < dx_apart.numel(); ++i) {
        differing += dx_fused.data()[i] != dx_apart.data()[i];
        scaled += dx_apart.data()[i] != dz_pool.data()[i];
      }
      EXPECT_EQ(differing, 0);
      EXPECT_GT(scaled, 0) << "the activation's backward would change nothing";
    }
  // Windows that overlap in any dimension, and average pooling, do not fuse.
  const auto fuses = [](const std::string& type, const OptionList& options) {
    auto layer = make_layer(type, options);
    layer->setup({Shape::image(1, 2, {9, 9, 9})});
    return layer->traits().fuses_leaky_relu_backward;
  };
  EXPECT_TRUE(fuses("maxpool", {{"kernel", {"2", "2", "3"}}, {"stride", {"2", "3", "3"}}}));
  EXPECT_FALSE(fuses("maxpool", {{"kernel", {"3"}}, {"stride", {"2"}}}));
  EXPECT_FALSE(fuses("maxpool", {{"kernel", {"3"}}, {"stride", {"3", "3", "1"}}}));
  EXPECT_FALSE(fuses("avgpool", {{"kernel", {"2"}}}));
}

TEST(LayerForward, MaxPoolingSendsTiesToTheFirstMaximum) {
  // Values from {0, 1, 2}: most windows hold equal maxima. Every pooling path takes the first
  // maximum in depth, height, width order, so the gradient goes to the same element whatever the
  // path or the tiling: windows that need no clipping (2x2x2 and 2x2 rows, short and of 32 or more
  // outputs, which also take the one-pass backward where the windows tile the input) or need it.
  auto backend = make_host_backend();
  const std::vector<OptionList> pools = {{{"kernel", {"2"}}},
                                         {{"kernel", {"3"}}, {"stride", {"2"}}},
                                         {{"kernel", {"3"}}, {"stride", {"2"}}, {"padding", {"1"}}}};
  const std::vector<std::vector<std::int64_t>> extents = {{6, 7, 8}, {4, 4, 64}, {6, 9}, {6, 64}};
  for (const auto& extent : extents)
    for (const auto& options : pools) {
      auto layer = make_layer("maxpool", options);
      Tensor input(Shape::image(2, 3, extent));
      for (std::int64_t i = 0; i < input.numel(); ++i)
        input.data()[i] = static_cast<float>(random_u64(5, 6, static_cast<std::uint64_t>(i)) % 3);
      const Shape out_shape = layer->setup({input.shape()});
      LayerContext context;
      context.backend = backend.get();
      Tensor output, grad_input;
      const Tensor* inputs[] = {&input};
      layer->forward(inputs, output, context);
      Tensor grad_output(out_shape);
      for (std::int64_t i = 0; i < grad_output.numel(); ++i) grad_output.data()[i] = static_cast<float>(i % 7 + 1);
      Tensor* grads[] = {&grad_input};
      layer->backward(inputs, output, grad_output, grads, context);
      // The reference: scan each window in order, keep the first of the largest (2-D: depth 1).
      const bool three = extent.size() == 3;
      const std::int64_t in[3] = {three ? extent[0] : 1, extent[three ? 1 : 0], extent[three ? 2 : 1]};
      const std::int64_t out[3] = {three ? out_shape[2] : 1, out_shape[three ? 3 : 2], out_shape[three ? 4 : 3]};
      const std::int64_t k = std::stoll(options[0].second[0]);
      const std::int64_t stride = options.size() > 1 ? std::stoll(options[1].second[0]) : k;
      const std::int64_t pad = options.size() > 2 ? std::stoll(options[2].second[0]) : 0;
      Tensor expected(input.shape());
      for (std::int64_t plane = 0; plane < 2 * 3; ++plane)
        for (std::int64_t od = 0; od < out[0]; ++od)
          for (std::int64_t oh = 0; oh < out[1]; ++oh)
            for (std::int64_t ow = 0; ow < out[2]; ++ow) {
              float best = -1;
              std::int64_t at = -1;
              for (std::int64_t i = 0; i < (three ? k : 1); ++i)
                for (std::int64_t j = 0; j < k; ++j)
                  for (std::int64_t l = 0; l < k; ++l) {
                    const std::int64_t d = three ? od * stride - pad + i : 0, h = oh * stride - pad + j,
                                       w = ow * stride - pad + l;
                    if (d < 0 || h < 0 || w < 0 || d >= in[0] || h >= in[1] || w >= in[2]) continue;
                    const std::int64_t index = ((plane * in[0] + d) * in[1] + h) * in[2] + w;
                    if (input.data()[index] > best) {
                      best = input.data()[index];
                      at = index;
                    }
                  }
              const std::int64_t o = ((plane * out[0] + od) * out[1] + oh) * out[2] + ow;
              EXPECT_EQ(output.data()[o], best);
              expected.data()[at] += grad_output.data()[o];
            }
      EXPECT_EQ(max_relative_difference(grad_input, expected, 1.0), 0.0)
          << "kernel " << k << " stride " << stride << " input " << input.shape().to_string();
    }
}

// Pooling into its reader's halo window (LayerContext::output_offset) writes exactly the output
// it writes alone, into the window's part from the offset and nowhere else, and its backward,
// reading the output and its gradient there, writes the same input gradient, to the bit: every
// path (2x2x2 and 2x2 rows short and wide, the one-pass backward, clipped windows, average
// pooling, through a leaky ReLU).
TEST(LayerForward, PoolingIntoAWindowEqualsPoolingAlone) {
  auto backend = make_host_backend();
  const std::vector<std::pair<std::string, OptionList>> pools = {
      {"maxpool", {{"kernel", {"2"}}}},
      {"maxpool", {{"kernel", {"3"}}, {"stride", {"2"}}, {"padding", {"1"}}}},
      {"avgpool", {{"kernel", {"2"}}}},
      {"avgpool", {{"kernel", {"3"}}, {"stride", {"2"}}, {"padding", {"1"}}}}};
  const std::vector<std::vector<std::int64_t>> extents = {{6, 7, 8}, {4, 4, 64}, {6, 9}, {6, 64}};
  constexpr float kOutside = 7.5f;
  for (const auto& extent : extents)
    for (const auto& [type, options] : pools)
      for (bool through : {false, true}) {
        auto layer = make_layer(type, options);
        const Tensor input = random_tensor(Shape::image(2, 3, extent), 60);
        const Shape out_shape = layer->setup({input.shape()});
        if (through && !layer->traits().fuses_leaky_relu_backward) continue;
        SCOPED_TRACE(fmt::format("{} {} of {}{}", type, options[0].second[0], input.shape().to_string(),
                                 through ? " through a leaky ReLU" : ""));
        ASSERT_TRUE(layer->traits().writes_into_window);
        LayerContext context;
        context.backend = backend.get();
        if (through) context.leaky_relu_before = 0.1f;
        const Tensor* inputs[] = {&input};
        Tensor alone, grad_alone;
        layer->forward(inputs, alone, context);
        const Tensor grad_output = random_tensor(out_shape, 61);
        Tensor* grads[] = {&grad_alone};
        layer->backward(inputs, alone, grad_output, grads, context);

        // A window 1 to 3 wider per dimension, the output from offsets 1, 2, 0, ...
        std::vector<std::int64_t> window_dims = {out_shape[0], out_shape[1]};
        context.output_offset.clear();
        for (std::size_t d = 0; d < extent.size(); ++d) {
          context.output_offset.push_back(static_cast<std::int64_t>((d + 1) % 3));
          window_dims.push_back(out_shape[static_cast<int>(d) + 2] + 1 + static_cast<std::int64_t>(d));
        }
        const auto inside = [&](const std::vector<std::int64_t>& index) {
          for (std::size_t d = 0; d < extent.size(); ++d) {
            const std::int64_t at = index[d + 2] - context.output_offset[d];
            if (at < 0 || at >= out_shape[static_cast<int>(d) + 2]) return false;
          }
          return true;
        };
        const auto output_index = [&](std::vector<std::int64_t> index) {
          for (std::size_t d = 0; d < extent.size(); ++d) index[d + 2] -= context.output_offset[d];
          return index;
        };
        const auto each = [&](const auto& body) {
          std::vector<std::int64_t> index(window_dims.size(), 0);
          while (true) {
            body(index);
            std::size_t d = index.size();
            while (d-- > 0 && ++index[d] == window_dims[d]) index[d] = 0;
            if (d == static_cast<std::size_t>(-1)) return;
          }
        };
        Tensor window{Shape(window_dims)}, grad_window{Shape(window_dims)};
        window.fill(kOutside);
        grad_window.fill(kOutside);
        each([&](const std::vector<std::int64_t>& i) {
          if (inside(i)) grad_window.at(i) = grad_output.at(output_index(i));
        });
        layer->forward(inputs, window, context);
        std::int64_t wrong = 0;
        each([&](const std::vector<std::int64_t>& i) {
          wrong += window.at(i) != (inside(i) ? alone.at(output_index(i)) : kOutside);
        });
        EXPECT_EQ(wrong, 0) << "elements of the window other than the output alone's";
        Tensor grad_input;
        Tensor* window_grads[] = {&grad_input};
        layer->backward(inputs, window, grad_window, window_grads, context);
        ASSERT_EQ(grad_input.shape().dims(), grad_alone.shape().dims());
        EXPECT_EQ(max_relative_difference(grad_input, grad_alone, 1.0), 0.0);
      }
}

TEST(LayerForward, HeInitIsBoundedAndDeterministic) {
  auto a = make_layer("conv", {{"filters", {"4"}}, {"kernel", {"3"}}}, 7);
  auto b = make_layer("conv", {{"filters", {"4"}}, {"kernel", {"3"}}}, 7);
  a->setup({Shape::image(1, 2, {5, 5})});
  b->setup({Shape::image(1, 2, {5, 5})});
  a->init_parameters(123);
  b->init_parameters(123);
  const Tensor& w = a->parameters()[0]->value;
  EXPECT_EQ(max_relative_difference(w, b->parameters()[0]->value), 0.0);
  const double bound = std::sqrt(6.0 / 18.0);
  double largest = 0;
  for (std::int64_t i = 0; i < w.numel(); ++i) largest = std::max(largest, std::fabs(static_cast<double>(w.data()[i])));
  EXPECT_LE(largest, bound);
  EXPECT_GT(largest, 0.5 * bound);
  EXPECT_EQ(a->parameters()[1]->value.at({0}), 0.0f);
  EXPECT_FALSE(a->parameters()[1]->decay);
}

TEST(LayerForward, DropoutMaskIsTheSameWhenTheBatchIsSplit) {
  auto layer = make_layer("dropout", {{"rate", {"0.5"}}});
  const Shape shape = Shape::image(4, 2, {3, 3});
  layer->setup({shape});
  const Tensor input = away_from_zero(shape, 50);
  LayerContext context;
  context.seed = 9;
  context.step = 4;
  context.global_batch = 4;
  Tensor whole;
  const Tensor* inputs[] = {&input};
  layer->forward(inputs, whole, context);

  std::int64_t dropped = 0;
  for (std::int64_t i = 0; i < whole.numel(); ++i) {
    const float y = whole.data()[i], x = input.data()[i];
    EXPECT_TRUE(y == 0.0f || y == 2.0f * x);
    dropped += y == 0.0f;
  }
  EXPECT_GT(dropped, whole.numel() / 4);
  EXPECT_LT(dropped, 3 * whole.numel() / 4);
  // The documented key: element i of the batch is kept when the Philox draw for (seed, the
  // dropout stream of layer id and step, i) is at least the rate (the GPU kernel draws the same).
  const std::uint64_t stream = rng_substream(RngStream::Dropout, static_cast<std::uint64_t>(layer->id()), 4);
  for (std::int64_t i = 0; i < whole.numel(); ++i)
    EXPECT_EQ(whole.data()[i] != 0.0f, random_uniform(9, stream, static_cast<std::uint64_t>(i)) >= 0.5f) << i;

  for (std::int64_t split : {1, 2, 3}) {
    for (auto [begin, end] : {std::pair<std::int64_t, std::int64_t>{0, split}, {split, 4}}) {
      const Tensor part = input.slice(begin, end).clone();
      context.sample_offset = begin;
      Tensor output;
      const Tensor* part_inputs[] = {&part};
      layer->forward(part_inputs, output, context);
      EXPECT_EQ(max_relative_difference(output, whole.slice(begin, end).clone()), 0.0) << begin << ".." << end;
    }
  }

  context.sample_offset = 0;
  context.step = 5;  // another step draws another mask
  Tensor other;
  layer->forward(inputs, other, context);
  EXPECT_GT(max_relative_difference(other, whole), 0.0);
  context.training = false;  // identity in evaluation
  layer->forward(inputs, other, context);
  EXPECT_EQ(max_relative_difference(other, input), 0.0);
}

TEST(LayerForward, BatchNormRunningStatisticsAndEvaluation) {
  auto layer = make_layer("batchnorm", {{"momentum", {"0.5"}}});
  const Shape shape = Shape::flat(4, 1);
  layer->setup({shape});
  Tensor input(shape);
  const float values[] = {1, 2, 3, 6};  // mean 3, biased variance 3.5, unbiased 14/3
  std::copy(values, values + 4, input.data());
  LayerContext context;
  Tensor output;
  const Tensor* inputs[] = {&input};
  layer->forward(inputs, output, context);
  EXPECT_NEAR(output.data()[3], 3.0 / std::sqrt(3.5 + 1e-5), 1e-5);
  EXPECT_NEAR(layer->buffers()[0]->data()[0], 1.5, 1e-6);
  EXPECT_NEAR(layer->buffers()[1]->data()[0], 0.5 + 0.5 * 14.0 / 3.0, 1e-5);
  context.training = false;
  layer->forward(inputs, output, context);
  EXPECT_NEAR(output.data()[0], (1 - 1.5) / std::sqrt(0.5 + 7.0 / 3.0 + 1e-5), 1e-5);
}

TEST(LayerForward, EmptyLocalBatchGivesEmptyOutputs) {
  auto backend = make_host_backend();
  const Shape image = Shape::image(2, 3, {6, 6});
  const std::vector<std::pair<std::string, OptionList>> cases = {
      {"conv", {{"filters", {"4"}}, {"kernel", {"3"}}}}, {"maxpool", {{"kernel", {"2"}}}},
      {"avgpool", {{"kernel", {"2"}}}}, {"batchnorm", {}}, {"relu", {}}, {"leaky_relu", {}}, {"flatten", {}},
      {"dropout", {}}};
  for (const auto& [type, options] : cases) {
    auto layer = make_layer(type, options);
    const Shape output_shape = layer->setup({image});
    layer->init_parameters(1);
    const Tensor input(image.with(0, 0));
    LayerContext context;
    context.backend = backend.get();
    context.global_batch = 2;
    Tensor output, grad_input;
    const Tensor* inputs[] = {&input};
    layer->forward(inputs, output, context);
    EXPECT_EQ(output.shape().dims(), output_shape.with(0, 0).dims()) << type;
    Tensor* grads[] = {&grad_input};
    layer->backward(inputs, output, output, grads, context);
    EXPECT_EQ(grad_input.shape().dims(), input.shape().dims()) << type;
    for (Parameter* parameter : layer->parameters())
      for (std::int64_t i = 0; i < parameter->grad.numel(); ++i) EXPECT_EQ(parameter->grad.data()[i], 0.0f) << type;
  }
}

TEST(LayerForward, FashionMnistKernelsAreNotReferenceImplementations) {
  auto backend = make_host_backend();
  const std::vector<std::pair<std::string, OptionList>> network = {
      {"conv", {{"filters", {"32"}}, {"kernel", {"3"}}, {"padding", {"1"}}}}, {"maxpool", {{"kernel", {"2"}}}},
      {"conv", {{"filters", {"64"}}, {"kernel", {"3"}}, {"padding", {"1"}}}}, {"maxpool", {{"kernel", {"2"}}}},
      {"flatten", {}}, {"linear", {{"out", {"128"}}}}, {"linear", {{"out", {"10"}}}}};
  Tensor activation = random_tensor(Shape::image(4, 1, {28, 28}), 60);
  LayerContext context;
  context.backend = backend.get();
  context.global_batch = 4;
  std::vector<std::unique_ptr<Layer>> layers;
  std::vector<Tensor> activations{activation};
  for (const auto& [type, options] : network) {
    layers.push_back(make_layer(type, options));
    layers.back()->setup({activations.back().shape()});
    layers.back()->init_parameters(1);
    Tensor output;
    const Tensor* inputs[] = {&activations.back()};
    layers.back()->forward(inputs, output, context);
    activations.push_back(output);
  }
  for (std::size_t i = layers.size(); i-- > 0;) {
    Tensor grad;
    Tensor* grads[] = {&grad};
    const Tensor* inputs[] = {&activations[i]};
    layers[i]->backward(inputs, activations[i + 1], activations[i + 1], grads, context);
  }
  const auto implementations = backend->implementations();
  EXPECT_GE(implementations.size(), 12u);
  for (const auto& line : implementations) {
    EXPECT_EQ(line.find(": ref"), std::string::npos) << line;
    std::printf("  %s\n", line.c_str());
  }
}

/// The message of the InputError `body` throws ("" when it throws none).
template <typename Body>
std::string input_error(Body body) {
  try {
    body();
  } catch (const InputError& error) {
    return error.message();
  }
  return "";
}

TEST(LayerErrors, MessagesNameTheLayerAndTheProblem) {
  using ::testing::HasSubstr;
  EXPECT_THAT(input_error([] { make_layer("conv", {{"filters", {"4"}}, {"kernel", {"3"}}, {"strid", {"2"}}}); }),
              AllOf(HasSubstr("layer 'test' (conv)"), HasSubstr("unknown parameter 'strid'"), HasSubstr("did you mean 'stride'")));
  EXPECT_THAT(input_error([] { make_layer("conv", {{"filters", {"4"}}, {"kernal", {"3"}}}); }),
              AllOf(HasSubstr("layer 'test' (conv)"), HasSubstr("'kernel' is required"), HasSubstr("'kernal'")));
  EXPECT_THAT(input_error([] { make_layer("conv", {{"filters", {"abc"}}, {"kernel", {"3"}}}); }),
              AllOf(HasSubstr("layer 'test' (conv)"), HasSubstr("'filters' must be an integer, got 'abc'")));
  EXPECT_THAT(input_error([] { make_layer("conv", {{"filters", {"4"}}}); }),
              AllOf(HasSubstr("layer 'test' (conv)"), HasSubstr("'kernel' is required")));
  EXPECT_THAT(input_error([] { make_layer("relu", {{"slope", {"0.1"}}}); }),
              AllOf(HasSubstr("layer 'test' (relu)"), HasSubstr("'slope'")));
  EXPECT_THAT(input_error([] { make_layer("convolution", {}); }),
              AllOf(HasSubstr("'convolution'"), HasSubstr("conv"), HasSubstr("maxpool"), HasSubstr("linear")));
  EXPECT_THAT(input_error([] { make_layer("dropout", {{"rate", {"1.5"}}}); }), HasSubstr("'rate'"));

  // Without a context in the options, create_layer still names the layer.
  LayerOptions bare;
  bare.set("out", "x");
  EXPECT_THAT(input_error([&] { create_layer("linear", "fc9", 1, bare); }),
              AllOf(HasSubstr("layer 'fc9' (linear)"), HasSubstr("'out'")));

  EXPECT_THAT(input_error([] { make_layer("conv", {{"filters", {"4"}}, {"kernel", {"3"}}})->setup({Shape::flat(4, 10)}); }),
              AllOf(HasSubstr("layer 'test' (conv)"), HasSubstr("[4, 10]")));
  EXPECT_THAT(input_error([] {
                make_layer("conv", {{"filters", {"4"}}, {"kernel", {"5"}}})->setup({Shape::image(1, 1, {3, 8})});
              }),
              AllOf(HasSubstr("layer 'test' (conv)"), HasSubstr("larger than the padded input"), HasSubstr("[1, 1, 3, 8]")));
  EXPECT_THAT(input_error([] {
                make_layer("conv", {{"filters", {"4"}}, {"kernel", {"3", "3", "3"}}})->setup({Shape::image(1, 1, {8, 8})});
              }),
              AllOf(HasSubstr("'kernel' has 3 values"), HasSubstr("2 spatial dimensions")));
  EXPECT_THAT(input_error([] {
                make_layer("add", {})->setup({Shape::image(2, 3, {4, 4}), Shape::image(2, 4, {4, 4})});
              }),
              AllOf(HasSubstr("layer 'test' (add)"), HasSubstr("[2, 3, 4, 4] and [2, 4, 4, 4]")));
  EXPECT_THAT(input_error([] { make_layer("concat", {})->setup({Shape::image(2, 3, {4, 4}), Shape::image(2, 4, {4, 5})}); }),
              HasSubstr("layer 'test' (concat)"));
  EXPECT_THAT(input_error([] { make_layer("add", {})->setup({Shape::image(2, 3, {4, 4})}); }),
              HasSubstr("two or more inputs"));
  EXPECT_THAT(input_error([] { make_layer("linear", {{"out", {"3"}}})->setup({Shape::image(2, 3, {4, 4})}); }),
              AllOf(HasSubstr("layer 'test' (linear)"), HasSubstr("flatten")));

  LayerOptions loss_options;
  EXPECT_THAT(input_error([&] { create_loss("hinge", loss_options); }), AllOf(HasSubstr("'hinge'"), HasSubstr("mse")));
}

TEST(LayerOptionsTest, TypedGetters) {
  LayerOptions options("layer 'x' (conv)");
  options.set("a", "12");
  options.set("b", "0.25");
  options.set("c", "yes");
  options.set_list("d", {"1", "2", "3"});
  options.set("e", "7");
  EXPECT_EQ(options.get_int("a"), 12);
  EXPECT_EQ(options.get_int("missing", 5), 5);
  EXPECT_DOUBLE_EQ(options.get_float("b"), 0.25);
  EXPECT_TRUE(options.get_bool("c", false));
  EXPECT_EQ(options.get_ints("d", 3), (std::vector<std::int64_t>{1, 2, 3}));
  EXPECT_EQ(options.get_ints("e", 2), (std::vector<std::int64_t>{7, 7}));
  EXPECT_EQ(options.get_int_list("d", {}), (std::vector<std::int64_t>{1, 2, 3}));
  EXPECT_THROW(options.get_ints("d", 2), InputError);
  EXPECT_THROW(options.get_int("d"), InputError);
  EXPECT_THROW(options.get_int("b"), InputError);
  EXPECT_NO_THROW(options.check_all_used());
  options.set("stride", "1");
  EXPECT_THAT(input_error([&] { options.check_all_used(); }),
              AllOf(::testing::HasSubstr("layer 'x' (conv): unknown parameter 'stride'"), ::testing::HasSubstr("known parameters:")));
}

}  // namespace
}  // namespace tessera::testing
