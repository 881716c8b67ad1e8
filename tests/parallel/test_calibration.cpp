// The measurement library of `tessera calibrate` (parallel/calibration.hpp): the least-squares
// fits and the median on made-up points (every rank alone), and the communication probes in quick
// mode through an MpiCommunicator (at 2 ranks they measure; at 1 they refuse).
//
// Timings are not asserted beyond what cannot be flaky: positive, finite, one point per size.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <vector>

#include "tessera/core/error.hpp"
#include "tessera/parallel/calibration.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/parallel/machine.hpp"
#include "tessera/parallel/mpi_communicator.hpp"

namespace tessera {
namespace {

/// The message sizes of a quick probe: 8 bytes, then x4 up to 1 MiB.
std::vector<double> quick_sizes() {
  std::vector<double> sizes;
  for (double s = 8; s <= 1 << 20; s *= 4) sizes.push_back(s);
  return sizes;
}

std::vector<CommPoint> line_points(double a, double b) {
  std::vector<CommPoint> points;
  for (double n : quick_sizes()) points.push_back({n, a + b * n});
  return points;
}

// ---------------------------------------------------------------------------------------------
// median

TEST(Median, OddCountIsTheMiddleValue) {
  EXPECT_EQ(median({3.0, 1.0, 2.0}), 2.0);
  EXPECT_EQ(median({7.0}), 7.0);
  EXPECT_EQ(median({5.0, -1.0, 9.0, 4.0, 4.5}), 4.5);
}

TEST(Median, EvenCountIsTheMeanOfTheTwoMiddleValues) {
  EXPECT_EQ(median({4.0, 1.0, 3.0, 2.0}), 2.5);
  EXPECT_EQ(median({10.0, 20.0}), 15.0);
}

// ---------------------------------------------------------------------------------------------
// fit_line

TEST(FitLine, RecoversAnExactLine) {
  std::vector<double> x, t;
  for (double n : quick_sizes()) {
    x.push_back(n);
    t.push_back(2e-6 + 1e-10 * n);
  }
  const auto [a, b] = fit_line(x, t);
  EXPECT_NEAR(a, 2e-6, 2e-6 * 1e-9);
  EXPECT_NEAR(b, 1e-10, 1e-10 * 1e-9);
}

TEST(FitLine, RecoversANoisyLineWithinTheNoise) {
  // Relative noise of at most 5 %, alternating in sign.
  const std::vector<double> noise = {0.04, -0.03, 0.05, -0.05, 0.02, -0.04, 0.03, -0.02, 0.05};
  std::vector<double> x, t;
  const auto sizes = quick_sizes();
  ASSERT_EQ(sizes.size(), noise.size());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    x.push_back(sizes[i]);
    t.push_back((2e-6 + 1e-10 * sizes[i]) * (1 + noise[i]));
  }
  const auto [a, b] = fit_line(x, t);
  EXPECT_NEAR(a, 2e-6, 2e-6 * 0.05);
  EXPECT_NEAR(b, 1e-10, 1e-10 * 0.05);
}

TEST(FitLine, OnePointIsAPureLatency) {
  const auto [a, b] = fit_line({100.0}, {3e-6});
  EXPECT_NEAR(a, 3e-6, 3e-6 * 1e-12);
  EXPECT_EQ(b, 1e-15);
}

TEST(FitLine, EqualSizesGiveTheWeightedMeanAndATinySlope) {
  // No slope can be fitted: a = sum(1/t) / sum(1/t^2), the mean under the relative weights.
  const std::vector<double> t = {1e-6, 2e-6, 4e-6};
  const auto [a, b] = fit_line({64.0, 64.0, 64.0}, t);
  double s1 = 0, s2 = 0;
  for (double ti : t) s1 += 1 / ti, s2 += 1 / (ti * ti);
  EXPECT_NEAR(a, s1 / s2, s1 / s2 * 1e-12);
  EXPECT_EQ(b, 1e-15);
}

TEST(FitLine, FallingTimesKeepATinyPositiveSlope) {
  const std::vector<double> x = {8, 64, 512}, t = {4e-6, 3e-6, 2e-6};
  const auto [a, b] = fit_line(x, t);
  double s1 = 0, s2 = 0;
  for (double ti : t) s1 += 1 / ti, s2 += 1 / (ti * ti);
  EXPECT_EQ(b, 1e-15);
  EXPECT_NEAR(a, s1 / s2, s1 / s2 * 1e-12);
}

TEST(FitLine, ANegativeInterceptGivesALineThroughTheOrigin) {
  // t = -1 us + 1 ns/byte at sizes where t > 0: the fitted intercept is negative, so a = 0 and b
  // minimizes the relative errors of t = b x: b = sum(x / t) / sum(x^2 / t^2).
  const std::vector<double> x = {2000, 4000, 8000, 16000};
  std::vector<double> t;
  for (double n : x) t.push_back(-1e-6 + 1e-9 * n);
  const auto [a, b] = fit_line(x, t);
  double s1 = 0, s2 = 0;
  for (std::size_t i = 0; i < x.size(); ++i) s1 += x[i] / t[i], s2 += x[i] * x[i] / (t[i] * t[i]);
  EXPECT_EQ(a, 0.0);
  EXPECT_NEAR(b, s1 / s2, s1 / s2 * 1e-12);
}

TEST(FitLine, RefusesNoPointsAndUnequalLengths) {
  EXPECT_THROW((void)fit_line({}, {}), Error);
  EXPECT_THROW((void)fit_line({8.0, 16.0}, {1e-6}), Error);
}

// ---------------------------------------------------------------------------------------------
// fit_level

TEST(FitLevel, RecoversAlphaAndBetaThroughTheFormulaFactors) {
  // An allreduce over 4 ranks: t = 2 log2(4) alpha + 2 (4 - 1) / 4 beta n.
  const double alpha = 3e-6, beta = 2e-10, alpha_factor = 4, beta_factor = 1.5;
  const AlphaBeta fit = fit_level(line_points(alpha_factor * alpha, beta_factor * beta), alpha_factor, beta_factor);
  EXPECT_NEAR(fit.alpha, alpha, alpha * 1e-9);
  EXPECT_NEAR(fit.beta, beta, beta * 1e-9);
}

TEST(FitLevel, DropsAPointFarOffTheLine) {
  const double alpha = 5e-6, beta = 1e-10;
  std::vector<CommPoint> points = line_points(alpha, beta);
  points.back().seconds *= 5;  // a rank descheduled during the largest size
  // Without dropping it the fit is visibly off; with it dropped the line is exact again.
  std::vector<double> x, t;
  for (const auto& p : points) x.push_back(p.bytes), t.push_back(p.seconds);
  const auto [raw_a, raw_b] = fit_line(x, t);
  EXPECT_GT(std::abs(raw_a / alpha - 1) + std::abs(raw_b / beta - 1), 0.1);
  const AlphaBeta fit = fit_level(points, 1, 1);
  EXPECT_NEAR(fit.alpha, alpha, alpha * 1e-9);
  EXPECT_NEAR(fit.beta, beta, beta * 1e-9);
}

TEST(FitLevel, KeepsEveryPointOfThree) {
  // Three points are too few to tell an outlier: the fit is fit_line's over all three.
  std::vector<CommPoint> points = {{8, 1e-6}, {1024, 2e-6}, {65536, 50e-6}};
  points[1].seconds *= 10;
  const auto [a, b] = fit_line({8, 1024, 65536}, {points[0].seconds, points[1].seconds, points[2].seconds});
  const AlphaBeta fit = fit_level(points, 1, 1);
  EXPECT_EQ(fit.alpha, a);
  EXPECT_EQ(fit.beta, b);
}

// ---------------------------------------------------------------------------------------------
// The probes, through MPI_COMM_WORLD. Every rank runs every test to the end (EXPECTs only).

void expect_positive_finite(const std::vector<CommPoint>& points, const std::vector<double>& bytes) {
  ASSERT_EQ(points.size(), bytes.size());
  for (std::size_t i = 0; i < points.size(); ++i) {
    EXPECT_EQ(points[i].bytes, bytes[i]) << "point " << i;
    EXPECT_TRUE(std::isfinite(points[i].seconds)) << "point " << i;
    EXPECT_GT(points[i].seconds, 0) << "point " << i;
  }
}

TEST(CalibrationProbes, QuickProbesGiveOnePositiveFiniteTimePerSize) {
  auto world = MpiCommunicator::world();
  if (world->size() < 2) {
    // One rank has nobody to exchange with: every probe refuses, on every rank.
    EXPECT_THROW((void)ping_pong(*world, true), Error);
    EXPECT_THROW((void)allreduce_points(*world, true), Error);
    EXPECT_THROW((void)alltoall_points(*world, true), Error);
    return;
  }
  const std::vector<double> sizes = quick_sizes();
  const auto p2p = ping_pong(*world, true);
  if (world->rank() == 0)
    expect_positive_finite(p2p, sizes);
  else
    EXPECT_TRUE(p2p.empty()) << "only rank 0 keeps the ping-pong's points";
  expect_positive_finite(allreduce_points(*world, true), sizes);
  // Each rank sends n bytes in all, n / (p - 1) to each other rank.
  const auto others = static_cast<double>(world->size() - 1);
  std::vector<double> alltoall_sizes;
  for (double n : sizes) alltoall_sizes.push_back(std::max(1.0, std::floor(n / others)) * others);
  const auto alltoall = alltoall_points(*world, true);
  expect_positive_finite(alltoall, alltoall_sizes);
  // The fit of measured points is a usable line.
  const AlphaBeta fit = fit_level(alltoall, others, 1);
  EXPECT_TRUE(std::isfinite(fit.alpha) && std::isfinite(fit.beta));
  EXPECT_GE(fit.alpha, 0);
  EXPECT_GT(fit.beta, 0);
}

TEST(CalibrationProbes, SyncWaitIsFiniteAndTheSameOnEveryRank) {
  auto world = MpiCommunicator::world();
  Machine machine;
  machine.ranks_per_node = machine.cores_per_node = world->size();
  if (world->size() < 2) {
    EXPECT_THROW((void)measure_sync_wait(*world, machine, 1), Error);
    return;
  }
  const SyncWait wait = measure_sync_wait(*world, machine, 1);
  for (double part : {wait.seconds, wait.share}) {
    EXPECT_TRUE(std::isfinite(part));
    EXPECT_GE(part, 0);
    const auto all = world->allgather_value(part);
    for (double w : all) EXPECT_EQ(w, part);
  }
}

TEST(CalibrationProbes, BoxCopiesGiveAPositiveRateTheSameOnEveryRank) {
  auto world = MpiCommunicator::world();
  const BoxCopyRate rate = measure_box_copies(*world, 1, 1 << 20);
  EXPECT_TRUE(std::isfinite(rate.bandwidth));
  EXPECT_GT(rate.bandwidth, 0);
  EXPECT_LT(rate.bandwidth, 1e14) << "a fit that left nothing to the bytes (clamped)";
  EXPECT_TRUE(std::isfinite(rate.run_seconds));
  EXPECT_GE(rate.run_seconds, 0);
  for (double part : {rate.bandwidth, rate.run_seconds})
    for (double w : world->allgather_value(part)) EXPECT_EQ(w, part);
}

TEST(OnRank0Alone, RunsTheWorkOnRank0Only) {
  auto world = MpiCommunicator::world();
  int runs = 0;
  on_rank0_alone(*world, [&] { ++runs; });
  EXPECT_EQ(runs, world->rank() == 0 ? 1 : 0);
  EXPECT_EQ(world->allreduce_value(runs), 1);
}

TEST(OnRank0Alone, AnErrorOnRank0FailsEveryRank) {
  auto world = MpiCommunicator::world();
  EXPECT_THROW(on_rank0_alone(*world, [] { throw std::runtime_error("rank 0 failed"); }), AgreedFailure);
  idle_barrier(*world);  // every rank is still in step
}

}  // namespace
}  // namespace tessera
