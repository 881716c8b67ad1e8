// The NCCL Communicator (see tessera/parallel/nccl_communicator.hpp). Every operation goes to
// the current GPU's communication stream (cuda::comm_stream()), fenced by events against its
// compute stream (cuda::stream()): it starts after the compute queued before it, and its
// request's wait() makes later compute wait for it.
#include "tessera/parallel/nccl_communicator.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <utility>
#include <vector>
#include <string>

#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"

// ncclCommSplit with shared resources (splitShare) came with NCCL 2.18.
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "Tessera's NCCL communicator needs NCCL 2.18 or newer (ncclCommSplit with splitShare)"
#endif

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

cudaStream_t compute_stream() { return static_cast<cudaStream_t>(cuda::stream()); }
cudaStream_t communication_stream() { return static_cast<cudaStream_t>(cuda::comm_stream()); }

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) fail("CUDA: {} failed: {}", what, cudaGetErrorString(status));
}

cudaEvent_t recorded_event(cudaStream_t stream) {
  cudaEvent_t event{};
  check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  check_cuda(cudaEventRecord(event, stream), "cudaEventRecord");
  return event;
}

/// An operation queued on the communication stream. wait() makes the compute stream (of the
/// GPU that was current when it was queued) wait for it, without blocking the host;
/// wait_on_host() blocks until it finished. Destroyed unwaited, it still fences the compute
/// stream, so that its buffers can be released (see tessera/core/cuda.hpp).
class StreamRequest final : public CommRequest {
 public:
  StreamRequest(cudaStream_t compute, cudaEvent_t done) : compute_(compute), done_(done) {}
  ~StreamRequest() override {
    if (!waited_) cudaStreamWaitEvent(compute_, done_, 0);
    cudaEventDestroy(done_);  // released once the event has completed
  }
  void wait() override {
    check_cuda(cudaStreamWaitEvent(compute_, done_, 0), "cudaStreamWaitEvent (an NCCL operation)");
    waited_ = true;
  }
  void wait_on_host() {
    const cudaError_t status = cudaEventSynchronize(done_);
    if (status != cudaSuccess) fail("CUDA: an NCCL operation failed: {}", cudaGetErrorString(status));
    waited_ = true;  // finished: nothing left for the compute stream to wait for
  }
  bool test() override {
    const cudaError_t status = cudaEventQuery(done_);
    if (status == cudaErrorNotReady) {
      cudaGetLastError();  // "not ready" is no error: do not leave it for the next launch check
      return false;
    }
    if (status != cudaSuccess) fail("CUDA: an NCCL operation failed: {}", cudaGetErrorString(status));
    return true;
  }

 private:
  cudaStream_t compute_;
  cudaEvent_t done_;
  bool waited_ = false;
};

class NcclCommunicator final : public Communicator {
 public:
  /// A new NCCL communicator over the ranks of `control` (collective over it), after checking
  /// that no two of them share a GPU.
  explicit NcclCommunicator(std::unique_ptr<Communicator> control) : control_(std::move(control)) {
    check_one_gpu_per_rank();
    // Rank 0's id and whether it got one: every rank fails together when it did not.
    struct {
      ncclUniqueId id;
      int status;
    } bootstrap{};
    if (control_->rank() == 0) bootstrap.status = static_cast<int>(ncclGetUniqueId(&bootstrap.id));
    control_->broadcast(&bootstrap, sizeof(bootstrap), DType::U8, 0);
    if (bootstrap.status != ncclSuccess)
      fail("NCCL: ncclGetUniqueId failed on rank 0 of {}: {} (check NCCL_SOCKET_IFNAME and the network "
           "interfaces)", control_->name(), ncclGetErrorString(static_cast<ncclResult_t>(bootstrap.status)));
    ncclComm_t comm = nullptr;
    agree(ncclCommInitRank(&comm, control_->size(), bootstrap.id, control_->rank()), comm, "ncclCommInitRank");
    comm_ = comm;
  }
  /// A communicator NCCL made from another (split), over the ranks of `control`.
  NcclCommunicator(std::unique_ptr<Communicator> control, ncclComm_t comm) : control_(std::move(control)), comm_(comm) {}
  ~NcclCommunicator() override {
    if (comm_) ncclCommDestroy(comm_);
  }

