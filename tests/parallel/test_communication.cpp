// Communication at 1-4 ranks: MpiCommunicator (every collective, point to point, split and
// duplicate), GradReducer (bucketed nonblocking
// allreduce) and `collectively` (every rank fails together).
//
// Every rank runs every test; a test never returns early on one rank while others enter a
// collective (assertions that could differ between ranks are EXPECTs, or come after the last
// collective), so a failure is reported instead of turning into a deadlock.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tessera/core/communicator.hpp"
#include "tessera/core/error.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/parallel/grad_reducer.hpp"
#include "tessera/parallel/mpi_communicator.hpp"
#include "tessera/tensor/grid.hpp"
#include "tessera/tensor/tensor.hpp"

namespace tessera {
namespace {

std::shared_ptr<MpiCommunicator> world() { return MpiCommunicator::world(); }

// ---------------------------------------------------------------------------------------------
// MpiCommunicator

TEST(MpiCommunicator, WorldRankAndSize) {
  auto comm = world();
  EXPECT_GE(comm->size(), 1);
  EXPECT_GE(comm->rank(), 0);
  EXPECT_LT(comm->rank(), comm->size());
  EXPECT_EQ(comm->rank(), process_rank());  // the test main set it from MPI_COMM_WORLD
  EXPECT_EQ(comm->name(), "world");
  EXPECT_NE(comm->mpi_handle(), -1);
  // Every rank sees the same size and a distinct rank.
  const auto ranks = comm->allgather_value(comm->rank());
  for (int r = 0; r < comm->size(); ++r) EXPECT_EQ(ranks[static_cast<std::size_t>(r)], r);
  comm->barrier();
}

template <typename T>
class Allreduce : public ::testing::Test {};
using ReduceTypes = ::testing::Types<float, double, std::int64_t, std::int32_t>;
TYPED_TEST_SUITE(Allreduce, ReduceTypes);

TYPED_TEST(Allreduce, SumMaxMin) {
  using T = TypeParam;
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  constexpr int count = 5;
  // Element i on rank r: (r + 1) * (i + 1), alternating sign on odd i.
  auto value = [](int rank, int i) { return static_cast<T>((rank + 1) * (i + 1) * (i % 2 ? -1 : 1)); };
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min}) {
    std::vector<T> data(count);
    for (int i = 0; i < count; ++i) data[static_cast<std::size_t>(i)] = value(r, i);
    comm->allreduce(std::span<T>(data), op);
    for (int i = 0; i < count; ++i) {
      T expected = value(0, i);
      for (int q = 1; q < n; ++q) {
        const T v = value(q, i);
        if (op == ReduceOp::Sum) expected = static_cast<T>(expected + v);
        if (op == ReduceOp::Max) expected = std::max(expected, v);
        if (op == ReduceOp::Min) expected = std::min(expected, v);
      }
      EXPECT_EQ(data[static_cast<std::size_t>(i)], expected) << "op " << static_cast<int>(op) << " element " << i;
    }
  }
  EXPECT_EQ(comm->allreduce_value(static_cast<T>(r + 1)), static_cast<T>(n * (n + 1) / 2));
  EXPECT_EQ(comm->allreduce_value(static_cast<T>(r), ReduceOp::Max), static_cast<T>(n - 1));
  EXPECT_EQ(comm->allreduce_value(static_cast<T>(r + 3), ReduceOp::Min), static_cast<T>(3));
}

TEST(MpiCommunicator, AllreduceLargeInt64Exactly) {
  auto comm = world();
  // Values beyond 2^53: an int64 sum must not go through a double.
  const std::int64_t big = (std::int64_t{1} << 60) + 1;
  const std::int64_t sum = comm->allreduce_value<std::int64_t>(big / 8 + comm->rank());
  const std::int64_t n = comm->size();
  EXPECT_EQ(sum, n * (big / 8) + n * (n - 1) / 2);
}

