#pragma once
// The abstract communicator. Implementations live in parallel/ (MPI now, NCCL later); the
// interface sits in core so that ProcGrid (tensor level) can hold communicators without MPI.
// Communicators are objects handed down to whoever needs them, never globals.
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
