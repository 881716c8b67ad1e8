#pragma once
// The NCCL implementation of Communicator, for buffers in GPU memory. MPI stays for control: a
// companion MPI communicator of the same ranks broadcasts NCCL's unique id, splits groups and
// aborts the job; the sub-communicator structure is the MPI one's (split() splits both).
// No NCCL or CUDA types here; a build without CUDA refuses with a clear error.
//
// Streams. Every operation runs on the GPU's communication stream (cuda::comm_stream()), after
// the compute queued before it on cuda::stream(), so a nonblocking one overlaps the compute queued
// after it. Semantics as the interface states them: a blocking call has finished (its GPU work
// included) when it returns; a request's wait() (iallreduce, exchange) orders the operation before
// later compute without blocking the host. NCCL has no tags: messages between two ranks match in
// the order they are issued. Point to point goes through exchange(), one NCCL group per call
// (send and recv are exchanges of one message); separate isend/irecv are refused with a clear
// error, since separate NCCL sends can deadlock where MPI's would not.
#include <memory>
#include <optional>
#include <string>

#include "tessera/core/communicator.hpp"

namespace tessera {

/// Two ranks of `comm` that use the same GPU (each rank's current GPU, compared by UUID: device
/// numbers repeat under per-rank CUDA_VISIBLE_DEVICES), the lowest such pair, with the GPU's UUID;
/// none when every rank has its own. Collective over `comm`; every rank gets the same answer.
struct SharedGpu {
  int first_rank = -1, second_rank = -1;
  std::string uuid;
};
std::optional<SharedGpu> ranks_sharing_a_gpu(Communicator& comm);

/// One GPU per rank: the current GPU of each rank (cuda::set_device) joins. Collective over
/// `control`; refuses when two ranks of a node would share a GPU (NCCL cannot), naming them.
std::unique_ptr<Communicator> make_nccl_communicator(const Communicator& control);

}  // namespace tessera