TEST(MpiCommunicator, IallreduceThenWait) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  std::vector<float> a(1000), b(7);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(r) + static_cast<float>(i);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(r * 2);
  // Two reductions in flight at once, completed in order; the second one by polling.
  auto first = comm->iallreduce(a.data(), a.size(), DType::F32, ReduceOp::Sum);
  auto second = comm->iallreduce(b.data(), b.size(), DType::F32, ReduceOp::Max);
  first->wait();
  while (!second->test()) {
  }
  const float rank_sum = static_cast<float>(n * (n - 1) / 2);
  for (std::size_t i = 0; i < a.size(); ++i)
    ASSERT_EQ(a[i], rank_sum + static_cast<float>(n) * static_cast<float>(i)) << i;
  for (float v : b) EXPECT_EQ(v, static_cast<float>(2 * (n - 1)));
  // A request destroyed without wait() completes in its destructor.
  std::int64_t c = r;
  { auto request = comm->iallreduce(&c, 1, DType::I64, ReduceOp::Sum); }
  EXPECT_EQ(c, n * (n - 1) / 2);
}

TEST(MpiCommunicator, BroadcastFromEveryRoot) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  for (int root = 0; root < n; ++root) {
    std::vector<double> data(6);
    for (std::size_t i = 0; i < data.size(); ++i)
      data[i] = r == root ? 10.0 * root + static_cast<double>(i) : -1.0;
    comm->broadcast(std::span<double>(data), root);
    for (std::size_t i = 0; i < data.size(); ++i) EXPECT_EQ(data[i], 10.0 * root + static_cast<double>(i));
  }
  std::uint8_t flag = r == 0 ? 7 : 0;
  comm->broadcast(&flag, 1, DType::U8, 0);
  EXPECT_EQ(flag, 7);
}

TEST(MpiCommunicator, Allgather) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  const std::int32_t mine[3] = {r, -r, 100 + r};
  std::vector<std::int32_t> all(static_cast<std::size_t>(3 * n), -999);
  comm->allgather(mine, all.data(), 3, DType::I32);
  for (int q = 0; q < n; ++q) {
    EXPECT_EQ(all[static_cast<std::size_t>(3 * q)], q);
    EXPECT_EQ(all[static_cast<std::size_t>(3 * q + 1)], -q);
    EXPECT_EQ(all[static_cast<std::size_t>(3 * q + 2)], 100 + q);
  }
  const auto doubles = comm->allgather_value(0.5 * r);
  ASSERT_EQ(doubles.size(), static_cast<std::size_t>(n));
  for (int q = 0; q < n; ++q) EXPECT_EQ(doubles[static_cast<std::size_t>(q)], 0.5 * q);
}

TEST(MpiCommunicator, ReduceScatter) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  constexpr int count = 4;
  // Block b, element j on rank r: r + 100 b + j.
  std::vector<float> send(static_cast<std::size_t>(n * count));
  for (int b = 0; b < n; ++b)
    for (int j = 0; j < count; ++j) send[static_cast<std::size_t>(b * count + j)] = static_cast<float>(r + 100 * b + j);
  std::vector<float> recv(count, -1.0f);
  comm->reduce_scatter(send.data(), recv.data(), count, DType::F32, ReduceOp::Sum);
  for (int j = 0; j < count; ++j)
    EXPECT_EQ(recv[static_cast<std::size_t>(j)], static_cast<float>(n * (n - 1) / 2 + n * (100 * r + j))) << j;
  comm->reduce_scatter(send.data(), recv.data(), count, DType::F32, ReduceOp::Max);
  for (int j = 0; j < count; ++j) EXPECT_EQ(recv[static_cast<std::size_t>(j)], static_cast<float>(n - 1 + 100 * r + j));
}

TEST(MpiCommunicator, AlltoallvWithUnevenCounts) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  // Rank s sends (s + 2 d) % 3 elements to rank d (some zero), valued 1000 s + 10 d + k.
  // Blocks are laid out with one unused element before each, so displacements matter.
  auto count = [](int s, int d) { return static_cast<std::int64_t>((s + 2 * d) % 3); };
  std::vector<std::int64_t> send_counts(static_cast<std::size_t>(n)), send_displs(static_cast<std::size_t>(n)),
      recv_counts(static_cast<std::size_t>(n)), recv_displs(static_cast<std::size_t>(n));
  std::int64_t send_total = 0, recv_total = 0;
  for (int q = 0; q < n; ++q) {
    const auto i = static_cast<std::size_t>(q);
    send_counts[i] = count(r, q);
    send_displs[i] = send_total + 1;
    send_total += send_counts[i] + 1;
    recv_counts[i] = count(q, r);
    recv_displs[i] = recv_total + 1;
    recv_total += recv_counts[i] + 1;
  }
  std::vector<std::int64_t> send(static_cast<std::size_t>(send_total), -1);
  for (int d = 0; d < n; ++d)
    for (std::int64_t k = 0; k < send_counts[static_cast<std::size_t>(d)]; ++k)
      send[static_cast<std::size_t>(send_displs[static_cast<std::size_t>(d)] + k)] = 1000 * r + 10 * d + k;
  std::vector<std::int64_t> recv(static_cast<std::size_t>(recv_total), -7);
  comm->alltoallv(send.data(), send_counts, send_displs, recv.data(), recv_counts, recv_displs, DType::I64);
  for (int s = 0; s < n; ++s) {
    const auto i = static_cast<std::size_t>(s);
    EXPECT_EQ(recv[static_cast<std::size_t>(recv_displs[i] - 1)], -7) << "gap before the block of rank " << s;
    for (std::int64_t k = 0; k < recv_counts[i]; ++k)
      EXPECT_EQ(recv[static_cast<std::size_t>(recv_displs[i] + k)], 1000 * s + 10 * r + k) << "from " << s;
  }
}

