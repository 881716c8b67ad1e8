// The NCCL communicator against the MPI one: every collective on GPU buffers gives what the
// MPI communicator gives on the same host data (exactly, for integers and for sums of values
// that add without rounding), split groups included; host buffers are refused clearly.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/parallel/mpi_communicator.hpp"
#include "tessera/parallel/nccl_communicator.hpp"
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
}

}  // namespace
}  // namespace tessera
