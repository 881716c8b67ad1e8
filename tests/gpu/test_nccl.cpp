// The NCCL communicator against the MPI one: every collective and grouped exchange on GPU
// buffers gives what the MPI communicator gives on the same host data (exactly, for integers and
// for sums of values that add without rounding), split groups included; host buffers are refused
// clearly. Nonblocking operations run on the communication stream after the compute queued before
// them, and compute queued after wait() sees their result. Tile exchanges and gradient buckets
// over NCCL equal the same over MPI on the host.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/parallel/grad_reducer.hpp"
#include "tessera/parallel/mpi_communicator.hpp"
#include "tessera/parallel/nccl_communicator.hpp"
#include "tessera/parallel/tile_exchange.hpp"
#include "tessera/tensor/box.hpp"
#include "tessera/tensor/tensor.hpp"

namespace tessera {
namespace {

Device gpu() { return Device::cuda(cuda::current_device()); }

/// Values that sum exactly in float (small integers scaled by powers of two).
Tensor values(std::int64_t count, int rank, int salt) {
  Tensor t(Shape({count}));
  for (std::int64_t i = 0; i < count; ++i) t.data()[i] = static_cast<float>((i * 7 + rank * 13 + salt) % 97) * 0.25f;
  return t;
}

void expect_equal(const Tensor& expected, const Tensor& on_gpu) {
  const Tensor back = on_gpu.to(Device::host());
  ASSERT_EQ(expected.numel(), back.numel());
  for (std::int64_t i = 0; i < expected.numel(); ++i) ASSERT_EQ(expected.data()[i], back.data()[i]) << "element " << i;
}

class Nccl : public ::testing::Test {
 protected:
  std::shared_ptr<MpiCommunicator> mpi = MpiCommunicator::world();
  std::unique_ptr<Communicator> nccl = make_nccl_communicator(*mpi);
  int rank = mpi->rank(), size = mpi->size();
};

TEST_F(Nccl, CollectivesMatchMpi) {
  EXPECT_EQ(nccl->rank(), rank);
  EXPECT_EQ(nccl->size(), size);
  const std::int64_t n = 1000;
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min}) {
    Tensor host = values(n, rank, 1);
    Tensor device = host.to(gpu());
    mpi->allreduce(host.data(), static_cast<std::size_t>(n), DType::F32, op);
    nccl->allreduce(device.data(), static_cast<std::size_t>(n), DType::F32, op);
    expect_equal(host, device);
  }
  {  // nonblocking
    Tensor host = values(n, rank, 2);
    Tensor device = host.to(gpu());
    mpi->allreduce(host.data(), static_cast<std::size_t>(n), DType::F32, ReduceOp::Sum);
    auto request = nccl->iallreduce(device.data(), static_cast<std::size_t>(n), DType::F32, ReduceOp::Sum);
    request->wait();
    expect_equal(host, device);
  }
  {  // reduce-scatter and allgather
    const std::int64_t block = 37;
    const Tensor send = values(block * size, rank, 3);
    Tensor host(Shape({block})), device(Shape({block}), gpu());
    mpi->reduce_scatter(send.data(), host.data(), block, DType::F32, ReduceOp::Sum);
    nccl->reduce_scatter(send.to(gpu()).data(), device.data(), block, DType::F32, ReduceOp::Sum);
    expect_equal(host, device);
    Tensor gathered(Shape({block * size})), gathered_gpu(Shape({block * size}), gpu());
    mpi->allgather(host.data(), gathered.data(), block, DType::F32);
    nccl->allgather(device.data(), gathered_gpu.data(), block, DType::F32);
    expect_equal(gathered, gathered_gpu);
  }
  {  // broadcast from the last rank
    Tensor host = values(n, rank, 4);
    Tensor device = host.to(gpu());
    mpi->broadcast(host.data(), static_cast<std::size_t>(n), DType::F32, size - 1);
    nccl->broadcast(device.data(), static_cast<std::size_t>(n), DType::F32, size - 1);
    expect_equal(host, device);
  }
}

