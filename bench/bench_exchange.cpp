// The exchanges of spatial and hybrid plans on their own: TileExchange's forward (a layer's window
// gathered from its tile and its peers') and reverse (the window's gradient summed into the tiles)
// on the layouts the models here use, with caches warm (the same tensors again and again) and cold
// (a sweep over a buffer larger than the last-level cache before each call, as in a training step,
// where other layers ran in between). Per layout: the elements each rank sends, the window it
// assembles, and the median over calls of the slowest rank's milliseconds (a barrier before each
// call, so that no rank waits for a late peer). Prints a table, and with --json one JSON line per
// row. A benchmark, not a test.
//
//     mpirun -n 2 build/bin/bench_exchange        (and -n 4 --oversubscribe: the 2 x 2 grid too)
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tessera/core/clock.hpp"
#include "tessera/core/error.hpp"
#include "tessera/parallel/mpi_communicator.hpp"
#include "tessera/parallel/tile_exchange.hpp"
#include "tessera/tensor/box.hpp"

namespace {

using tessera::Box;
using tessera::Shape;
using tessera::TileExchange;

/// One layout: the global tensor, every rank's held and needed box, and the transport.
struct Layout {
  std::string name;
  Shape global;
  std::vector<Box> held, needed;
  TileExchange::Transport transport = TileExchange::Transport::PointToPoint;
};

/// Rank r's block of [0, n) in `parts`.
std::pair<std::int64_t, std::int64_t> block(std::int64_t n, int parts, int r) {
  return {tessera::block_begin(n, parts, r), tessera::block_extent(n, parts, r)};
}

/// A halo layout: the spatial dimensions `dims` of `global` split over a row-major grid of
/// `parts`, each rank needing its tile grown by `halo` (padding outside the tensor included).
Layout halo(std::string name, Shape global, const std::vector<int>& dims, const std::vector<int>& parts, int halo,
            int ranks) {
  Layout l{std::move(name), global, {}, {}};
  for (int r = 0; r < ranks; ++r) {
    Box held{std::vector<std::int64_t>(static_cast<std::size_t>(global.rank()), 0), global.dims()};
    int rest = r;
    for (int a = static_cast<int>(dims.size()) - 1; a >= 0; --a) {
      const auto u = static_cast<std::size_t>(a);
      const auto [begin, extent] = block(global[dims[u]], parts[u], rest % parts[u]);
      rest /= parts[u];
      held.begin[static_cast<std::size_t>(dims[u])] = begin;
      held.extent[static_cast<std::size_t>(dims[u])] = extent;
    }
    Box needed = held;
    for (int d = 2; d < global.rank(); ++d) {
      needed.begin[static_cast<std::size_t>(d)] -= halo;
      needed.extent[static_cast<std::size_t>(d)] += 2 * halo;
    }
    l.held.push_back(held);
    l.needed.push_back(needed);
  }
  return l;
}

/// A redistribution: `global` held split along its last dimension, needed split by sample.
Layout to_samples(std::string name, Shape global, int ranks) {
  Layout l{std::move(name), global, {}, {}, TileExchange::Transport::AllToAllV};
  const int last = global.rank() - 1;
  for (int r = 0; r < ranks; ++r) {
    Box held{std::vector<std::int64_t>(static_cast<std::size_t>(global.rank()), 0), global.dims()};
    const auto [begin, extent] = block(global[last], ranks, r);
    held.begin[static_cast<std::size_t>(last)] = begin;
    held.extent[static_cast<std::size_t>(last)] = extent;
    Box needed{std::vector<std::int64_t>(static_cast<std::size_t>(global.rank()), 0), global.dims()};
    const auto [first, samples] = block(global[0], ranks, r);
    needed.begin[0] = first;
    needed.extent[0] = samples;
    l.held.push_back(held);
    l.needed.push_back(needed);
  }
  return l;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  try {
    CLI::App app{"Tessera's halo exchanges and redistributions on their own (TileExchange forward and reverse)"};
    int calls = 40;
    bool json = false;
    std::int64_t sweep_mib = 128;
    app.add_option("--calls", calls, "Timed calls per layout and mode (median of the slowest rank's)");
    app.add_option("--sweep-mib", sweep_mib, "Buffer swept before each cold call, MiB (more than the last-level cache)");
    app.add_flag("--json", json, "Also print one JSON line per row");
    CLI11_PARSE(app, argc, argv);

    auto world = tessera::MpiCommunicator::world();
    const int P = world->size(), me = world->rank();
    std::vector<Layout> layouts;
    layouts.push_back(halo("Fashion-MNIST conv2 input, W split, halo 2", Shape({64, 32, 14, 14}), {3}, {P}, 2, P));
    if (P == 4)
      layouts.push_back(halo("Fashion-MNIST conv2 input, 2 x 2 grid, halo 2", Shape({64, 32, 14, 14}), {2, 3}, {2, 2}, 2, P));
    layouts.push_back(to_samples("Fashion-MNIST pool2 output, W split -> samples", Shape({64, 64, 7, 7}), P));
    layouts.push_back(halo("CosmoFlow 128^3 conv2 input, D split, halo 1", Shape({1, 16, 64, 64, 64}), {2}, {P}, 1, P));
    layouts.push_back(halo("CosmoFlow 128^3 conv3 input, D split, halo 1", Shape({1, 32, 32, 32, 32}), {2}, {P}, 1, P));

    std::vector<float> sweep(static_cast<std::size_t>(sweep_mib) << 18, 1.0f);
    auto evict = [&] {
      for (std::size_t i = 0; i < sweep.size(); i += 16) sweep[i] += 1.0f;
    };
    if (me == 0) {
      std::printf("TileExchange on %d ranks: median of %d calls, the slowest rank's ms (a barrier before each call)\n", P,
                  calls);
      std::printf("%-48s %10s %10s %9s %9s %9s %9s\n", "layout", "sent KiB", "window MiB", "fwd warm", "rev warm",
                  "fwd cold", "rev cold");
    }
    for (const Layout& l : layouts) {
      TileExchange exchange(*world, l.global, l.held, l.needed, l.transport);
      const auto u = static_cast<std::size_t>(me);
      tessera::Tensor held(Shape(l.held[u].extent)), window, gradient, back;
      for (std::int64_t i = 0; i < held.numel(); ++i) held.data()[i] = static_cast<float>(i % 97);
      gradient = tessera::Tensor(Shape(l.needed[u].extent));
      gradient.fill(0.5f);
      double results[4] = {0, 0, 0, 0};  // forward and reverse, warm and cold
      for (int cold = 0; cold < 2; ++cold) {
        std::vector<double> forward, reverse;
        for (int call = -2; call < calls; ++call) {  // two untimed calls first
          if (cold) evict();
          world->barrier();
          auto start = tessera::Clock::now();
          exchange.forward(held, window);
          const double f = world->allreduce_value(tessera::seconds_since(start), tessera::ReduceOp::Max);
          if (cold) evict();
          world->barrier();
          start = tessera::Clock::now();
          exchange.reverse(gradient, back);
          const double r = world->allreduce_value(tessera::seconds_since(start), tessera::ReduceOp::Max);
          if (call >= 0) forward.push_back(f), reverse.push_back(r);
        }
        results[2 * cold] = 1e3 * median(forward);
        results[2 * cold + 1] = 1e3 * median(reverse);
      }
      const double sent_kib = world->allreduce_value(static_cast<double>(exchange.send_elements()) * 4.0 / 1024,
                                                     tessera::ReduceOp::Max);
      const double window_mib = world->allreduce_value(static_cast<double>(l.needed[u].numel()) * 4.0 / (1 << 20),
                                                       tessera::ReduceOp::Max);
      if (me == 0) {
        std::printf("%-48s %10.0f %10.2f %9.3f %9.3f %9.3f %9.3f\n", l.name.c_str(), sent_kib, window_mib, results[0],
                    results[1], results[2], results[3]);
        if (json)
          std::printf(
              "{\"layout\": \"%s\", \"ranks\": %d, \"sent_kib\": %.0f, \"window_mib\": %.2f, \"forward_warm_ms\": %.3f, "
              "\"reverse_warm_ms\": %.3f, \"forward_cold_ms\": %.3f, \"reverse_cold_ms\": %.3f}\n",
              l.name.c_str(), P, sent_kib, window_mib, results[0], results[1], results[2], results[3]);
      }
    }
  } catch (const std::exception& e) {
    // A rank's error ends every rank (its peers may be in a collective).
    std::fprintf(stderr, "bench_exchange: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return 0;
}
