// The NCCL Communicator (see tessera/parallel/nccl_communicator.hpp). Every operation goes to
// cuda::stream() of the current GPU.
#include "tessera/parallel/nccl_communicator.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <utility>
#include <vector>
#include <string>

#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"

namespace tessera {
namespace {

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
    case DType::U8: return ncclUint8;
  }
  fail("unknown dtype");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  fail("unknown reduce op");
}

cudaStream_t current_stream() { return static_cast<cudaStream_t>(cuda::stream()); }

/// Events for nonblocking collectives: wait() waits for the GPU work queued before it.
class EventRequest final : public CommRequest {
 public:
  EventRequest() {
    if (cudaEventCreateWithFlags(&event_, cudaEventDisableTiming) != cudaSuccess) fail("CUDA: cudaEventCreate failed");
    if (cudaEventRecord(event_, current_stream()) != cudaSuccess) fail("CUDA: cudaEventRecord failed");
  }
  ~EventRequest() override {
    cudaEventSynchronize(event_);
    cudaEventDestroy(event_);
  }
  void wait() override {
    const cudaError_t status = cudaEventSynchronize(event_);
    if (status != cudaSuccess) fail("CUDA: a nonblocking NCCL collective failed: {}", cudaGetErrorString(status));
  }
  bool test() override {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) {
      cudaGetLastError();  // "not ready" is no error: do not leave it for the next launch check
      return false;
    }
    if (status != cudaSuccess) fail("CUDA: a nonblocking NCCL collective failed: {}", cudaGetErrorString(status));
    return true;
  }

 private:
  cudaEvent_t event_{};
};