TEST_F(Nccl, AllToAllVWithUnevenAndEmptyBlocks) {
  // Rank r sends (r + p + 1) % 3 * 5 elements to peer p (some blocks empty; at 1 rank, 5 to itself).
  std::vector<std::int64_t> send_counts(size), send_displs(size), recv_counts(size), recv_displs(size);
  for (int p = 0; p < size; ++p) {
    send_counts[p] = (rank + p + 1) % 3 * 5;
    recv_counts[p] = (p + rank + 1) % 3 * 5;
  }
  std::exclusive_scan(send_counts.begin(), send_counts.end(), send_displs.begin(), std::int64_t{0});
  std::exclusive_scan(recv_counts.begin(), recv_counts.end(), recv_displs.begin(), std::int64_t{0});
  const std::int64_t sent = send_displs.back() + send_counts.back(), received = recv_displs.back() + recv_counts.back();
  const Tensor send = values(std::max<std::int64_t>(sent, 1), rank, 5);
  Tensor host(Shape({std::max<std::int64_t>(received, 1)})), device(host.shape(), gpu());
  mpi->alltoallv(send.data(), send_counts, send_displs, host.data(), recv_counts, recv_displs, DType::F32);
  nccl->alltoallv(send.to(gpu()).data(), send_counts, send_displs, device.data(), recv_counts, recv_displs, DType::F32);
  expect_equal(host, device);
}

TEST_F(Nccl, SendRecvRingAndSplitGroups) {
  const std::int64_t n = 64;
  const Tensor mine = values(n, rank, 6);
  Tensor device_mine = mine.to(gpu()), received(Shape({n}), gpu());
  const int next = (rank + 1) % size, previous = (rank + size - 1) % size;
  if (size > 1) {
    // Even ranks send first: blocking NCCL sends must be matched in order, as with MPI.
    if (rank % 2 == 0) {
      nccl->send(device_mine.data(), n, DType::F32, next, 0);
      nccl->recv(received.data(), n, DType::F32, previous, 0);
    } else {
      nccl->recv(received.data(), n, DType::F32, previous, 0);
      nccl->send(device_mine.data(), n, DType::F32, next, 0);
    }
    expect_equal(values(n, previous, 6), received);
  }
  // Even and odd ranks: each group's sum is its own.
  auto group = nccl->split(rank % 2, rank);
  auto mpi_group = mpi->split(rank % 2, rank);
  EXPECT_EQ(group->size(), mpi_group->size());
  Tensor host = mine.clone();
  Tensor device = mine.to(gpu());
  mpi_group->allreduce(host.data(), n, DType::F32, ReduceOp::Sum);
  group->allreduce(device.data(), n, DType::F32, ReduceOp::Sum);
  expect_equal(host, device);
}

TEST_F(Nccl, GroupedExchangeMatchesMpi) {
  // Every rank sends (r + 2 d) % 3 * 4 values to every rank d, itself included (some messages
  // empty), and a second message to the next rank: one NCCL group, matched in order.
  EXPECT_TRUE(nccl->moves_gpu_memory());
  auto count = [](int s, int d) { return static_cast<std::int64_t>((s + 2 * d) % 3 * 4); };
  const int next = (rank + 1) % size, previous = (rank + size - 1) % size;
  std::vector<Tensor> out_host, in_host, out_gpu, in_gpu;
  for (int q = 0; q < size; ++q) {
    out_host.push_back(values(std::max<std::int64_t>(count(rank, q), 1), rank, 10 + q));
    in_host.emplace_back(Shape({std::max<std::int64_t>(count(q, rank), 1)}));
  }
  out_host.push_back(values(3, rank, 40));
  in_host.emplace_back(Shape({3}));
  for (const Tensor& t : out_host) out_gpu.push_back(t.to(gpu()));
  for (const Tensor& t : in_host) in_gpu.emplace_back(t.shape(), gpu());
  auto messages = [&](std::vector<Tensor>& out, std::vector<Tensor>& in, std::vector<Message>& sends,
                      std::vector<Message>& receives) {
    for (int q = 0; q < size; ++q) {
      const auto i = static_cast<std::size_t>(q);
      sends.push_back({out[i].data(), static_cast<std::size_t>(count(rank, q)), q});
      receives.push_back({in[i].data(), static_cast<std::size_t>(count(q, rank)), q});
    }
    sends.push_back({out.back().data(), 3, next});
    receives.push_back({in.back().data(), 3, previous});
  };
  std::vector<Message> host_sends, host_receives, gpu_sends, gpu_receives;
  messages(out_host, in_host, host_sends, host_receives);
  messages(out_gpu, in_gpu, gpu_sends, gpu_receives);
  mpi->exchange(host_sends, host_receives, DType::F32, 5)->wait();
  auto request = nccl->exchange(gpu_sends, gpu_receives, DType::F32, 5);
  request->wait();
  for (std::size_t i = 0; i < in_host.size(); ++i) {
    SCOPED_TRACE(i);
    expect_equal(in_host[i], in_gpu[i]);
  }
}