TEST(MpiCommunicator, GroupedExchangeWithSelfUnevenEmptyAndRepeatedPeers) {
  // Rank s sends (s + 2 d) % 3 values to every rank d, itself included (some messages empty),
  // then a second message of 2 values to the next rank: messages between two ranks match in the
  // order given (as NCCL's do). One request for all of them.
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  const int next = (r + 1) % n, previous = (r + n - 1) % n;
  auto count = [](int s, int d) { return static_cast<std::size_t>((s + 2 * d) % 3); };
  std::vector<std::vector<float>> out(static_cast<std::size_t>(n)), in(static_cast<std::size_t>(n));
  std::vector<Message> sends, receives;
  for (int q = 0; q < n; ++q) {
    auto& o = out[static_cast<std::size_t>(q)];
    for (std::size_t k = 0; k < count(r, q); ++k) o.push_back(static_cast<float>(1000 * r + 10 * q) + static_cast<float>(k));
    in[static_cast<std::size_t>(q)].assign(count(q, r), -1.0f);
    sends.push_back({o.data(), o.size(), q});
    receives.push_back({in[static_cast<std::size_t>(q)].data(), count(q, r), q});
  }
  std::vector<float> second_out = {-3.0f - static_cast<float>(r), 0.5f}, second_in(2, -1.0f);
  sends.push_back({second_out.data(), 2, next});
  receives.push_back({second_in.data(), 2, previous});
  auto request = comm->exchange(sends, receives, DType::F32, 21);
  request->wait();
  EXPECT_TRUE(request->test());
  for (int s = 0; s < n; ++s)
    for (std::size_t k = 0; k < count(s, r); ++k)
      EXPECT_EQ(in[static_cast<std::size_t>(s)][k], static_cast<float>(1000 * s + 10 * r) + static_cast<float>(k))
          << "from " << s;
  EXPECT_EQ(second_in[0], -3.0f - static_cast<float>(previous));
  EXPECT_EQ(second_in[1], 0.5f);
  EXPECT_FALSE(comm->moves_gpu_memory());
}

TEST(MpiCommunicator, AnExchangeThatCannotPostASendFailsWithoutWaitingForItsReceives) {
  // A receive from the previous rank (which never sends on this tag) is posted, then a send MPI
  // cannot take (more elements than its int count holds; the buffer is never read) fails: the
  // exchange throws, and the posted receive is cancelled rather than waited for (which would
  // hang until the test's timeout).
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  std::vector<float> in(4, -1.0f), out(4, 1.0f);
  const std::vector<Message> receives = {{in.data(), in.size(), (r + n - 1) % n}};
  const std::vector<Message> too_long = {{out.data(), std::size_t{1} << 31, (r + 1) % n}};
  EXPECT_THROW(comm->exchange(too_long, receives, DType::F32, 23), Error);
  EXPECT_EQ(in[0], -1.0f);  // nothing arrived
  // A peer past the last rank is refused before anything is posted.
  const std::vector<Message> past_the_end = {{out.data(), out.size(), n}};
  try {
    comm->exchange(past_the_end, receives, DType::F32, 24);
    ADD_FAILURE() << "an exchange with rank " << n << " of " << n << " was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("a grouped exchange with rank " + std::to_string(n)), std::string::npos)
        << e.what();
  }
  comm->barrier();  // every rank got here: nothing is left waiting
}

