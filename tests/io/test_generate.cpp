// `generate cosmo`: the file is the same whatever the rank count (generated at the whole world and
// at sub-communicators of other sizes at once), every sample is what the single-sample generator
// makes for its index, the file reads through open_hdf5_dataset as regression data with 4
// targets, and bad options are refused on every rank.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "io_test_util.hpp"
#include "tessera/io/dataset.hpp"
#include "tessera/io/generate.hpp"
#include "tessera/parallel/mpi_communicator.hpp"

namespace tessera {
namespace {

using namespace io_test;

CosmoOptions small_options() {
  return CosmoOptions{.samples = 7, .size = 16, .channels = 2, .seed = 42, .split = DataSplit::Train, .lognormal = true};
}

std::vector<std::int64_t> all_indices(std::int64_t n) {
  std::vector<std::int64_t> indices(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) indices[static_cast<std::size_t>(i)] = i;
  return indices;
}

/// Every sample and target of `path`, read collectively over the world.
std::pair<Tensor, Tensor> read_all(const std::string& path) {
  auto dataset = open_hdf5_dataset(path, *MpiCommunicator::world());
  Tensor inputs, targets;
  dataset->read(all_indices(dataset->info().size), inputs, targets);
  return {std::move(inputs), std::move(targets)};
}

bool equal(const Tensor& a, const Tensor& b) {
  return a.shape().dims() == b.shape().dims() &&
         std::equal(a.data(), a.data() + a.shape().numel(), b.data());
}

TEST(GenerateCosmo, SameFileAtEveryRankCount) {
  SharedTempDir dir;
  auto world = MpiCommunicator::world();
  const auto options = small_options();
  const auto summary = generate_cosmo(dir.file("world.h5"), options, *world);
  EXPECT_EQ(summary.samples, 7);
  EXPECT_EQ(summary.bytes, 7 * 2 * 16 * 16 * 16 * 4 + 2 * 7 * 4 * 4);
  EXPECT_TRUE(std::filesystem::exists(dir.file("world.h5")));
  EXPECT_FALSE(std::filesystem::exists(dir.file("world.h5.tmp")));

  // Rank 0 alone, and the other ranks together (2 at np3), each write their own file at once.
  const int color = world->rank() == 0 ? 0 : 1;
  auto part = world->split(color, world->rank());
  generate_cosmo(dir.file("part" + std::to_string(color) + ".h5"), options, *part);
  MPI_Barrier(MPI_COMM_WORLD);

  const auto [inputs, targets] = read_all(dir.file("world.h5"));
  for (int c = 0; c < std::min(world->size(), 2); ++c) {
    const auto [other_inputs, other_targets] = read_all(dir.file("part" + std::to_string(c) + ".h5"));
    EXPECT_TRUE(equal(inputs, other_inputs)) << "data written by " << (c == 0 ? 1 : world->size() - 1)
                                             << " rank(s) differs from the world's";
    EXPECT_TRUE(equal(targets, other_targets));
  }
}

TEST(GenerateCosmo, EachSampleIsAFunctionOfItsIndex) {
  SharedTempDir dir;
  auto world = MpiCommunicator::world();
  const auto options = small_options();
  generate_cosmo(dir.file("train.h5"), options, *world);
  const auto [inputs, targets] = read_all(dir.file("train.h5"));

  CosmoGenerator generator(options);
  const std::int64_t per_sample = 2 * 16 * 16 * 16;
  std::vector<float> data(static_cast<std::size_t>(per_sample));
  float expected_targets[4];
  double parameters[4];
  const auto ranges = cosmo_parameters(options.size);
  for (std::int64_t i = options.samples - 1; i >= 0; --i) {  // any order
    generator.sample(i, data.data(), expected_targets, parameters);
    EXPECT_TRUE(std::equal(data.begin(), data.end(), inputs.data() + i * per_sample)) << "sample " << i;
    for (int p = 0; p < 4; ++p) {
      EXPECT_EQ(targets.data()[i * 4 + p], expected_targets[p]) << "sample " << i << " target " << p;
      EXPECT_GE(expected_targets[p], -1.0f);
      EXPECT_LE(expected_targets[p], 1.0f);
      const auto& r = ranges[static_cast<std::size_t>(p)];
      EXPECT_GE(parameters[p], r.low);
      EXPECT_LE(parameters[p], r.high);
      EXPECT_NEAR(expected_targets[p], 2 * (parameters[p] - r.low) / (r.high - r.low) - 1, 1e-6);
    }
  }
  for (std::int64_t k = 0; k < inputs.shape().numel(); ++k) ASSERT_TRUE(std::isfinite(inputs.data()[k])) << k;
}

TEST(GenerateCosmo, MoreRanksThanSamples) {
  // At 3 ranks, rank 0 has no sample (blocks [0, 0), [0, 1), [1, 2)) and still joins every write.
  SharedTempDir dir;
  auto options = small_options();
  options.samples = 2;
  generate_cosmo(dir.file("two.h5"), options, *MpiCommunicator::world());
  const auto [inputs, targets] = read_all(dir.file("two.h5"));
  ASSERT_EQ(inputs.shape().dims(), (std::vector<std::int64_t>{2, 2, 16, 16, 16}));
  CosmoGenerator generator(options);
  std::vector<float> data(2 * 16 * 16 * 16);
  float t[4];
  for (std::int64_t i = 0; i < 2; ++i) {
    generator.sample(i, data.data(), t);
    EXPECT_TRUE(std::equal(data.begin(), data.end(), inputs.data() + i * 2 * 16 * 16 * 16)) << "sample " << i;
    EXPECT_TRUE(std::equal(t, t + 4, targets.data() + i * 4)) << "sample " << i;
  }
}

TEST(GenerateCosmo, ReadsAsRegressionDataWithFourTargets) {
  SharedTempDir dir;
  auto world = MpiCommunicator::world();
  generate_cosmo(dir.file("train.h5"), small_options(), *world);
  auto dataset = open_hdf5_dataset(dir.file("train.h5"), *world);
  const auto& info = dataset->info();
  EXPECT_EQ(info.size, 7);
  EXPECT_TRUE(info.has_labels);
  EXPECT_EQ(info.sample_shape.dims(), (std::vector<std::int64_t>{2, 16, 16, 16}));
  EXPECT_EQ(info.sample_shape.kind(0), DimKind::Channel);
  for (int d = 1; d < 4; ++d) EXPECT_EQ(info.sample_shape.kind(d), DimKind::Spatial);
  EXPECT_EQ(info.target_shape.dims(), std::vector<std::int64_t>{4});
  EXPECT_EQ(info.target_shape.kind(0), DimKind::Feature);

  // A spatial box of a few samples (what a spatially parallel input layer reads), per rank.
  const std::vector<std::int64_t> mine{(world->rank() * 3) % 7, 6};
  const Box box{{1, 4, 0, 8}, {1, 8, 16, 8}};
  Tensor inputs, targets;
  dataset->read(mine, box, inputs, targets);
  ASSERT_EQ(inputs.shape().dims(), (std::vector<std::int64_t>{2, 1, 8, 16, 8}));
  CosmoGenerator generator(small_options());
  std::vector<float> sample(2 * 16 * 16 * 16);
  float t[4];
  for (std::size_t r = 0; r < mine.size(); ++r) {
    generator.sample(mine[r], sample.data(), t);
    std::int64_t k = 0, wrong = 0;
    for (std::int64_t z = 4; z < 12; ++z)
      for (std::int64_t y = 0; y < 16; ++y)
        for (std::int64_t x = 8; x < 16; ++x, ++k)
          wrong += inputs.data()[static_cast<std::int64_t>(r) * 8 * 16 * 8 + k] != sample[((16 + z) * 16 + y) * 16 + x];
    EXPECT_EQ(wrong, 0) << "sample " << mine[r];
    for (int p = 0; p < 4; ++p) EXPECT_EQ(targets.data()[r * 4 + p], t[p]);
  }
}

TEST(GenerateCosmo, SplitsSeedsAndTransformChangeWhatTheyShould) {
  const auto train = small_options();
  auto validation = train;
  validation.split = DataSplit::Validation;
  auto reseeded = train;
  reseeded.seed = 43;
  auto gaussian = train;
  gaussian.lognormal = false;
  const std::int64_t per_sample = 2 * 16 * 16 * 16;
  auto make = [&](const CosmoOptions& o) {
    std::vector<float> data(static_cast<std::size_t>(per_sample)), targets(4);
    CosmoGenerator(o).sample(3, data.data(), targets.data());
    return std::pair{data, targets};
  };
  const auto a = make(train), v = make(validation), s = make(reseeded), g = make(gaussian);
  EXPECT_NE(a.first, v.first);
  EXPECT_NE(a.second, v.second);
  EXPECT_NE(a.first, s.first);
  EXPECT_NE(a.second, s.second);
  // Same parameters and realisation; Gaussian: channel 0 (growth 1/2) is half of channel 1 (growth 1).
  EXPECT_EQ(a.second, g.second);
  EXPECT_NE(a.first, g.first);
  for (std::int64_t k = 0; k < per_sample / 2; ++k)
    ASSERT_FLOAT_EQ(g.first[static_cast<std::size_t>(k)], 0.5f * g.first[static_cast<std::size_t>(per_sample / 2 + k)]);
}

TEST(GenerateCosmo, AmplitudeGivesTheVarianceSigmaSquared) {
  // The mean of the spectrum over the modes times A is sigma^2 (the expected variance of g); a
  // flat spectrum (n = 0, no cutoff to speak of) makes A = sigma^2 * S^3 / (S^3 - 1).
  EXPECT_NEAR(cosmo_amplitude(16, 0.5, 0.0, 1e9), 0.25 * 4096.0 / 4095.0, 1e-9);
  // Against the definition, summed over every mode of a 12^3 grid directly.
  const double sigma = 0.8, n = -2.2, cutoff = 2.5;
  double sum = 0;
  for (int i = 0; i < 12; ++i)
    for (int j = 0; j < 12; ++j)
      for (int l = 0; l < 12; ++l) {
        auto wave = [](int m) { return m <= 6 ? m : m - 12; };
        const double k2 = wave(i) * wave(i) + wave(j) * wave(j) + wave(l) * wave(l);
        if (k2 > 0) sum += std::pow(std::sqrt(k2), n) * std::exp(-k2 / (cutoff * cutoff));
      }
  EXPECT_NEAR(cosmo_amplitude(12, sigma, n, cutoff), sigma * sigma / (sum / 1728.0), 1e-9 * sigma * sigma / (sum / 1728.0));
}

TEST(GenerateCosmo, BadOptionsAreRefusedOnEveryRank) {
  SharedTempDir dir;
  auto world = MpiCommunicator::world();
  auto with = [](auto change) {
    auto o = small_options();
    change(o);
    return o;
  };
  expect_input_error([&] { generate_cosmo(dir.file("a.h5"), with([](auto& o) { o.samples = 0; }), *world); },
                     {"samples", "at least 1"});
  expect_input_error([&] { generate_cosmo(dir.file("a.h5"), with([](auto& o) { o.size = 4; }), *world); },
                     {"--size", "between 8 and 1024", "got 4"});
  expect_input_error([&] { generate_cosmo(dir.file("a.h5"), with([](auto& o) { o.channels = 0; }), *world); },
                     {"--channels", "got 0"});
  expect_input_error([&] { generate_cosmo(dir.file("a.h5"), with([](auto& o) { o.channels = 17; }), *world); },
                     {"--channels", "got 17"});
  expect_input_error(
      [&] { generate_cosmo(dir.file("a.h5"), with([](auto& o) { o.size = 1024; o.channels = 2; }), *world); },
      {"8192 MiB", "at most 1024 MiB"});
  std::filesystem::create_directories(dir.file("folder.h5"));
  MPI_Barrier(MPI_COMM_WORLD);
  expect_input_error([&] { generate_cosmo(dir.file("folder.h5"), small_options(), *world); },
                     {"folder.h5", "is a directory"});
}

}  // namespace
}  // namespace tessera