TEST_F(Nccl, NonblockingOperationsFollowTheComputeBeforeThemAndPrecedeTheComputeAfterWait) {
  // A fill of 256 MiB queued on the compute stream and not waited for: an allreduce queued after
  // it must sum the filled values, and a copy queued after wait() must see the sum. Without the
  // events between the streams the allreduce would read the old values (the fill takes longer
  // than queuing the allreduce). At one rank NCCL's in-place allreduce may move nothing; the
  // exchange with this rank itself below copies every element, so it tests the fences there.
  const std::int64_t n = std::int64_t{1} << 26;
  Tensor buffer(Shape({n}), gpu());
  cuda::fill(buffer.data(), n, 1.0f);
  cuda::synchronize();
  cuda::fill(buffer.data(), n, 2.0f);
  auto request = nccl->iallreduce(buffer.data(), static_cast<std::size_t>(n), DType::F32, ReduceOp::Sum);
  request->wait();
  const Tensor back = buffer.to(Device::host());
  for (std::int64_t i = 0; i < n; i += 4099) ASSERT_EQ(back.data()[i], 2.0f * static_cast<float>(size)) << "element " << i;
  ASSERT_EQ(back.data()[n - 1], 2.0f * static_cast<float>(size));
  // The same for a grouped exchange with this rank itself.
  Tensor source(Shape({n}), gpu()), target(Shape({n}), gpu());
  cuda::fill(target.data(), n, -1.0f);
  cuda::fill(source.data(), n, 3.0f);
  const Message send{source.data(), static_cast<std::size_t>(n), rank}, receive{target.data(), static_cast<std::size_t>(n), rank};
  nccl->exchange({&send, 1}, {&receive, 1}, DType::F32, 0)->wait();
  const Tensor received = target.to(Device::host());
  for (std::int64_t i = 0; i < n; i += 4099) ASSERT_EQ(received.data()[i], 3.0f) << "element " << i;
}

/// A tensor [2, 3, H, 5] with H = 3 * ranks + 1 (uneven blocks), held in blocks of rows.
Shape image(int ranks) { return Shape({2, 3, 3 * ranks + 1, 5}); }
std::vector<Box> row_blocks(const Shape& global, int ranks, std::int64_t halo) {
  std::vector<Box> boxes;
  for (int r = 0; r < ranks; ++r)
    boxes.push_back({{0, 0, block_begin(global[2], ranks, r) - halo, 0},
                     {2, 3, block_extent(global[2], ranks, r) + 2 * halo, 5}});
  return boxes;
}
std::vector<Box> column_blocks(const Shape& global, int ranks) {
  std::vector<Box> boxes;
  for (int r = 0; r < ranks; ++r)
    boxes.push_back({{0, 0, 0, block_begin(global[3], ranks, r)}, {2, 3, global[2], block_extent(global[3], ranks, r)}});
  return boxes;
}

