// This CPU's ceilings, against which the training benchmarks' GFLOP/s are read: the fp32 FMA peak
// (a register-only loop of independent fused multiply-adds at the widest vector width the CPU
// has), the triad memory bandwidth, and the rates Tessera's host backend (oneDNN, and its own
// kernels for one-channel convolutions) reaches on a large GEMM and on the convolutions of the
// Fashion-MNIST and CosmoFlow models (forward + backward, the same probes as `tessera calibrate`).
// One process; --threads threads run at once. Prints a table, and with --json one JSON line per
// row. A benchmark, not a test.
#include <immintrin.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "tessera/core/clock.hpp"
#include "tessera/core/error.hpp"
#include "tessera/layers/dnn_backend.hpp"
#include "tessera/layers/runtime.hpp"
#include "tessera/train/kernel_probes.hpp"

namespace {

constexpr int kChains = 12;  // independent accumulators: more than FMA latency x FMA ports

/// Runs `iterations` x kChains FMAs on 16-float vectors; returns a value that depends on them all.
__attribute__((target("avx512f"))) float fma_avx512(std::int64_t iterations) {
  __m512 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_ps(1.0f + 1e-3f * static_cast<float>(j));
  const __m512 m = _mm512_set1_ps(0.9999999f), c = _mm512_set1_ps(1e-7f);
  for (std::int64_t i = 0; i < iterations; ++i)
    for (int j = 0; j < kChains; ++j) acc[j] = _mm512_fmadd_ps(acc[j], m, c);
  alignas(64) float lanes[16];
  float sum = 0;
  for (int j = 0; j < kChains; ++j) {
    _mm512_store_ps(lanes, acc[j]);
    for (float v : lanes) sum += v;
  }
  return sum;
}

/// The same on 8-float vectors.
__attribute__((target("avx2,fma"))) float fma_avx2(std::int64_t iterations) {
  __m256 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm256_set1_ps(1.0f + 1e-3f * static_cast<float>(j));
  const __m256 m = _mm256_set1_ps(0.9999999f), c = _mm256_set1_ps(1e-7f);
  for (std::int64_t i = 0; i < iterations; ++i)
    for (int j = 0; j < kChains; ++j) acc[j] = _mm256_fmadd_ps(acc[j], m, c);
  alignas(32) float lanes[8];
  float sum = 0;
  for (int j = 0; j < kChains; ++j) {
    _mm256_store_ps(lanes, acc[j]);
    for (float v : lanes) sum += v;
  }
  return sum;
}

struct Isa {
  const char* name;
  int lanes;
  float (*kernel)(std::int64_t);
};

Isa widest_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return {"AVX-512", 16, fma_avx512};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return {"AVX2+FMA", 8, fma_avx2};
  tessera::fail("bench_ceilings: this CPU has neither AVX-512 nor AVX2 with FMA");
}

/// FLOP/s of `threads` threads each running the FMA loop at once (the best of `repeats`).
double fma_peak(const Isa& isa, int threads, int repeats) {
  const std::int64_t iterations = 20'000'000;
  double best = 0;
  for (int r = 0; r < repeats + 1; ++r) {
    std::vector<float> sink(static_cast<std::size_t>(threads));
    const auto start = tessera::Clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back([&, t] { sink[static_cast<std::size_t>(t)] = isa.kernel(iterations); });
    for (auto& th : pool) th.join();
    const double seconds = tessera::seconds_since(start);
    if (sink[0] <= 0) tessera::fail("bench_ceilings: the FMA loop computed {}", sink[0]);
    const double flops = 2.0 * kChains * isa.lanes * static_cast<double>(iterations) * threads;
    if (r > 0) best = std::max(best, flops / seconds);  // the first run warms the clocks
  }
  return best;
}

struct Row {
  std::string what;
  double value;
  std::string unit;
  double share = -1;  ///< of the FMA peak at the same thread count; < 0: none
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"This CPU's ceilings: FMA peak, triad bandwidth, oneDNN's GEMM and convolution rates"};
  int threads = 1, repeats = 5;
  std::string json;
  app.add_option("--threads", threads, "threads at once (the FMA loop, the triad, oneDNN's pool)")->check(CLI::Range(1, 1024));
  app.add_option("--repeats", repeats, "timed repeats of each probe (the best or the median is kept)")->check(CLI::Range(1, 1000));
  app.add_option("--json", json, "also write one JSON line per row here");
  CLI11_PARSE(app, argc, argv);
  try {
    tessera::LayersRuntime runtime(threads);
    const Isa isa = widest_isa();
    const double peak = fma_peak(isa, threads, repeats);
    std::vector<Row> rows;
    rows.push_back({fmt::format("FMA peak, fp32 {} x {} thread(s)", isa.name, threads), peak / 1e9, "GFLOP/s", 1.0});
    if (threads > 1) rows.push_back({"FMA peak, fp32, 1 thread", fma_peak(isa, 1, repeats) / 1e9, "GFLOP/s"});
    rows.push_back({"triad bandwidth (3 x 128 MiB arrays)", tessera::measure_triad(threads, 128u << 20, repeats) / 1e9,
                    "GB/s"});

    auto backend = tessera::make_host_backend();
    const tessera::Prober prober{*backend, tessera::Device::host(), repeats};
    std::vector<tessera::FlopsProbe> probes;
    probes.push_back(prober.linear(1024, 1024, 1024));
    probes.push_back(prober.conv(32, 1, 32, {28, 28}, 3));    // Fashion-MNIST conv1, half of batch 64
    probes.push_back(prober.conv(32, 32, 64, {14, 14}, 3));   // conv2
    probes.push_back(prober.conv(2, 1, 16, {64, 64, 64}, 3));  // CosmoFlow 64^3 conv1, half of batch 4
    probes.push_back(prober.conv(2, 16, 32, {32, 32, 32}, 3));
    probes.push_back(prober.conv(2, 32, 64, {16, 16, 16}, 3));
    probes.push_back(prober.conv(2, 64, 64, {8, 8, 8}, 3));
    for (const auto& p : probes) rows.push_back({"host backend fwd+bwd: " + p.what, p.rate() / 1e9, "GFLOP/s", p.rate() / peak});

    std::printf("This CPU's ceilings (%d thread(s); %s)\n", threads, isa.name);
    std::printf("%-62s %10s %-8s %s\n", "what", "value", "unit", "of FMA peak");
    for (const auto& r : rows)
      std::printf("%-62s %10.1f %-8s %s\n", r.what.c_str(), r.value, r.unit.c_str(),
                  r.share < 0 ? "" : fmt::format("{:.0f} %", 100 * r.share).c_str());
    if (!json.empty()) {
      std::ofstream out(json, std::ios::app);
      for (const auto& r : rows)
        out << fmt::format(R"({{"what": "{}", "value": {:.3f}, "unit": "{}", "threads": {}, "isa": "{}"}})", r.what,
                           r.value, r.unit, threads, isa.name)
            << "\n";
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_ceilings: %s\n", e.what());
    return 2;
  }
  return 0;
}
