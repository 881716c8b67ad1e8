#pragma once
// The MPI implementation of Communicator. mpi.h stays out of this header: the communicator is
// held as its Fortran handle and converted inside the implementation.
#include <memory>

#include "tessera/core/communicator.hpp"

namespace tessera {

class MpiCommunicator final : public Communicator {
 public:
  /// MPI_COMM_WORLD (not owned). MPI must be initialized.
  static std::shared_ptr<MpiCommunicator> world();
  ~MpiCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_; }
  int mpi_handle() const override { return handle_; }

  void barrier() override;
  void broadcast(void* data, std::size_t count, DType type, int root) override;
  void allreduce(void* data, std::size_t count, DType type, ReduceOp op) override;
  std::unique_ptr<CommRequest> iallreduce(void* data, std::size_t count, DType type, ReduceOp op) override;
  void reduce_scatter(const void* send, void* recv, std::size_t count, DType type, ReduceOp op) override;
  void allgather(const void* send, void* recv, std::size_t count, DType type) override;
  void alltoallv(const void* send, std::span<const std::int64_t> send_counts,
                 std::span<const std::int64_t> send_displs, void* recv,
                 std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                 DType type) override;
  void send(const void* data, std::size_t count, DType type, int dest, int tag) override;
  void recv(void* data, std::size_t count, DType type, int source, int tag) override;
  std::unique_ptr<CommRequest> isend(const void* data, std::size_t count, DType type, int dest, int tag) override;
  std::unique_ptr<CommRequest> irecv(void* data, std::size_t count, DType type, int source, int tag) override;
  std::unique_ptr<Communicator> split(int color, int key) const override;
  std::unique_ptr<Communicator> duplicate() const override;
  [[noreturn]] void abort(int exit_code) override;

  using Communicator::allreduce;
  using Communicator::broadcast;

 private:
  MpiCommunicator(int handle, bool owned, std::string name);
  int handle_;
  bool owned_;
  int rank_ = 0;
  int size_ = 1;
  std::string name_;
};

}  // namespace tessera
