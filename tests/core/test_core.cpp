// Core level: the counter-based random numbers (determinism, independence of streams, moments,
// the Random123 known answers for Philox4x32-10), errors (rank prefix, exit codes) and dtypes.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <set>
#include <stdexcept>
#include <string>

#include "tessera/core/device.hpp"
#include "tessera/core/dtype.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/rng.hpp"
#include "tessera/core/signal_mask.hpp"

#include <signal.h>
#include <pthread.h>

#include <thread>

namespace tessera {
namespace {

using Words = std::array<std::uint32_t, 4>;

// Our (seed, stream, index) map onto Philox's key and counter as
//   key = (seed lo, seed hi), counter = (index lo, index hi, stream lo, stream hi).
Words philox_from_raw(std::array<std::uint32_t, 4> counter, std::array<std::uint32_t, 2> key) {
  const std::uint64_t index = (static_cast<std::uint64_t>(counter[1]) << 32) | counter[0];
  const std::uint64_t stream = (static_cast<std::uint64_t>(counter[3]) << 32) | counter[2];
  const std::uint64_t seed = (static_cast<std::uint64_t>(key[1]) << 32) | key[0];
  return philox4x32(seed, stream, index);
}

// Random123's kat_vectors, the three "philox4x32 10" lines: counter (4 words), key (2), expected (4).
TEST(Rng, Philox4x32KnownAnswerZero) {
  EXPECT_EQ(philox4x32(0, 0, 0), (Words{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
}

TEST(Rng, Philox4x32KnownAnswerAllOnes) {
  const std::uint32_t ff = 0xffffffffu;
  EXPECT_EQ(philox_from_raw({ff, ff, ff, ff}, {ff, ff}),
            (Words{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
}

TEST(Rng, Philox4x32KnownAnswerPi) {
  EXPECT_EQ(philox_from_raw({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u}),
            (Words{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

TEST(Rng, SameCounterSameValue) {
  for (std::uint64_t i : {0ull, 1ull, 12345ull, (1ull << 40) + 7}) {
    EXPECT_EQ(philox4x32(42, 7, i), philox4x32(42, 7, i));
    EXPECT_EQ(random_uniform(42, 7, i), random_uniform(42, 7, i));
    EXPECT_EQ(random_normal(42, 7, i), random_normal(42, 7, i));
    EXPECT_EQ(random_u64(42, 7, i), random_u64(42, 7, i));
  }
}

TEST(Rng, SeedsStreamsAndIndicesDiffer) {
  const Words base = philox4x32(42, 7, 100);
  EXPECT_NE(philox4x32(43, 7, 100), base);
  EXPECT_NE(philox4x32(42, 8, 100), base);
  EXPECT_NE(philox4x32(42, 7, 101), base);
  // High halves of each 64-bit input matter too.
  EXPECT_NE(philox4x32(42 + (1ull << 32), 7, 100), base);
  EXPECT_NE(philox4x32(42, 7 + (1ull << 32), 100), base);
  EXPECT_NE(philox4x32(42, 7, 100 + (1ull << 32)), base);
  // No collisions among a few thousand neighbouring counters and streams.
  std::set<std::uint64_t> seen;
  for (std::uint64_t s = 0; s < 4; ++s)
    for (std::uint64_t i = 0; i < 1000; ++i) seen.insert(random_u64(1, s, i));
  EXPECT_EQ(seen.size(), 4000u);
}

TEST(Rng, DerivedValuesComeFromTheWords) {
  const Words w = philox4x32(5, 6, 7);
  EXPECT_EQ(random_u64(5, 6, 7), (static_cast<std::uint64_t>(w[0]) << 32) | w[1]);
  EXPECT_EQ(random_uniform(5, 6, 7), static_cast<float>(w[0] >> 8) / 16777216.0f);
}

TEST(Rng, UniformIsInUnitIntervalWithMeanHalf) {
  constexpr int n = 100000;
  double sum = 0.0, sum_sq = 0.0;
  float lo = 1.0f, hi = 0.0f;
  int below_tenth = 0;
  for (int i = 0; i < n; ++i) {
    const float u = random_uniform(2024, 3, static_cast<std::uint64_t>(i));
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    lo = std::min(lo, u);
    hi = std::max(hi, u);
    sum += u;
    sum_sq += static_cast<double>(u) * u;
    below_tenth += u < 0.1f ? 1 : 0;
  }
  const double mean = sum / n, var = sum_sq / n - mean * mean;
  EXPECT_NEAR(mean, 0.5, 0.005);             // sigma of the mean ~ 0.0009
  EXPECT_NEAR(var, 1.0 / 12.0, 0.002);        // sigma ~ 0.0002
  EXPECT_NEAR(below_tenth / double(n), 0.1, 0.005);
  EXPECT_LT(lo, 0.001f);
  EXPECT_GT(hi, 0.999f);
}

TEST(Rng, NormalHasMeanZeroVarianceOne) {
  constexpr int n = 100000;
  double sum = 0.0, sum_sq = 0.0, sum_4 = 0.0;
  int within_one_sigma = 0;
  for (int i = 0; i < n; ++i) {
    const double x = random_normal(99, 11, static_cast<std::uint64_t>(i));
    ASSERT_TRUE(std::isfinite(x));
    sum += x;
    sum_sq += x * x;
    sum_4 += x * x * x * x;
    within_one_sigma += std::fabs(x) < 1.0 ? 1 : 0;
  }
  const double mean = sum / n, var = sum_sq / n - mean * mean;
  EXPECT_NEAR(mean, 0.0, 0.02);   // sigma ~ 0.003
  EXPECT_NEAR(var, 1.0, 0.03);    // sigma ~ 0.0045
  EXPECT_NEAR(sum_4 / n, 3.0, 0.15);  // kurtosis of a normal
  EXPECT_NEAR(within_one_sigma / double(n), 0.6827, 0.01);
}

TEST(Rng, SubstreamsAreDeterministicAndDistinct) {
  const auto s = rng_substream(RngStream::Dropout, 3, 17);
  EXPECT_EQ(s, rng_substream(RngStream::Dropout, 3, 17));
  EXPECT_NE(s, rng_substream(RngStream::WeightInit, 3, 17));
  EXPECT_NE(s, rng_substream(RngStream::Dropout, 4, 17));
  EXPECT_NE(s, rng_substream(RngStream::Dropout, 3, 18));
  EXPECT_NE(rng_substream(RngStream::Shuffle, 1, 2), rng_substream(RngStream::Shuffle, 2, 1));
  std::set<std::uint64_t> seen;
  for (std::uint64_t a = 0; a < 50; ++a)
    for (std::uint64_t b = 0; b < 50; ++b) seen.insert(rng_substream(RngStream::Data, a, b));
  EXPECT_EQ(seen.size(), 2500u);
}

// Sets the process rank for one test and restores it afterwards (the test main sets the real one).
class ProcessRankScope {
 public:
  explicit ProcessRankScope(int rank) : saved_(process_rank()) { set_process_rank(rank); }
  ~ProcessRankScope() { set_process_rank(saved_); }
  ProcessRankScope(const ProcessRankScope&) = delete;
  ProcessRankScope& operator=(const ProcessRankScope&) = delete;

 private:
  int saved_;
};

int count_of(const std::string& text, const std::string& needle) {
  int n = 0;
  for (auto pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + 1)) ++n;
  return n;
}

TEST(Error, ExitCodes) {
  EXPECT_EQ(exit_code_for(InputError("bad file")), 2);
  EXPECT_EQ(exit_code_for(NumericError("loss is NaN")), 3);
  EXPECT_EQ(exit_code_for(Error("internal")), 1);
  EXPECT_EQ(exit_code_for(std::runtime_error("other")), 1);
  EXPECT_EQ(exit_code_for(std::logic_error("other")), 1);
}

TEST(Error, NoRankPrefixBeforeTheRankIsKnown) {
  ProcessRankScope scope(-1);
  const Error e("something broke");
  EXPECT_STREQ(e.what(), "something broke");
  EXPECT_EQ(e.message(), "something broke");
  EXPECT_EQ(e.rank(), -1);
}

TEST(Error, MessageCarriesTheRankOnce) {
  ProcessRankScope scope(3);
  const InputError e("plan file 'x.yaml': missing 'ranks'");
  EXPECT_EQ(std::string(e.what()), "[rank 3] plan file 'x.yaml': missing 'ranks'");
  EXPECT_EQ(count_of(e.what(), "[rank"), 1);
  EXPECT_EQ(e.message(), "plan file 'x.yaml': missing 'ranks'");
  EXPECT_EQ(e.rank(), 3);
}

TEST(Error, FailHelpersFormatAndPickTheType) {
  ProcessRankScope scope(5);
  try {
    fail_input("layer '{}' has {} inputs", "conv1", 3);
    FAIL() << "fail_input returned";
  } catch (const InputError& e) {
    EXPECT_EQ(e.message(), "layer 'conv1' has 3 inputs");
    EXPECT_EQ(std::string(e.what()), "[rank 5] layer 'conv1' has 3 inputs");
    EXPECT_EQ(exit_code_for(e), 2);
  }
  try {
    fail("internal {}", 1);
    FAIL() << "fail returned";
  } catch (const InputError&) {
    FAIL() << "fail threw an InputError";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "internal 1");
    EXPECT_EQ(exit_code_for(e), 1);
  }
}

TEST(Error, CheckMacroThrowsOnlyWhenFalse) {
  EXPECT_NO_THROW(TESSERA_CHECK(1 + 1 == 2, "never"));
  try {
    TESSERA_CHECK(1 + 1 == 3, "arithmetic is off by {}", 1);
    FAIL() << "TESSERA_CHECK did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "arithmetic is off by 1");
  }
}

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::F32), 4u);
  EXPECT_EQ(dtype_size(DType::F64), 8u);
  EXPECT_EQ(dtype_size(DType::I32), 4u);
  EXPECT_EQ(dtype_size(DType::I64), 8u);
  EXPECT_EQ(dtype_size(DType::U8), 1u);
  EXPECT_EQ(dtype_name(DType::F32), "float32");
  EXPECT_EQ(dtype_name(DType::I64), "int64");
  static_assert(dtype_of<double>() == DType::F64);
  static_assert(dtype_of<std::int64_t>() == DType::I64);
}

TEST(Device, HostAndCuda) {
  EXPECT_TRUE(Device::host().is_host());
  EXPECT_FALSE(Device::cuda(1).is_host());
  EXPECT_EQ(Device::cuda(1).index, 1);
  EXPECT_NE(Device::cuda(0), Device::cuda(1));
  EXPECT_EQ(Device::host(), Device{});
}

TEST(StopSignals, HelperThreadsBlockThemTheMainThreadTakesThem) {
  auto blocked = [] {
    sigset_t now;
    pthread_sigmask(SIG_BLOCK, nullptr, &now);
    return std::array<int, 2>{sigismember(&now, SIGUSR1), sigismember(&now, SIGTERM)};
  };
  const auto before = blocked();
  // A helper thread blocks them in itself only.
  std::array<int, 2> in_helper{};
  std::thread([&] {
    block_stop_signals();
    in_helper = blocked();
  }).join();
  EXPECT_EQ(in_helper, (std::array<int, 2>{1, 1}));
  EXPECT_EQ(blocked(), before);
  // Threads created while they are blocked inherit that; unblocking here leaves them blocked there.
  block_stop_signals();
  std::array<int, 2> inherited{};
  std::thread worker([&] { inherited = blocked(); });
  worker.join();
  unblock_stop_signals();
  EXPECT_EQ(inherited, (std::array<int, 2>{1, 1}));
  EXPECT_EQ(blocked(), (std::array<int, 2>{0, 0}));
}

}  // namespace
}  // namespace tessera