class NcclCommunicator final : public Communicator {
 public:
  /// `check_gpus`: whether to check that no two ranks share a GPU (a split or duplicate of a
  /// checked communicator need not check again).
  NcclCommunicator(std::unique_ptr<Communicator> control, bool check_gpus) : control_(std::move(control)) {
    if (check_gpus) check_one_gpu_per_rank();
    ncclUniqueId id{};
    if (control_->rank() == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    control_->broadcast(&id, sizeof(id), DType::U8, 0);
    check(ncclCommInitRank(&comm_, control_->size(), id, control_->rank()), "ncclCommInitRank");
  }
  ~NcclCommunicator() override {
    if (comm_) ncclCommDestroy(comm_);
  }

  int rank() const override { return control_->rank(); }
  int size() const override { return control_->size(); }
  std::string name() const override { return "nccl over " + control_->name(); }
  int mpi_handle() const override { return control_->mpi_handle(); }

  void barrier() override {
    cuda::synchronize();
    control_->barrier();
  }
  void broadcast(void* data, std::size_t count, DType type, int root) override {
    if (count == 0) return;
    device_buffer(data, "broadcast");
    check(ncclBroadcast(data, data, count, nccl_type(type), root, comm_, current_stream()), "ncclBroadcast");
    cuda::synchronize();
  }
  void allreduce(void* data, std::size_t count, DType type, ReduceOp op) override {
    if (count == 0) return;
    enqueue_allreduce(data, count, type, op);
    cuda::synchronize();
  }
  std::unique_ptr<CommRequest> iallreduce(void* data, std::size_t count, DType type, ReduceOp op) override {
    if (count > 0) enqueue_allreduce(data, count, type, op);
    return std::make_unique<EventRequest>();
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType type, ReduceOp op) override {
    if (count == 0) return;
    device_buffer(send, "reduce_scatter");
    device_buffer(recv, "reduce_scatter");
    check(ncclReduceScatter(send, recv, count, nccl_type(type), nccl_op(op), comm_, current_stream()),
          "ncclReduceScatter");
    cuda::synchronize();
  }
  void allgather(const void* send, void* recv, std::size_t count, DType type) override {
    if (count == 0) return;
    device_buffer(send, "allgather");
    device_buffer(recv, "allgather");
    check(ncclAllGather(send, recv, count, nccl_type(type), comm_, current_stream()), "ncclAllGather");
    cuda::synchronize();
  }
  void alltoallv(const void* send, std::span<const std::int64_t> send_counts, std::span<const std::int64_t> send_displs,
                 void* recv, std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                 DType type) override {
    const auto element = static_cast<std::int64_t>(dtype_size(type));
    const auto* source = static_cast<const char*>(send);
    auto* destination = static_cast<char*>(recv);
    // Checked before the group opens: an error inside it would leave the group open.
    std::int64_t sent = 0, received = 0;
    for (int peer = 0; peer < size(); ++peer) {
      sent += send_counts[static_cast<std::size_t>(peer)];
      received += recv_counts[static_cast<std::size_t>(peer)];
    }
    if (sent > 0) device_buffer(source, "alltoallv");
    if (received > 0) device_buffer(destination, "alltoallv");
    const ncclDataType_t nccl = nccl_type(type);
    const cudaStream_t stream = current_stream();
    check(ncclGroupStart(), "ncclGroupStart");
    for (int peer = 0; peer < size(); ++peer) {
      const auto p = static_cast<std::size_t>(peer);
      if (send_counts[p] > 0)
        check(ncclSend(source + send_displs[p] * element, static_cast<std::size_t>(send_counts[p]), nccl, peer, comm_,
                       stream),
              "ncclSend");
      if (recv_counts[p] > 0)
        check(ncclRecv(destination + recv_displs[p] * element, static_cast<std::size_t>(recv_counts[p]), nccl, peer,
                       comm_, stream),
              "ncclRecv");
    }
    check(ncclGroupEnd(), "ncclGroupEnd");
    cuda::synchronize();
  }
  void send(const void* data, std::size_t count, DType type, int dest, int) override {
    if (count == 0) return;
    device_buffer(data, "send");
    check(ncclSend(data, count, nccl_type(type), dest, comm_, current_stream()), "ncclSend");
    cuda::synchronize();
  }
  void recv(void* data, std::size_t count, DType type, int source, int) override {
    if (count == 0) return;
    device_buffer(data, "recv");
    check(ncclRecv(data, count, nccl_type(type), source, comm_, current_stream()), "ncclRecv");
    cuda::synchronize();
  }
  std::unique_ptr<CommRequest> isend(const void*, std::size_t, DType, int, int) override {
    fail("NCCL communicator: isend is not built yet (separate NCCL sends can deadlock); use alltoallv");
  }
  std::unique_ptr<CommRequest> irecv(void*, std::size_t, DType, int, int) override {
    fail("NCCL communicator: irecv is not built yet (separate NCCL receives can deadlock); use alltoallv");
  }
  std::unique_ptr<Communicator> split(int color, int key) const override {
    return std::make_unique<NcclCommunicator>(control_->split(color, key), false);
  }
  std::unique_ptr<Communicator> duplicate() const override {
    return std::make_unique<NcclCommunicator>(control_->duplicate(), false);
  }
  [[noreturn]] void abort(int exit_code) override {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
    control_->abort(exit_code);
    std::abort();  // not reached: the MPI abort ends the process
  }

 private:
  void check(ncclResult_t result, const char* what) const {
    if (result == ncclSuccess) return;
    const char* detail = comm_ ? ncclGetLastError(comm_) : ncclGetLastError(nullptr);
    fail("NCCL: {} failed on {}: {}{}{}", what, name(), ncclGetErrorString(result), detail && *detail ? ": " : "",
         detail ? detail : "");
  }

  void enqueue_allreduce(void* data, std::size_t count, DType type, ReduceOp op) {
    device_buffer(data, "allreduce");
    check(ncclAllReduce(data, data, count, nccl_type(type), nccl_op(op), comm_, current_stream()), "ncclAllReduce");
  }

  /// NCCL moves GPU memory only; a host pointer is a caller's mistake, named clearly.
  void device_buffer(const void* pointer, const char* what) const {
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) cudaGetLastError();
    if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged)
      fail("NCCL communicator {}: {} got a buffer in host memory; NCCL moves GPU buffers (use the MPI communicator "
           "for host data)",
           name(), what);
  }

  /// Two ranks on one GPU cannot share an NCCL communicator: say which ranks, before NCCL fails.
  /// GPUs are compared by UUID (device numbers repeat under per-rank CUDA_VISIBLE_DEVICES).
  void check_one_gpu_per_rank() const {
    const std::string mine = cuda::device_uuid(cuda::current_device());
    std::vector<char> all(mine.size() * static_cast<std::size_t>(size()));
    control_->allgather(mine.data(), all.data(), mine.size(), DType::U8);
    // (uuid, rank) sorted: two ranks on one GPU end up next to each other.
    std::vector<std::pair<std::string, int>> gpus;
    for (int r = 0; r < size(); ++r)
      gpus.emplace_back(std::string(all.data() + mine.size() * static_cast<std::size_t>(r), mine.size()), r);
    std::sort(gpus.begin(), gpus.end());
    for (std::size_t i = 1; i < gpus.size(); ++i)
      if (gpus[i].first == gpus[i - 1].first)
        fail_input("NCCL needs one GPU per rank, but ranks {} and {} of {} both use the GPU {}: run at most as "
                   "many ranks per node as it has GPUs",
                   gpus[i - 1].second, gpus[i].second, control_->name(), gpus[i].first);
  }

  std::unique_ptr<Communicator> control_;
  ncclComm_t comm_ = nullptr;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const Communicator& control) {
  TESSERA_CHECK(cuda::device_count() > 0, "the NCCL communicator needs a GPU per rank, but {}",
                cuda::unavailable_reason());
  return std::make_unique<NcclCommunicator>(control.duplicate(), true);
}

}  // namespace tessera