TEST(MpiCommunicator, SendRecvRing) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  const int next = (r + 1) % n, previous = (r + n - 1) % n;
  // Nonblocking send, blocking receive.
  std::vector<double> out(5), in(5, -1.0);
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = r * 10.0 + static_cast<double>(i);
  auto sending = comm->isend(out.data(), out.size(), DType::F64, next, 11);
  comm->recv(in.data(), in.size(), DType::F64, previous, 11);
  sending->wait();
  for (std::size_t i = 0; i < in.size(); ++i) EXPECT_EQ(in[i], previous * 10.0 + static_cast<double>(i));
  // Nonblocking receive, blocking send, the other way round; tags keep the two messages apart.
  std::int32_t token = -1, mine = 1000 + r, other = 2000 + r;
  auto receiving = comm->irecv(&token, 1, DType::I32, next, 12);
  std::int32_t decoy = -5;
  auto receiving_other = comm->irecv(&decoy, 1, DType::I32, next, 13);
  comm->send(&other, 1, DType::I32, previous, 13);
  comm->send(&mine, 1, DType::I32, previous, 12);
  receiving->wait();
  receiving_other->wait();
  EXPECT_EQ(token, 1000 + next);
  EXPECT_EQ(decoy, 2000 + next);
}

TEST(MpiCommunicator, SplitOrdersByKey) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  // Two colors by parity; the key reverses the order within each color.
  auto sub = comm->split(r % 2, -r);
  std::vector<int> members;
  for (int q = 0; q < n; ++q)
    if (q % 2 == r % 2) members.push_back(q);
  std::vector<int> reversed(members.rbegin(), members.rend());
  EXPECT_EQ(sub->size(), static_cast<int>(members.size()));
  const auto pos = std::find(reversed.begin(), reversed.end(), r) - reversed.begin();
  EXPECT_EQ(sub->rank(), static_cast<int>(pos));
  EXPECT_NE(sub->name().find("split"), std::string::npos) << sub->name();
  // Collectives run within the group only.
  EXPECT_EQ(sub->allreduce_value(r), std::accumulate(members.begin(), members.end(), 0));
  EXPECT_EQ(sub->allgather_value(r), reversed);
  EXPECT_NE(sub->mpi_handle(), comm->mpi_handle());
}

TEST(MpiCommunicator, DuplicateIsIndependent) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  auto dup = comm->duplicate();
  EXPECT_EQ(dup->size(), n);
  EXPECT_EQ(dup->rank(), r);
  EXPECT_NE(dup->mpi_handle(), comm->mpi_handle());
  EXPECT_NE(dup->name().find("dup"), std::string::npos) << dup->name();
  // A message on the duplicate is not matched by a receive on the original with the same tag.
  const int next = (r + 1) % n, previous = (r + n - 1) % n;
  std::int32_t on_world = -1, on_dup = -1;
  auto world_recv = comm->irecv(&on_world, 1, DType::I32, previous, 5);
  auto dup_recv = dup->irecv(&on_dup, 1, DType::I32, previous, 5);
  const std::int32_t a = 100 + r, b = 200 + r;
  dup->send(&b, 1, DType::I32, next, 5);
  comm->send(&a, 1, DType::I32, next, 5);
  world_recv->wait();
  dup_recv->wait();
  EXPECT_EQ(on_world, 100 + previous);
  EXPECT_EQ(on_dup, 200 + previous);
  auto dup_of_dup = dup->duplicate();
  EXPECT_EQ(dup_of_dup->allreduce_value(1), n);
}

// ---------------------------------------------------------------------------------------------
// GradReducer

// Gradient g on rank r, element i: (r + 1)(g + 1) + step + i / 2 — exact in float.
float grad_value(int rank, int g, int step, std::int64_t i) {
  return static_cast<float>((rank + 1) * (g + 1) + step) + 0.5f * static_cast<float>(i);
}
float summed_value(int ranks, int g, int step, std::int64_t i) {
  return static_cast<float>(ranks * (ranks + 1) / 2 * (g + 1) + ranks * step) + 0.5f * static_cast<float>(ranks * i);
}

void fill_grad(Tensor& t, int rank, int g, int step) {
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data()[i] = grad_value(rank, g, step, i);
}

/// Six gradients of varied shapes; the vector is never resized, so the addresses the reducer
/// keeps stay valid.
std::vector<Tensor> make_grads() {
  std::vector<Tensor> grads;
  for (const Shape& s : {Shape({3}), Shape({5, 4}), Shape({7}), Shape({2, 3, 2}), Shape({100}), Shape({1})})
    grads.emplace_back(s);
  return grads;
}