  int rank() const override { return control_->rank(); }
  int size() const override { return control_->size(); }
  std::string name() const override { return "nccl over " + control_->name(); }
  int mpi_handle() const override { return control_->mpi_handle(); }

  bool moves_gpu_memory() const override { return true; }

  void barrier() override {
    cuda::synchronize();
    check_cuda(cudaStreamSynchronize(communication_stream()), "synchronizing the communication stream");
    control_->barrier();
  }
  void broadcast(void* data, std::size_t count, DType type, int root) override {
    if (count == 0) return;
    device_buffer(data, "broadcast");
    blocking(queue([&](cudaStream_t stream) {
      return ncclBroadcast(data, data, count, nccl_type(type), root, comm_, stream);
    }, "ncclBroadcast"));
  }
  void allreduce(void* data, std::size_t count, DType type, ReduceOp op) override {
    if (count == 0) return;
    blocking(iallreduce(data, count, type, op));
  }
  std::unique_ptr<CommRequest> iallreduce(void* data, std::size_t count, DType type, ReduceOp op) override {
    if (count > 0) device_buffer(data, "allreduce");
    return queue([&](cudaStream_t stream) {
      return count == 0 ? ncclSuccess : ncclAllReduce(data, data, count, nccl_type(type), nccl_op(op), comm_, stream);
    }, "ncclAllReduce");
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType type, ReduceOp op) override {
    if (count == 0) return;
    device_buffer(send, "reduce_scatter");
    device_buffer(recv, "reduce_scatter");
    blocking(queue([&](cudaStream_t stream) {
      return ncclReduceScatter(send, recv, count, nccl_type(type), nccl_op(op), comm_, stream);
    }, "ncclReduceScatter"));
  }
  void allgather(const void* send, void* recv, std::size_t count, DType type) override {
    if (count == 0) return;
    device_buffer(send, "allgather");
    device_buffer(recv, "allgather");
    blocking(queue([&](cudaStream_t stream) { return ncclAllGather(send, recv, count, nccl_type(type), comm_, stream); },
                   "ncclAllGather"));
  }
  void alltoallv(const void* send, std::span<const std::int64_t> send_counts, std::span<const std::int64_t> send_displs,
                 void* recv, std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                 DType type) override {
    const auto element = static_cast<std::int64_t>(dtype_size(type));
    auto* source = static_cast<char*>(const_cast<void*>(send));  // only read (Message)
    auto* destination = static_cast<char*>(recv);
    std::vector<Message> sends, receives;
    for (int peer = 0; peer < size(); ++peer) {
      const auto p = static_cast<std::size_t>(peer);
      if (send_counts[p] > 0)
        sends.push_back({source + send_displs[p] * element, static_cast<std::size_t>(send_counts[p]), peer});
      if (recv_counts[p] > 0)
        receives.push_back({destination + recv_displs[p] * element, static_cast<std::size_t>(recv_counts[p]), peer});
    }
    blocking(exchange(sends, receives, type, 0));
  }
  void send(const void* data, std::size_t count, DType type, int dest, int tag) override {
    if (count == 0) return;
    const Message message{const_cast<void*>(data), count, dest};  // only read
    blocking(exchange({&message, 1}, {}, type, tag));
  }
  void recv(void* data, std::size_t count, DType type, int source, int tag) override {
    if (count == 0) return;
    const Message message{data, count, source};
    blocking(exchange({}, {&message, 1}, type, tag));
  }
  std::unique_ptr<CommRequest> isend(const void*, std::size_t, DType, int, int) override {
    fail("NCCL communicator: isend is not offered (separate NCCL sends can deadlock); use exchange, which groups them");
  }
  std::unique_ptr<CommRequest> irecv(void*, std::size_t, DType, int, int) override {
    fail("NCCL communicator: irecv is not offered (separate NCCL receives can deadlock); use exchange, which groups "
         "them");
  }
  /// One NCCL group: every receive and send in one launch (NCCL has no tags: messages between
  /// two ranks match in the order they are given).
  std::unique_ptr<CommRequest> exchange(std::span<const Message> sends, std::span<const Message> receives, DType type,
                                        int) override {
    // Checked before the group opens.
    for (const Message& m : sends)
      if (m.count > 0) device_buffer(m.data, "exchange (a send)");
    for (const Message& m : receives)
      if (m.count > 0) device_buffer(m.data, "exchange (a receive)");
    const ncclDataType_t nccl = nccl_type(type);
    return queue([&](cudaStream_t stream) {
      ncclResult_t result = ncclGroupStart();
      if (result != ncclSuccess) return result;
      for (const Message& m : receives)
        if (m.count > 0 && result == ncclSuccess) result = ncclRecv(m.data, m.count, nccl, m.peer, comm_, stream);
      for (const Message& m : sends)
        if (m.count > 0 && result == ncclSuccess) result = ncclSend(m.data, m.count, nccl, m.peer, comm_, stream);
      const ncclResult_t ended = ncclGroupEnd();  // closes the group even after an error
      return result != ncclSuccess ? result : ended;
    }, "a grouped ncclSend/ncclRecv");
  }
  /// ncclCommSplit (collective over this communicator, like the MPI split of the control
  /// communicator, which orders ranks the same way: by key, then rank); the new communicator
  /// shares this one's resources (splitShare).
  std::unique_ptr<Communicator> split(int color, int key) const override {
    auto control = control_->split(color, key);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.splitShare = 1;
    ncclComm_t comm = nullptr;
    agree(ncclCommSplit(comm_, color, key, &comm, &config), comm, "ncclCommSplit");
    return std::make_unique<NcclCommunicator>(std::move(control), comm);
  }
  std::unique_ptr<Communicator> duplicate() const override { return split(0, rank()); }
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