TEST_F(Nccl, TileExchangesBetweenGpusEqualTheHostOnes) {
  // Halo exchanges (both transports) and a redistribution (rows to columns), forward and reverse:
  // over NCCL between GPUs exactly what they give over MPI on the host.
  const Shape global = image(size);
  const auto held = row_blocks(global, size, 0);
  const Box& mine = held[static_cast<std::size_t>(rank)];
  Tensor tile = values(mine.numel(), rank, 50).reshape(Shape(mine.extent));
  struct Case {
    const char* name;
    std::vector<Box> needed;
    TileExchange::Transport transport;
  };
  const std::vector<Case> cases = {{"halo, point to point", row_blocks(global, size, 1), TileExchange::Transport::PointToPoint},
                                   {"halo, alltoallv", row_blocks(global, size, 1), TileExchange::Transport::AllToAllV},
                                   {"rows to columns", column_blocks(global, size), TileExchange::Transport::AllToAllV}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TileExchange on_host(*mpi, global, held, c.needed, c.transport);
    TileExchange on_gpus(*nccl, global, held, c.needed, c.transport);
    on_gpus.set_device(gpu());
    Tensor window, window_gpu, back, back_gpu;
    on_host.forward(tile, window, 0.5f);
    on_gpus.forward(tile.to(gpu()), window_gpu, 0.5f);
    expect_equal(window, window_gpu);
    on_host.reverse(window, back);
    on_gpus.reverse(window_gpu, back_gpu);
    expect_equal(back, back_gpu);
    // Overlapped use: start, then the tile overwritten on the GPU (held_in may change after
    // start: the messages were packed) while they travel, then finish.
    Tensor again, tile_gpu = tile.to(gpu());
    on_gpus.start_forward(tile_gpu, again, 0.5f);
    cuda::fill(tile_gpu.data(), tile_gpu.numel(), -9.0f);
    on_gpus.finish_forward();
    expect_equal(window, again);
  }
  // A communicator of GPU memory needs the exchange on a GPU.
  TileExchange host_over_nccl(*nccl, global, held, row_blocks(global, size, 1));
  EXPECT_THROW(host_over_nccl.set_device(Device::host()), Error);
}

TEST_F(Nccl, GradientBucketsAreReducedOnTheGpus) {
  // Three gradients in two buckets: summed over NCCL in place on the GPU, as over MPI on the host.
  GradReducerOptions options;
  options.bucket_bytes = 1024;
  GradReducer over_mpi(options), over_nccl(options);
  std::vector<Tensor> host = {values(300, rank, 60), values(7, rank, 61), values(500, rank, 62)};
  std::vector<Tensor> device;
  for (const Tensor& t : host) device.push_back(t.to(gpu()));
  for (auto& t : host) over_mpi.add(t, *mpi);
  for (auto& t : device) over_nccl.add(t, *nccl);
  over_mpi.build();
  over_nccl.build();
  EXPECT_EQ(over_nccl.bucket_count(), 2u);
  for (std::size_t i = 0; i < host.size(); ++i) {
    over_mpi.ready(host[i]);
    over_nccl.ready(device[i]);
  }
  over_mpi.finish();
  over_nccl.finish();
  for (std::size_t i = 0; i < host.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(device[i].device(), gpu());
    expect_equal(host[i], device[i]);
  }
  // A host gradient cannot be reduced over NCCL.
  GradReducer wrong;
  Tensor on_host = values(4, rank, 63);
  EXPECT_THROW(wrong.add(on_host, *nccl), Error);
}

TEST_F(Nccl, HostBuffersAndUnbuiltCallsAreRefusedClearly) {
  std::vector<float> host(8, 1.0f);
  try {
    nccl->allreduce(host.data(), host.size(), DType::F32, ReduceOp::Sum);
    FAIL() << "a host buffer was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("host memory"), std::string::npos) << error.what();
  }
  Tensor device(Shape({8}), gpu());
  EXPECT_THROW(nccl->isend(device.data(), 8, DType::F32, 0, 0), Error);
  const Message from_host{host.data(), host.size(), 0};
  EXPECT_THROW(nccl->exchange({&from_host, 1}, {}, DType::F32, 0), Error);
}

}  // namespace
}  // namespace tessera