// Expects every gradient to be the sum over ranks; checked after the step's collectives.
void expect_summed(const std::vector<Tensor>& grads, int ranks, int step) {
  for (std::size_t g = 0; g < grads.size(); ++g)
    for (std::int64_t i = 0; i < grads[g].numel(); ++i)
      ASSERT_EQ(grads[g].data()[i], summed_value(ranks, static_cast<int>(g), step, i))
          << "gradient " << g << " element " << i << " step " << step;
}

TEST(GradReducer, BucketsKeepValuesAndShapes) {
  auto comm = world();
  const int r = comm->rank();
  std::vector<Tensor> grads = make_grads();
  for (std::size_t g = 0; g < grads.size(); ++g) fill_grad(grads[g], r, static_cast<int>(g), 0);
  std::vector<const float*> before;
  for (auto& t : grads) before.push_back(t.data());
  GradReducer reducer(GradReducerOptions{64});  // 16 floats per bucket at least
  for (auto& t : grads) reducer.add(t, *comm);
  reducer.build();
  // Sizes 3+20 | 7+12 | 100 | 1 floats: a bucket closes once it holds >= 64 bytes.
  EXPECT_EQ(reducer.bucket_count(), 4u);
  EXPECT_EQ(reducer.bytes_per_step(), comm->size() > 1 ? (3 + 20 + 7 + 12 + 100 + 1) * sizeof(float) : 0u);
  for (std::size_t g = 0; g < grads.size(); ++g) {
    EXPECT_NE(grads[g].data(), before[g]) << "gradient " << g << " was not re-pointed into a bucket";
    for (std::int64_t i = 0; i < grads[g].numel(); ++i)
      ASSERT_EQ(grads[g].data()[i], grad_value(r, static_cast<int>(g), 0, i)) << g << " " << i;
  }
  EXPECT_EQ(grads[1].shape().dims(), (std::vector<std::int64_t>{5, 4}));
  EXPECT_EQ(grads[3].shape().dims(), (std::vector<std::int64_t>{2, 3, 2}));
  // Gradients of one bucket are packed back to back.
  EXPECT_EQ(grads[1].data(), grads[0].data() + 3);
  EXPECT_EQ(grads[3].data(), grads[2].data() + 7);
}

TEST(GradReducer, TwoStepsInRegistrationThenReverseOrder) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  std::vector<Tensor> grads = make_grads();
  GradReducer reducer(GradReducerOptions{64});
  for (auto& t : grads) reducer.add(t, *comm);
  reducer.build();
  ASSERT_GT(reducer.bucket_count(), 1u);  // same on every rank

  // Step 0: gradients become final in registration order (as backward produces them).
  for (std::size_t g = 0; g < grads.size(); ++g) {
    fill_grad(grads[g], r, static_cast<int>(g), 0);
    reducer.ready(grads[g]);
  }
  reducer.finish();
  expect_summed(grads, n, 0);

  // Step 1: the same order on every rank but reversed, so the last bucket starts first.
  for (std::size_t k = grads.size(); k-- > 0;) {
    fill_grad(grads[k], r, static_cast<int>(k), 1);
    reducer.ready(grads[k]);
  }
  reducer.finish();
  expect_summed(grads, n, 1);

  // Step 2: all filled first, then marked interleaved across buckets.
  for (std::size_t g = 0; g < grads.size(); ++g) fill_grad(grads[g], r, static_cast<int>(g), 2);
  for (std::size_t g : {1u, 3u, 0u, 5u, 2u, 4u}) reducer.ready(grads[g]);
  reducer.finish();
  expect_summed(grads, n, 2);
}

TEST(GradReducer, GroupsGetTheirOwnBuckets) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  auto half = comm->split(r % 2, r);  // ranks of my parity
  std::vector<Tensor> grads;
  grads.emplace_back(Shape({4}));
  grads.emplace_back(Shape({4}));
  grads.emplace_back(Shape({4}));
  GradReducer reducer;  // 1 MiB buckets: only a change of group closes a bucket
  reducer.add(grads[0], *comm);
  reducer.add(grads[1], *half);
  reducer.add(grads[2], *comm);
  reducer.build();
  EXPECT_EQ(reducer.bucket_count(), 3u);
  for (auto& t : grads) t.fill(static_cast<float>(r + 1));
  for (auto& t : grads) reducer.ready(t);
  reducer.finish();
  float half_sum = 0.0f;
  for (int q = r % 2; q < n; q += 2) half_sum += static_cast<float>(q + 1);
  for (std::int64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(grads[0].data()[i], static_cast<float>(n * (n + 1) / 2));
    EXPECT_EQ(grads[1].data()[i], half_sum);
    EXPECT_EQ(grads[2].data()[i], static_cast<float>(n * (n + 1) / 2));
  }
}

