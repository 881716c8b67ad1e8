#include "tessera/parallel/mpi_communicator.hpp"

#include <mpi.h>

#include <limits>
#include <vector>

#include "tessera/core/error.hpp"

namespace tessera {
namespace {

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::F32: return MPI_FLOAT;
    case DType::F64: return MPI_DOUBLE;
    case DType::I32: return MPI_INT32_T;
    case DType::I64: return MPI_INT64_T;
    case DType::U8: return MPI_UINT8_T;
  }
  fail("unknown dtype");
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return MPI_SUM;
    case ReduceOp::Max: return MPI_MAX;
    case ReduceOp::Min: return MPI_MIN;
  }
  fail("unknown reduce op");
}

int to_int(std::size_t count, const char* what) {
  TESSERA_CHECK(count <= static_cast<std::size_t>(std::numeric_limits<int>::max()),
                "{}: {} elements exceed MPI's int count", what, count);
  return static_cast<int>(count);
}

void check(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  fail("{} failed: {}", what, std::string(text, static_cast<std::size_t>(length)));
}

class MpiRequest final : public CommRequest {
 public:
  explicit MpiRequest(MPI_Request request) : request_(request) {}
  ~MpiRequest() override {
    if (request_ != MPI_REQUEST_NULL) MPI_Wait(&request_, MPI_STATUS_IGNORE);
  }
  void wait() override { check(MPI_Wait(&request_, MPI_STATUS_IGNORE), "MPI_Wait"); }
  bool test() override {
    int done = 0;
    check(MPI_Test(&request_, &done, MPI_STATUS_IGNORE), "MPI_Test");
    return done != 0;
  }
  /// For receives (MPI_Cancel of a send is deprecated): cancelled, or completed if it matched.
  void cancel() override {
    if (request_ == MPI_REQUEST_NULL) return;
    MPI_Cancel(&request_);
    MPI_Wait(&request_, MPI_STATUS_IGNORE);
  }

 private:
  MPI_Request request_;
};

MPI_Comm comm_of(int handle) { return MPI_Comm_f2c(handle); }

std::vector<int> to_ints(std::span<const std::int64_t> values) {
  std::vector<int> out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) out[i] = to_int(static_cast<std::size_t>(values[i]), "alltoallv");
  return out;
}

}  // namespace

std::shared_ptr<MpiCommunicator> MpiCommunicator::world() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  TESSERA_CHECK(initialized, "MpiCommunicator::world before MPI_Init");
  return std::shared_ptr<MpiCommunicator>(new MpiCommunicator(MPI_Comm_c2f(MPI_COMM_WORLD), false, "world"));
}

MpiCommunicator::MpiCommunicator(int handle, bool owned, std::string name)
    : handle_(handle), owned_(owned), name_(std::move(name)) {
  MPI_Comm_set_errhandler(comm_of(handle_), MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_of(handle_), &rank_);
  MPI_Comm_size(comm_of(handle_), &size_);
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owned_ && !finalized) {
    MPI_Comm comm = comm_of(handle_);
    MPI_Comm_free(&comm);
  }
}

void MpiCommunicator::barrier() { check(MPI_Barrier(comm_of(handle_)), "MPI_Barrier"); }

void MpiCommunicator::broadcast(void* data, std::size_t count, DType type, int root) {
  check(MPI_Bcast(data, to_int(count, "broadcast"), mpi_type(type), root, comm_of(handle_)), "MPI_Bcast");
}

void MpiCommunicator::allreduce(void* data, std::size_t count, DType type, ReduceOp op) {
  if (size_ == 1) return;
  check(MPI_Allreduce(MPI_IN_PLACE, data, to_int(count, "allreduce"), mpi_type(type), mpi_op(op), comm_of(handle_)),
        "MPI_Allreduce");
}

std::unique_ptr<CommRequest> MpiCommunicator::iallreduce(void* data, std::size_t count, DType type, ReduceOp op) {
  MPI_Request request = MPI_REQUEST_NULL;
  if (size_ > 1)
    check(MPI_Iallreduce(MPI_IN_PLACE, data, to_int(count, "iallreduce"), mpi_type(type), mpi_op(op),
                         comm_of(handle_), &request),
          "MPI_Iallreduce");
  return std::make_unique<MpiRequest>(request);
}

void MpiCommunicator::reduce_scatter(const void* send, void* recv, std::size_t count, DType type, ReduceOp op) {
  check(MPI_Reduce_scatter_block(send, recv, to_int(count, "reduce_scatter"), mpi_type(type), mpi_op(op),
                                 comm_of(handle_)),
        "MPI_Reduce_scatter_block");
}

void MpiCommunicator::allgather(const void* send, void* recv, std::size_t count, DType type) {
  const int n = to_int(count, "allgather");
  check(MPI_Allgather(send, n, mpi_type(type), recv, n, mpi_type(type), comm_of(handle_)), "MPI_Allgather");
}

void MpiCommunicator::alltoallv(const void* send, std::span<const std::int64_t> send_counts,
                                std::span<const std::int64_t> send_displs, void* recv,
                                std::span<const std::int64_t> recv_counts,
                                std::span<const std::int64_t> recv_displs, DType type) {
  const auto sc = to_ints(send_counts), sd = to_ints(send_displs), rc = to_ints(recv_counts), rd = to_ints(recv_displs);
  check(MPI_Alltoallv(send, sc.data(), sd.data(), mpi_type(type), recv, rc.data(), rd.data(), mpi_type(type),
                      comm_of(handle_)),
        "MPI_Alltoallv");
}

void MpiCommunicator::send(const void* data, std::size_t count, DType type, int dest, int tag) {
  check(MPI_Send(data, to_int(count, "send"), mpi_type(type), dest, tag, comm_of(handle_)), "MPI_Send");
}

void MpiCommunicator::recv(void* data, std::size_t count, DType type, int source, int tag) {
  check(MPI_Recv(data, to_int(count, "recv"), mpi_type(type), source, tag, comm_of(handle_), MPI_STATUS_IGNORE),
        "MPI_Recv");
}

std::unique_ptr<CommRequest> MpiCommunicator::isend(const void* data, std::size_t count, DType type, int dest, int tag) {
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Isend(data, to_int(count, "isend"), mpi_type(type), dest, tag, comm_of(handle_), &request), "MPI_Isend");
  return std::make_unique<MpiRequest>(request);
}

std::unique_ptr<CommRequest> MpiCommunicator::irecv(void* data, std::size_t count, DType type, int source, int tag) {
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Irecv(data, to_int(count, "irecv"), mpi_type(type), source, tag, comm_of(handle_), &request), "MPI_Irecv");
  return std::make_unique<MpiRequest>(request);
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key) const {
  MPI_Comm out = MPI_COMM_NULL;
  check(MPI_Comm_split(comm_of(handle_), color, key, &out), "MPI_Comm_split");
  return std::unique_ptr<Communicator>(
      new MpiCommunicator(MPI_Comm_c2f(out), true, name_ + "/split" + std::to_string(color)));
}

std::unique_ptr<Communicator> MpiCommunicator::duplicate() const {
  MPI_Comm out = MPI_COMM_NULL;
  check(MPI_Comm_dup(comm_of(handle_), &out), "MPI_Comm_dup");
  return std::unique_ptr<Communicator>(new MpiCommunicator(MPI_Comm_c2f(out), true, name_ + "/dup"));
}

void MpiCommunicator::abort(int exit_code) {
  MPI_Abort(comm_of(handle_), exit_code);
  std::_Exit(exit_code);
}

}  // namespace tessera