  /// The result of a collective NCCL setup call (`made`: the communicator it made here, or
  /// null) on every rank of the control communicator: when it failed anywhere, every rank
  /// destroys what it made and throws an error that names the lowest failing rank and its cause,
  /// so that whichever rank reports it says what happened. (A rank that NCCL itself keeps waiting
  /// inside the setup call never gets here: NCCL's own setup has no timeout.)
  void agree(ncclResult_t result, ncclComm_t made, const char* what) const {
    const std::vector<std::int32_t> results = control_->allgather_value(static_cast<std::int32_t>(result));
    const auto failed = std::find_if(results.begin(), results.end(), [](std::int32_t r) { return r != ncclSuccess; });
    if (failed == results.end()) return;
    const std::string detail = result != ncclSuccess && ncclGetLastError(nullptr) ? ncclGetLastError(nullptr) : "";
    if (made && result == ncclSuccess) ncclCommDestroy(made);  // made here, useless alone
    const auto rank = static_cast<int>(failed - results.begin());
    fail("NCCL: {} failed on rank {} of {}: {}{}{}", what, rank, control_->name(),
         ncclGetErrorString(static_cast<ncclResult_t>(*failed)), rank == control_->rank() && !detail.empty() ? ": " : "",
         rank == control_->rank() ? detail : std::string());
  }

  /// Queues `launch` (NCCL calls on the stream it is given, returning the result) on the
  /// communication stream, after the compute queued so far; the request fences its completion.
  template <typename Launch>
  std::unique_ptr<StreamRequest> queue(Launch&& launch, const char* what) {
    const cudaStream_t compute = compute_stream();
    const cudaStream_t communication = communication_stream();
    const cudaEvent_t ready = recorded_event(compute);
    const cudaError_t waited = cudaStreamWaitEvent(communication, ready, 0);
    cudaEventDestroy(ready);  // released once recorded work completes; the wait is already queued
    check_cuda(waited, "cudaStreamWaitEvent (before an NCCL operation)");
    check(launch(communication), what);
    return std::make_unique<StreamRequest>(compute, recorded_event(communication));
  }
  /// Blocking calls: finished, GPU work included, when they return.
  static void blocking(std::unique_ptr<CommRequest> request) {
    static_cast<StreamRequest&>(*request).wait_on_host();
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
  void check_one_gpu_per_rank() const {
    if (const auto shared = ranks_sharing_a_gpu(*control_))
      fail_input("NCCL needs one GPU per rank, but ranks {} and {} of {} both use the GPU {}: run at most as "
                 "many ranks per node as it has GPUs",
                 shared->first_rank, shared->second_rank, control_->name(), shared->uuid);
  }

  std::unique_ptr<Communicator> control_;
  ncclComm_t comm_ = nullptr;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const Communicator& control) {
  TESSERA_CHECK(cuda::device_count() > 0, "the NCCL communicator needs a GPU per rank, but {}",
                cuda::unavailable_reason());
  return std::make_unique<NcclCommunicator>(control.duplicate());
}

}  // namespace tessera