TEST(GradReducer, MarkingAGradientTwiceInAStepThrows) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  std::vector<Tensor> grads = make_grads();
  GradReducer reducer(GradReducerOptions{64});
  for (auto& t : grads) reducer.add(t, *comm);
  reducer.build();
  for (std::size_t g = 0; g < grads.size(); ++g) fill_grad(grads[g], r, static_cast<int>(g), 0);
  // Gradient 0 shares its bucket with gradient 1: the second mark must be caught at once, before
  // the bucket's reduction starts without gradient 1.
  reducer.ready(grads[0]);
  EXPECT_THROW(reducer.ready(grads[0]), Error);
  // Gradient 4 is alone in its bucket (its reduction already started when marked the first time).
  reducer.ready(grads[4]);
  EXPECT_THROW(reducer.ready(grads[4]), Error);
  // The step can still complete, and the refused marks changed nothing.
  for (std::size_t g : {1u, 2u, 3u, 5u}) reducer.ready(grads[g]);
  reducer.finish();
  expect_summed(grads, n, 0);
}

TEST(GradReducer, MisuseIsRefused) {
  auto comm = world();
  Tensor grad(Shape({8}));
  GradReducer reducer;
  reducer.add(grad, *comm);
  EXPECT_THROW(reducer.ready(grad), Error);  // before build()
  reducer.build();
  EXPECT_THROW(reducer.build(), Error);
  Tensor late(Shape({2}));
  EXPECT_THROW(reducer.add(late, *comm), Error);
  EXPECT_THROW(reducer.finish(), Error);  // never marked ready (nothing is in flight)
  Tensor stranger(Shape({8}));
  EXPECT_THROW(reducer.ready(stranger), Error);  // never registered
  // Another handle on the same memory is the same gradient.
  grad.fill(static_cast<float>(comm->rank()));
  Tensor alias = grad;
  reducer.ready(alias);
  reducer.finish();
  const int n = comm->size();
  EXPECT_EQ(grad.data()[7], static_cast<float>(n * (n - 1) / 2));
}

// ---------------------------------------------------------------------------------------------
// collectively

/// Delegates to another communicator and counts the collectives that `collectively` may use.
class CountingCommunicator final : public Communicator {
 public:
  explicit CountingCommunicator(Communicator& inner) : inner_(inner) {}
  int collectives = 0;

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string name() const override { return "counting " + inner_.name(); }
  void barrier() override { ++collectives; inner_.barrier(); }
  void broadcast(void* data, std::size_t count, DType type, int root) override {
    ++collectives;
    inner_.broadcast(data, count, type, root);
  }
  void allreduce(void* data, std::size_t count, DType type, ReduceOp op) override {
    ++collectives;
    inner_.allreduce(data, count, type, op);
  }
  std::unique_ptr<CommRequest> iallreduce(void* data, std::size_t count, DType type, ReduceOp op) override {
    ++collectives;
    return inner_.iallreduce(data, count, type, op);
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType type, ReduceOp op) override {
    ++collectives;
    inner_.reduce_scatter(send, recv, count, type, op);
  }
  void allgather(const void* send, void* recv, std::size_t count, DType type) override {
    ++collectives;
    inner_.allgather(send, recv, count, type);
  }
  void alltoallv(const void* send, std::span<const std::int64_t> send_counts,
                 std::span<const std::int64_t> send_displs, void* recv, std::span<const std::int64_t> recv_counts,
                 std::span<const std::int64_t> recv_displs, DType type) override {
    ++collectives;
    inner_.alltoallv(send, send_counts, send_displs, recv, recv_counts, recv_displs, type);
  }
  void send(const void* data, std::size_t count, DType type, int dest, int tag) override {
    inner_.send(data, count, type, dest, tag);
  }
  void recv(void* data, std::size_t count, DType type, int source, int tag) override {
    inner_.recv(data, count, type, source, tag);
  }
  std::unique_ptr<CommRequest> isend(const void* data, std::size_t count, DType type, int dest, int tag) override {
    return inner_.isend(data, count, type, dest, tag);
  }
  std::unique_ptr<CommRequest> irecv(void* data, std::size_t count, DType type, int source, int tag) override {
    return inner_.irecv(data, count, type, source, tag);
  }
  std::unique_ptr<Communicator> split(int color, int key) const override { return inner_.split(color, key); }
  std::unique_ptr<Communicator> duplicate() const override { return inner_.duplicate(); }
  int mpi_handle() const override { return inner_.mpi_handle(); }
  [[noreturn]] void abort(int exit_code) override {
    inner_.abort(exit_code);
    std::_Exit(exit_code);  // not reached
  }

