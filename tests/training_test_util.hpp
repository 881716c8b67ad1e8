#pragma once
// Shared by the whole-model tests (invariant, checkpoint): a synthetic dataset every rank can
// generate for itself, and a tensor comparison relative to the tensor's scale.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "tessera/core/rng.hpp"
#include "tessera/tensor/box.hpp"
#include "tessera/tensor/tensor.hpp"

namespace tessera::testing {

/// Global batch `step` of a synthetic dataset: inputs uniform in [0, 1) like scaled images,
/// labels uniform in [0, 10).
inline void synthetic_batch(const Shape& sample, std::int64_t batch, std::int64_t step, Tensor& inputs,
                            Tensor& labels) {
  std::vector<std::int64_t> dims{batch};
  dims.insert(dims.end(), sample.dims().begin(), sample.dims().end());
  inputs = Tensor(Shape(dims));
  labels = Tensor(Shape({batch}));
  const auto stream = rng_substream(RngStream::Data, static_cast<std::uint64_t>(step));
  for (std::int64_t i = 0; i < inputs.numel(); ++i)
    inputs.data()[i] = random_uniform(99, stream, static_cast<std::uint64_t>(i));
  for (std::int64_t n = 0; n < batch; ++n)
    labels.data()[n] = static_cast<float>(random_u64(99, stream + 1, static_cast<std::uint64_t>(n)) % 10);
}

/// max |a - b| / max |a| over a tensor: relative to the tensor's scale, so that entries near
/// zero do not turn rounding noise into a large relative error.
inline double relative_error(const Tensor& a, const Tensor& b) {
  double diff = 0, scale = 1e-30;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a.data()[i]) - b.data()[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(a.data()[i])));
  }
  return diff / scale;
}

/// The part of a global batch a rank reads: samples [begin, end) restricted to `box` (over C, (D), H, W).
inline Tensor local_tile(const Tensor& global, std::int64_t begin, std::int64_t end, const Box& box) {
  std::vector<std::int64_t> dims{end - begin};
  dims.insert(dims.end(), box.extent.begin(), box.extent.end());
  Tensor tile{Shape(dims)};
  const int rank = global.rank();
  std::vector<std::int64_t> index(static_cast<std::size_t>(rank), 0), source(static_cast<std::size_t>(rank));
  for (std::int64_t i = 0; i < tile.numel(); ++i) {
    std::int64_t rest = i;
    for (int d = rank; d-- > 0;) {
      index[static_cast<std::size_t>(d)] = rest % dims[static_cast<std::size_t>(d)];
      rest /= dims[static_cast<std::size_t>(d)];
    }
    source[0] = begin + index[0];
    for (int d = 1; d < rank; ++d)
      source[static_cast<std::size_t>(d)] = box.begin[static_cast<std::size_t>(d - 1)] + index[static_cast<std::size_t>(d)];
    tile.data()[i] = global.at(source);
  }
  return tile;
}

}  // namespace tessera::testing
