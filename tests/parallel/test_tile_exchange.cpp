// TileExchange at 1-4 ranks: halo exchange (faces, edges, corners, asymmetric windows, padding
// outside the tensor), redistribution (D-split to H-split, spatial to sample split), replication
// (needed and held), and the reverse (adjoint) against a serial reference, with both transports.
//
// Each rank builds the same global tensor (its value encodes the global index) and takes its held
// tile; forward must return exactly the needed slice (fill outside). Reverse must equal, bit for bit,
// the serial sum of every rank's needed-gradient into the global tensor: in ascending rank order
// onto an accumulated gradient, the holder's own first when overwriting.
// Every rank runs every test and no test returns before its last collective.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tessera/core/error.hpp"
#include "tessera/parallel/mpi_communicator.hpp"
#include "tessera/parallel/tile_exchange.hpp"
#include "tessera/tensor/box.hpp"
#include "tessera/tensor/box_ops.hpp"
#include "tessera/tensor/tensor.hpp"

namespace tessera {
namespace {

using Transport = TileExchange::Transport;
constexpr Transport kTransports[] = {Transport::PointToPoint, Transport::AllToAllV};

std::shared_ptr<MpiCommunicator> world() {
  return MpiCommunicator::world();
}

const char* name(Transport t) {
  return t == Transport::PointToPoint ? "point-to-point" : "alltoallv";
}

std::string box_text(const Box& box) {
  std::string out = "[";
  for (std::size_t d = 0; d < box.begin.size(); ++d)
    out += fmt::format("{}{}:{}", d ? ", " : "", box.begin[d], box.begin[d] + box.extent[d]);
  return out + ")";
}

/// Calls fn(index) for every multi-index of `extent`, row-major.
void for_each_index(const std::vector<std::int64_t>& extent,
                    const std::function<void(const std::vector<std::int64_t>&)>& fn) {
  for (auto e : extent)
    if (e == 0) return;
  std::vector<std::int64_t> index(extent.size(), 0);
  while (true) {
    fn(index);
    int d = static_cast<int>(extent.size()) - 1;
    for (; d >= 0; --d) {
      const auto i = static_cast<std::size_t>(d);
      if (++index[i] < extent[i]) break;
      index[i] = 0;
    }
    if (d < 0) return;
  }
}

bool in_shape(const std::vector<std::int64_t>& index, const Shape& shape) {
  for (int d = 0; d < shape.rank(); ++d)
    if (index[static_cast<std::size_t>(d)] < 0 || index[static_cast<std::size_t>(d)] >= shape[d]) return false;
  return true;
}

/// The global tensor: element i (row-major flat index) is i + 1, so 0 is never a real value.
Tensor indexed(const Shape& shape) {
  Tensor t(shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data()[i] = static_cast<float>(i + 1);
  return t;
}

/// The slice of `global` over `box`, `fill` where the box leaves the tensor.
Tensor slice_of(const Tensor& global, const Box& box, float fill) {
  Tensor out(Shape(box.extent));
  std::int64_t k = 0;
  for_each_index(box.extent, [&](const std::vector<std::int64_t>& local) {
    std::vector<std::int64_t> index = local;
    for (std::size_t d = 0; d < index.size(); ++d) index[d] += box.begin[d];
    out.data()[k++] = in_shape(index, global.shape()) ? global.at(index) : fill;
  });
  return out;
}

/// Rank q's gradient over its needed box: non-round values, so a change of summation order shows.
Tensor gradient_of(int q, const Box& box) {
  Tensor g(Shape(box.extent));
  for (std::int64_t k = 0; k < g.numel(); ++k)
    g.data()[k] = static_cast<float>(std::sin(0.37 * static_cast<double>(k + 1) + 1.7 * q) * (q + 1));
  return g;
}

/// Box of dims [0, n) with `dims` block-split over a row-major grid of extents `parts`, for rank r.
Box tile(const Shape& global, int r, const std::vector<int>& dims, const std::vector<int>& parts) {
  Box box{std::vector<std::int64_t>(static_cast<std::size_t>(global.rank()), 0), global.dims()};
  for (int a = static_cast<int>(dims.size()) - 1; a >= 0; --a) {
    const int p = parts[static_cast<std::size_t>(a)];
    const int c = r % p;
    r /= p;
    const auto d = static_cast<std::size_t>(dims[static_cast<std::size_t>(a)]);
    box.begin[d] = block_begin(global[static_cast<int>(d)], p, c);
    box.extent[d] = block_extent(global[static_cast<int>(d)], p, c);
  }
  return box;
}

std::vector<Box> tiles(const Shape& global, int ranks, const std::vector<int>& dims, const std::vector<int>& parts) {
  std::vector<Box> out;
  for (int r = 0; r < ranks; ++r) out.push_back(tile(global, r, dims, parts));
  return out;
}

/// Every box grown by `low` below and `high` above in dimension `dim`.
std::vector<Box> grown(std::vector<Box> boxes, int dim, std::int64_t low, std::int64_t high) {
  for (auto& box : boxes) {
    box.begin[static_cast<std::size_t>(dim)] -= low;
    box.extent[static_cast<std::size_t>(dim)] += low + high;
  }
  return boxes;
}

/// A grid of `ranks` over two dimensions: 2 x 2 at 4 ranks, ranks x 1 otherwise.
std::vector<int> grid2(int ranks) {
  return ranks == 4 ? std::vector<int>{2, 2} : std::vector<int>{ranks, 1};
}

/// Number of elements that differ (exact comparison), reporting the first one.
void expect_same(const Tensor& got, const Tensor& want, const std::string& context) {
  ASSERT_EQ(got.shape().dims(), want.shape().dims()) << context;
  std::int64_t wrong = 0, first = -1;
  for (std::int64_t i = 0; i < want.numel(); ++i)
    if (!(got.data()[i] == want.data()[i])) {
      if (first < 0) first = i;
      ++wrong;
    }
  EXPECT_EQ(wrong, 0) << context << ": first difference at flat index " << first << ": got "
                      << (first >= 0 ? got.data()[first] : 0.0f) << ", want "
                      << (first >= 0 ? want.data()[first] : 0.0f);
}

struct Layout {
  Shape global;
  std::vector<Box> held, needed;
};

std::string describe(const Layout& l, int me) {
  return fmt::format("global {}, rank {} holds {} needs {}", l.global.to_string(), me,
                     box_text(l.held[static_cast<std::size_t>(me)]), box_text(l.needed[static_cast<std::size_t>(me)]));
}

/// Forward with one transport; returns the result after checking it against the global slice.
Tensor check_forward(const Layout& l, Transport transport, float fill) {
  auto comm = world();
  const int me = comm->rank();
  TileExchange exchange(*comm, l.global, l.held, l.needed, transport);
  const Tensor global = indexed(l.global);
  const Tensor held = slice_of(global, l.held[static_cast<std::size_t>(me)], 0.0f);
  Tensor out;
  exchange.forward(held, out, fill);
  // Every element one rank sends, another receives.
  EXPECT_EQ(comm->allreduce_value(exchange.send_elements()), comm->allreduce_value(exchange.recv_elements()));
  expect_same(out, slice_of(global, l.needed[static_cast<std::size_t>(me)], fill),
              fmt::format("forward ({}, fill {}): {}", name(transport), fill, describe(l, me)));
  return out;
}

/// The serial reference of reverse: `base` plus every rank's gradient summed in ascending rank
/// order, or (`holder_first`, overwriting onto zero) each element's holder's own contribution first,
/// then the others in ascending rank order.
Tensor reverse_reference(const Layout& l, const Tensor& base, bool holder_first = false) {
  Tensor sum = base.clone();
  auto inside = [](const std::vector<std::int64_t>& index, const Box& box) {
    for (std::size_t d = 0; d < index.size(); ++d)
      if (index[d] < box.begin[d] || index[d] >= box.begin[d] + box.extent[d]) return false;
    return true;
  };
  // Pass 0 (holder_first only): each rank's contribution to what it holds; pass 1: the rest.
  for (int pass = holder_first ? 0 : 1; pass < 2; ++pass) {
    for (std::size_t q = 0; q < l.needed.size(); ++q) {
      const Box& box = l.needed[q];
      const Tensor g = gradient_of(static_cast<int>(q), box);
      std::int64_t k = 0;
      for_each_index(box.extent, [&](const std::vector<std::int64_t>& local) {
        std::vector<std::int64_t> index = local;
        for (std::size_t d = 0; d < index.size(); ++d) index[d] += box.begin[d];
        const float v = g.data()[k++];
        const bool own = holder_first && inside(index, l.held[q]);
        if (in_shape(index, sum.shape()) && own == (pass == 0)) sum.at(index) += v;
      });
    }
  }
  return sum;
}

/// Reverse with one transport, overwriting and accumulating; returns the overwritten result.
Tensor check_reverse(const Layout& l, Transport transport) {
  auto comm = world();
  const int me = comm->rank();
  const Box& mine = l.held[static_cast<std::size_t>(me)];
  TileExchange exchange(*comm, l.global, l.held, l.needed, transport, /*tag=*/3);
  const Tensor grad = gradient_of(me, l.needed[static_cast<std::size_t>(me)]);
  const std::string context = fmt::format("reverse ({}): {}", name(transport), describe(l, me));

  Tensor out(Shape({2}));  // wrong shape and stale values: overwritten
  out.fill(123.0f);
  exchange.reverse(grad, out);
  expect_same(out, slice_of(reverse_reference(l, Tensor(l.global), /*holder_first=*/true), mine, 0.0f), context);

  // accumulate = true adds onto what is there.
  Tensor initial = indexed(l.global);
  for (std::int64_t i = 0; i < initial.numel(); ++i) initial.data()[i] *= 0.001f;
  Tensor accumulated = slice_of(initial, mine, 0.0f);
  exchange.reverse(grad, accumulated, /*accumulate=*/true);
  expect_same(accumulated, slice_of(reverse_reference(l, initial), mine, 0.0f), context + ", accumulate");
  return out;
}

/// Where this rank's needed box holds its held box: forward in place (the window holding the held
/// tile, stale values elsewhere) gives `forwarded`, and reverse in place leaves `reversed` at the
/// held box, the rest of the window untouched, to the bit; elsewhere both are refused.
void check_in_place(const Layout& l, Transport transport, float fill, const Tensor& forwarded, const Tensor& reversed,
                    bool with_reverse) {
  auto comm = world();
  const int me = comm->rank();
  const Box& mine = l.held[static_cast<std::size_t>(me)];
  const Box& need = l.needed[static_cast<std::size_t>(me)];
  TileExchange exchange(*comm, l.global, l.held, l.needed, transport, /*tag=*/5);
  const std::string context = fmt::format("in place ({}): {}", name(transport), describe(l, me));
  // Every rank learns whether any rank cannot: the exchanges run on all ranks or none.
  const bool all_hold = comm->allreduce_value(exchange.holds_own_tile() ? 0 : 1) == 0;
  Tensor window{Shape(need.extent)};
  if (!all_hold) {
    if (!exchange.holds_own_tile()) {
      EXPECT_THROW(exchange.start_forward_in_place(window, fill), Error) << context;
      EXPECT_THROW(exchange.start_reverse_in_place(window), Error) << context;
    }
    return;
  }
  window.fill(31.0f);  // stale
  Box local = mine;  // the held tile at its place in the window
  for (std::size_t d = 0; d < local.begin.size(); ++d) local.begin[d] -= need.begin[d];
  const Tensor held = slice_of(indexed(l.global), mine, 0.0f);
  copy_box(mine, held.data(), mine, window.data(), need, Device::host());
  Box window_box;  // the window in its own coordinates
  window_box.begin.assign(need.extent.size(), 0);
  window_box.extent = need.extent;
  exchange.start_forward_in_place(window, fill);
  exchange.finish_forward();
  expect_same(window, forwarded, context + ", forward");
  if (!with_reverse) return;
  Tensor grads = gradient_of(me, need);
  const Tensor before = grads.clone();
  exchange.start_reverse_in_place(grads);
  exchange.finish_reverse();
  expect_same(slice_of(grads, local, 0.0f), reversed, context + ", reverse");
  // Outside the held box the window's gradient is as it was.
  Tensor restored = grads.clone();
  copy_box(local, before.data(), window_box, restored.data(), window_box, Device::host());
  expect_same(restored, before, context + ", reverse outside the held box");
}

/// Forward (fill 0 and a visible fill) and, when `with_reverse`, reverse with both transports; both
/// transports must agree bit for bit, and with them the exchanges in place where they apply.
void check_layout(const Layout& l, bool with_reverse = true) {
  const int me = world()->rank();
  std::vector<Tensor> forwarded;
  for (float fill : {0.0f, -7.5f}) {
    const Tensor a = check_forward(l, Transport::PointToPoint, fill);
    const Tensor b = check_forward(l, Transport::AllToAllV, fill);
    expect_same(a, b, "forward, transports differ: " + describe(l, me));
    forwarded.push_back(a);
  }
  Tensor reversed;
  if (with_reverse) {
    const Tensor a = check_reverse(l, Transport::PointToPoint);
    const Tensor b = check_reverse(l, Transport::AllToAllV);
    expect_same(a, b, "reverse, transports differ: " + describe(l, me));
    reversed = a;
  }
  for (Transport transport : {Transport::PointToPoint, Transport::AllToAllV})
    check_in_place(l, transport, -7.5f, forwarded[1], reversed, with_reverse);
}

const Shape kImage5 = Shape::image(3, 2, {7, 5, 6});  // N x C x D x H x W
constexpr int kD = 2, kH = 3, kW = 4;

// ---------------------------------------------------------------------------------------------
// Halo exchange

TEST(TileExchange, IdentitySendsNothing) {
  auto comm = world();
  const int p = comm->size();
  const auto held = tiles(kImage5, p, {kD}, {p});
  for (Transport t : kTransports) {
    TileExchange exchange(*comm, kImage5, held, held, t);
    EXPECT_TRUE(exchange.is_identity());
    EXPECT_FALSE(exchange.has_replicas());
    EXPECT_EQ(exchange.send_elements(), 0);
    EXPECT_EQ(exchange.recv_elements(), 0);
    EXPECT_EQ(exchange.peers(), 0);
  }
  check_layout({kImage5, held, held});
  // Not the identity as soon as one rank needs more.
  TileExchange halo(*comm, kImage5, held, grown(held, kD, 1, 1));
  EXPECT_FALSE(halo.is_identity());
}

TEST(TileExchange, HaloAlongD) {
  auto comm = world();
  const int p = comm->size(), me = comm->rank();
  const auto held = tiles(kImage5, p, {kD}, {p});
  for (int halo : {1, 2}) {
    SCOPED_TRACE(fmt::format("halo {}", halo));
    check_layout({kImage5, held, grown(held, kD, halo, halo)});
  }
  // Halo 1: one plane (N x C x H x W = 180 elements) from each neighbour; blocks are >= 1 plane.
  TileExchange exchange(*comm, kImage5, held, grown(held, kD, 1, 1));
  const int neighbours = (me > 0) + (me < p - 1);
  EXPECT_EQ(exchange.peers(), neighbours);
  EXPECT_EQ(exchange.recv_elements(), 180 * neighbours);
  EXPECT_EQ(exchange.send_elements(), 180 * neighbours);
  std::vector<int> expected_peers;
  if (me > 0) expected_peers.push_back(me - 1);
  if (me < p - 1) expected_peers.push_back(me + 1);
  EXPECT_EQ(exchange.peer_ranks(), expected_peers);

  // finish_pending ends whichever direction is in flight (what the executor calls when a layer
  // throws between start and finish), with the same result as finish; nothing pending: nothing.
  const Box& mine = held[static_cast<std::size_t>(me)];
  const Box& need = exchange.needed_box();
  const Tensor whole = indexed(kImage5);
  const Tensor tile = slice_of(whole, mine, 0.0f);
  Tensor window, reference;
  exchange.finish_pending();
  exchange.start_forward(tile, window);
  exchange.finish_pending();
  exchange.forward(tile, reference);
  expect_same(window, reference, "finish_pending after start_forward");
  expect_same(window, slice_of(whole, need, 0.0f), "finish_pending after start_forward, against the tensor");
  Tensor back, back_reference;
  exchange.start_reverse(window, back);
  exchange.finish_pending();
  exchange.reverse(window, back_reference);
  expect_same(back, back_reference, "finish_pending after start_reverse");
  exchange.finish_pending();
}

TEST(TileExchange, TensorsElsewhereThanTheExchangeAreRefused) {
  // An exchange working on a GPU given host tensors (or the reverse's accumulated output) says so
  // instead of handing host pointers to GPU kernels; nothing is left in flight.
  auto comm = world();
  const int p = comm->size();
  const auto held = tiles(kImage5, p, {kD}, {p});
  TileExchange exchange(*comm, kImage5, held, grown(held, kD, 1, 1));
  exchange.set_device(Device::cuda(0));
  const Tensor tile = slice_of(indexed(kImage5), held[static_cast<std::size_t>(comm->rank())], 0.0f);
  Tensor window;
  try {
    exchange.start_forward(tile, window);
    ADD_FAILURE() << "a host tile went into a GPU exchange";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("forward's held_in is on host"), std::string::npos) << e.what();
  }
  exchange.set_device(Device::host());
  exchange.forward(tile, window);  // the exchange is still usable
  EXPECT_EQ(window.device(), Device::host());
}

TEST(TileExchange, HaloAlongH) {
  const int p = world()->size();
  const auto held = tiles(kImage5, p, {kH}, {p});  // 5 rows: uneven blocks at 2, 3 and 4 ranks
  for (int halo : {1, 2}) {
    SCOPED_TRACE(fmt::format("halo {}", halo));
    check_layout({kImage5, held, grown(held, kH, halo, halo)});
  }
}

TEST(TileExchange, HaloOverTwoDimensionsWithCorners) {
  auto comm = world();
  const int p = comm->size();
  const auto held = tiles(kImage5, p, {kD, kH}, grid2(p));
  for (int halo : {1, 2}) {
    SCOPED_TRACE(fmt::format("halo {}", halo));
    check_layout({kImage5, held, grown(grown(held, kD, halo, halo), kH, halo, halo)});
  }
  // On a 2 x 2 grid every rank touches the three others: two faces and one corner.
  TileExchange exchange(*comm, kImage5, held, grown(grown(held, kD, 1, 1), kH, 1, 1));
  if (p == 4) {
    EXPECT_EQ(exchange.peers(), 3);
  }
}

TEST(TileExchange, AsymmetricHalos) {
  const int p = world()->size();
  const auto held = tiles(kImage5, p, {kD, kW}, grid2(p));
  // A strided convolution's window: one row before, two after; or only after.
  check_layout({kImage5, held, grown(held, kD, 1, 2)});
  check_layout({kImage5, held, grown(held, kD, 0, 1)});
  check_layout({kImage5, held, grown(grown(held, kD, 2, 0), kW, 0, 3)});
  // A window wider than the whole tensor.
  check_layout({kImage5, held, grown(held, kW, 7, 8)});
}

TEST(TileExchange, TwoDimensionalImages) {
  const Shape image = Shape::image(4, 3, {9, 8});  // N x C x H x W
  const int p = world()->size();
  const auto held = tiles(image, p, {2, 3}, grid2(p));
  check_layout({image, held, grown(grown(held, 2, 1, 1), 3, 1, 1)});
  check_layout({image, held, grown(grown(held, 2, 0, 2), 3, 3, 0)});
}

TEST(TileExchange, OneAndSixDimensions) {
  const int p = world()->size();
  const Shape line({11});
  const auto held1 = tiles(line, p, {0}, {p});
  check_layout({line, held1, grown(held1, 0, 2, 1)});
  const Shape six({2, 3, 2, 3, 2, 4});
  const auto held6 = tiles(six, p, {1, 5}, grid2(p));
  check_layout({six, held6, grown(grown(held6, 1, 1, 1), 5, 1, 2)});
}

// ---------------------------------------------------------------------------------------------
// Redistribution and replication

TEST(TileExchange, RedistributeDToH) {
  const int p = world()->size();
  check_layout({kImage5, tiles(kImage5, p, {kD}, {p}), tiles(kImage5, p, {kH}, {p})});
  check_layout({kImage5, tiles(kImage5, p, {kH}, {p}), tiles(kImage5, p, {kD, kW}, grid2(p))});
}

TEST(TileExchange, RedistributeSpatialToSamples) {
  // 3 samples: at 4 ranks one rank needs (and, the other way round, holds) no sample at all.
  const int p = world()->size();
  const auto spatial = tiles(kImage5, p, {kD, kH}, grid2(p));
  const auto samples = tiles(kImage5, p, {0}, {p});
  check_layout({kImage5, spatial, samples});
  check_layout({kImage5, samples, spatial});
  check_layout({kImage5, samples, grown(spatial, kD, 1, 1)});
}

TEST(TileExchange, EveryRankNeedsEverything) {
  auto comm = world();
  const int p = comm->size();
  const auto held = tiles(kImage5, p, {kD}, {p});
  const std::vector<Box> all(static_cast<std::size_t>(p), tile(kImage5, 0, {}, {}));  // the whole tensor
  check_layout({kImage5, held, all});
  TileExchange exchange(*comm, kImage5, held, all, Transport::AllToAllV);
  EXPECT_EQ(exchange.peers(), p - 1);
  EXPECT_EQ(exchange.recv_elements(), kImage5.numel() - held[static_cast<std::size_t>(comm->rank())].numel());
}

TEST(TileExchange, ReplicatedHeldBoxes) {
  auto comm = world();
  const int p = comm->size(), me = comm->rank();
  // Two replica groups (ranks of equal parity) hold the two halves of D; one group at 1 rank.
  const int halves = std::min(p, 2);
  std::vector<Box> held;
  for (int r = 0; r < p; ++r) held.push_back(tile(kImage5, r % halves, {kD}, {halves}));
  for (const auto& needed : {tiles(kImage5, p, {kH}, {p}), grown(tiles(kImage5, p, {kD}, {p}), kD, 1, 2),
                             std::vector<Box>(static_cast<std::size_t>(p), tile(kImage5, 0, {}, {}))}) {
    const Layout layout{kImage5, held, needed};
    check_layout(layout, /*with_reverse=*/false);
    TileExchange exchange(*comm, kImage5, held, needed);
    EXPECT_EQ(exchange.has_replicas(), p > 2);
    if (p > 2) {
      Tensor out;
      EXPECT_THROW(exchange.reverse(gradient_of(me, needed[static_cast<std::size_t>(me)]), out), Error);
    }
  }
  // Replicas share the work: at 4 ranks, ranks 1 and 3 take the first half from ranks 0 and 2 (not
  // both from one), and ranks 0 and 2 the second half from 1 and 3; each rank talks to one peer.
  TileExchange gather(*comm, kImage5, held, std::vector<Box>(static_cast<std::size_t>(p), tile(kImage5, 0, {}, {})));
  if (p == 4) {
    EXPECT_EQ(gather.peers(), 1);
    EXPECT_EQ(gather.recv_elements(), kImage5.numel() - held[static_cast<std::size_t>(me)].numel());
    EXPECT_EQ(gather.send_elements(), held[static_cast<std::size_t>(me)].numel());
  }
  // A rank that holds a replica of what it needs takes it from itself.
  TileExchange own(*comm, kImage5, held, held);
  EXPECT_EQ(own.peers(), 0);
}

// ---------------------------------------------------------------------------------------------
// Edge cases and errors

TEST(TileExchange, EmptyTensors) {
  const int p = world()->size();
  const Shape empty({2, 0, 5});
  const auto held = tiles(empty, p, {2}, {p});
  check_layout({empty, held, grown(held, 2, 1, 1)});
  // Nonempty tensor, but a rank needs an empty box (no samples).
  auto needed = grown(tiles(kImage5, p, {kD}, {p}), kD, 1, 1);
  needed.back().extent[0] = 0;
  check_layout({kImage5, tiles(kImage5, p, {kD}, {p}), needed});
}

TEST(TileExchange, NonblockingStartFinish) {
  auto comm = world();
  const int p = comm->size(), me = comm->rank();
  const auto held = tiles(kImage5, p, {kD}, {p});
  const auto needed_a = grown(held, kD, 1, 1);
  const auto needed_b = tiles(kImage5, p, {kH}, {p});
  const Tensor global = indexed(kImage5);
  for (Transport t : kTransports) {
    // Two exchanges in flight on one communicator, told apart by their tags, finished out of order.
    TileExchange a(*comm, kImage5, held, needed_a, t, /*tag=*/11);
    TileExchange b(*comm, kImage5, held, needed_b, t, /*tag=*/12);
    Tensor tile_in = slice_of(global, held[static_cast<std::size_t>(me)], 0.0f), out_a, out_b;
    a.start_forward(tile_in, out_a, -1.0f);
    b.start_forward(tile_in, out_b);
    tile_in.fill(-99.0f);  // the tile may change once start returned
    b.finish_forward();
    a.finish_forward();
    expect_same(out_a, slice_of(global, needed_a[static_cast<std::size_t>(me)], -1.0f), name(t));
    expect_same(out_b, slice_of(global, needed_b[static_cast<std::size_t>(me)], 0.0f), name(t));
    // The exchange is reusable, and refuses finish without start.
    a.forward(slice_of(global, held[static_cast<std::size_t>(me)], 0.0f), out_a, -1.0f);
    expect_same(out_a, slice_of(global, needed_a[static_cast<std::size_t>(me)], -1.0f), name(t));
    EXPECT_THROW(a.finish_forward(), Error);
    EXPECT_THROW(a.finish_reverse(), Error);
  }
}

TEST(TileExchange, ElementHeldByNobodyIsRejected) {
  auto comm = world();
  const int p = comm->size();
  auto held = tiles(kImage5, p, {kD}, {p});
  const auto needed = tiles(kImage5, p, {kD}, {p});
  held.back().extent[kD] -= 1;  // the last D plane is held by no rank
  try {
    TileExchange exchange(*comm, kImage5, held, needed);
    ADD_FAILURE() << "no error for an element held by nobody";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find(fmt::format("rank {} needs box", p - 1)), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("held by no rank"), std::string::npos) << e.message();
  }
  // Held boxes that overlap without being identical, or that leave the tensor.
  auto overlapping = tiles(kImage5, p, {kD}, {p});
  if (p > 1) {
    overlapping[0].extent[kD] += 1;
    EXPECT_THROW(TileExchange(*comm, kImage5, overlapping, needed), Error);
  }
  auto outside = tiles(kImage5, p, {kD}, {p});
  outside[0].begin[kD] -= 1;
  EXPECT_THROW(TileExchange(*comm, kImage5, outside, needed), Error);
  // One box per rank.
  EXPECT_THROW(TileExchange(*comm, kImage5, std::vector<Box>(1, held[0]), needed), Error);
  // A held tile of the wrong shape.
  TileExchange exchange(*comm, kImage5, needed, needed);
  Tensor out;
  EXPECT_THROW(exchange.forward(Tensor(Shape({3})), out), Error);
}

}  // namespace
}  // namespace tessera