 private:
  Communicator& inner_;
};

TEST(Collectively, NobodyThrows) {
  auto comm = world();
  CountingCommunicator counting(*comm);
  int runs = 0;
  EXPECT_NO_THROW(collectively(counting, [&] { ++runs; }));
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(counting.collectives, 1);  // one agreement
}

TEST(Collectively, LastRankFailsEveryRankThrows) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  const int last = n - 1;
  bool thrown = false;
  try {
    collectively(*comm, [&] {
      if (r == last) fail_input("bad file 'x.h5' on the last rank");
    });
  } catch (const AgreedFailure& e) {
    thrown = true;
    EXPECT_EQ(e.exit_code(), 2);
    EXPECT_EQ(e.failed_rank(), last);
    EXPECT_EQ(e.is_origin(), r == last);
    if (r == last) {
      EXPECT_EQ(e.origin_message(), "bad file 'x.h5' on the last rank");
    } else {
      EXPECT_EQ(e.origin_message().find("bad file"), std::string::npos) << e.origin_message();
      EXPECT_NE(e.origin_message().find(std::to_string(last)), std::string::npos) << e.origin_message();
    }
    EXPECT_NE(e.message().find(fmt::format("rank {} failed", last)), std::string::npos) << e.message();
  }
  EXPECT_TRUE(thrown);
  // Nobody was left behind in a collective: the world still works.
  EXPECT_EQ(comm->allreduce_value(1), n);
}

TEST(Collectively, LowestFailingRankSpeaks) {
  auto comm = world();
  const int r = comm->rank();
  try {
    collectively(*comm, [&] {
      if (r == 0) throw NumericError("loss is NaN");
      throw std::runtime_error("something else");
    });
    ADD_FAILURE() << "no AgreedFailure";
  } catch (const AgreedFailure& e) {
    EXPECT_EQ(e.failed_rank(), 0);
    EXPECT_EQ(e.exit_code(), 3);
    EXPECT_EQ(e.is_origin(), r == 0);
    if (r == 0) {
      EXPECT_EQ(e.origin_message(), "loss is NaN");
    }
  }
  // A plain std::exception counts as exit code 1.
  try {
    collectively(*comm, [&] {
      if (r == 0) throw std::runtime_error("plain");
    });
    ADD_FAILURE() << "no AgreedFailure";
  } catch (const AgreedFailure& e) {
    EXPECT_EQ(e.exit_code(), 1);
    if (r == 0) {
      EXPECT_EQ(e.origin_message(), "plain");
    }
  }
}

TEST(Collectively, NestedRethrowsWithoutASecondAgreement) {
  auto comm = world();
  const int n = comm->size(), r = comm->rank();
  CountingCommunicator counting(*comm);
  int after_inner = 0;
  try {
    collectively(counting, [&] {
      collectively(counting, [&] {
        if (r == n - 1) fail_input("inner failure");
      });
      ++after_inner;
    });
    ADD_FAILURE() << "no AgreedFailure";
  } catch (const AgreedFailure& e) {
    EXPECT_EQ(e.failed_rank(), n - 1);
    EXPECT_EQ(e.exit_code(), 2);
    EXPECT_EQ(e.is_origin(), r == n - 1);
    if (r == n - 1) {
      EXPECT_EQ(e.origin_message(), "inner failure");
    }
  }
  EXPECT_EQ(after_inner, 0);
  EXPECT_EQ(counting.collectives, 1);  // the inner agreement only
  EXPECT_EQ(comm->allreduce_value(1), n);
}

}  // namespace
}  // namespace tessera
