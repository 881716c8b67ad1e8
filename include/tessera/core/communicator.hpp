#pragma once
// The abstract communicator. Implementations live in parallel/ (MPI for host memory, NCCL for GPU
// memory); the interface sits in core so that every level can be handed one without MPI.
// Communicators are objects handed down to whoever needs them, never globals.
//
// Completion. A blocking call has finished when it returns. A request's wait() returns when the
// buffers may be used: for a communicator of host memory, the transfer is done; for one of GPU
// memory (moves_gpu_memory()), the transfer is ordered before every later operation queued on
// the GPU's stream (cuda::stream()), and the host synchronizes that stream before it reads the
// buffers itself. Either way the buffers stay untouched until wait() returned.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tessera/core/dtype.hpp"

namespace tessera {

enum class ReduceOp { Sum, Max, Min };

/// A nonblocking operation in flight.
class CommRequest {
 public:
  virtual ~CommRequest() = default;
  virtual void wait() = 0;
  /// Progresses the operation; true once it completed.
  virtual bool test() = 0;
  /// Abandons a receive that may never be matched (its exchange failed before the sends that
  /// would match it were posted): cancels it where the transport can, then returns once the
  /// buffer is no longer in use. Default: nothing (the destructor waits for completion).
  virtual void cancel() {}
};

/// One message of a grouped exchange (Communicator::exchange): `count` elements to or from `peer`.
/// A send's buffer is only read.
struct Message {
  void* data = nullptr;
  std::size_t count = 0;
  int peer = -1;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// A short description ("mpi world", "mpi split 3/4"...) for error messages.
  virtual std::string name() const = 0;

  virtual void barrier() = 0;
  virtual void broadcast(void* data, std::size_t count, DType type, int root) = 0;
  /// In place.
  virtual void allreduce(void* data, std::size_t count, DType type, ReduceOp op) = 0;
  virtual std::unique_ptr<CommRequest> iallreduce(void* data, std::size_t count, DType type, ReduceOp op) = 0;
  /// `send` holds size() * count elements; `recv` gets count elements (this rank's block).
  virtual void reduce_scatter(const void* send, void* recv, std::size_t count, DType type, ReduceOp op) = 0;
  /// Each rank contributes `count` elements; `recv` holds size() * count.
  virtual void allgather(const void* send, void* recv, std::size_t count, DType type) = 0;
  /// Counts and displacements are in elements.
  virtual void alltoallv(const void* send, std::span<const std::int64_t> send_counts,
                         std::span<const std::int64_t> send_displs, void* recv,
                         std::span<const std::int64_t> recv_counts,
                         std::span<const std::int64_t> recv_displs, DType type) = 0;
  virtual void send(const void* data, std::size_t count, DType type, int dest, int tag) = 0;
  virtual void recv(void* data, std::size_t count, DType type, int source, int tag) = 0;
  virtual std::unique_ptr<CommRequest> isend(const void* data, std::size_t count, DType type, int dest, int tag) = 0;
  virtual std::unique_ptr<CommRequest> irecv(void* data, std::size_t count, DType type, int source, int tag) = 0;
  /// Point to point, grouped: every receive and send at once, one request for all of them (a
  /// peer may be this rank itself). The ranks that exchange must call it in the same order. The
  /// default posts irecv and isend for each message; NCCL groups them into one launch (its
  /// separate sends could deadlock).
  virtual std::unique_ptr<CommRequest> exchange(std::span<const Message> sends, std::span<const Message> receives,
                                                DType type, int tag);

  /// Where the buffers of every operation must be: host memory (false, MPI) or GPU memory
  /// (true, NCCL). A buffer elsewhere is refused with a clear error.
  virtual bool moves_gpu_memory() const { return false; }

  /// Ranks with the same color form a new communicator, ordered by key.
  virtual std::unique_ptr<Communicator> split(int color, int key) const = 0;
  virtual std::unique_ptr<Communicator> duplicate() const = 0;

  /// The communicator as an MPI Fortran handle (MPI_Comm_c2f), for libraries that need an
  /// MPI_Comm (MPI-IO in parallel HDF5); -1 when the communicator is not MPI-based.
  virtual int mpi_handle() const = 0;

  /// Ends every rank of the job (used when one rank cannot continue).
  [[noreturn]] virtual void abort(int exit_code) = 0;

  // Typed conveniences.
  template <typename T> void allreduce(std::span<T> data, ReduceOp op = ReduceOp::Sum) {
    allreduce(data.data(), data.size(), dtype_of<T>(), op);
  }
  template <typename T> T allreduce_value(T value, ReduceOp op = ReduceOp::Sum) {
    allreduce(&value, 1, dtype_of<T>(), op);
    return value;
  }
  template <typename T> void broadcast(std::span<T> data, int root) {
    broadcast(data.data(), data.size(), dtype_of<T>(), root);
  }
  template <typename T> std::vector<T> allgather_value(T value) {
    std::vector<T> all(static_cast<std::size_t>(size()));
    allgather(&value, all.data(), 1, dtype_of<T>());
    return all;
  }
};

}  // namespace tessera
