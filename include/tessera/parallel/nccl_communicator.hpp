#pragma once
// The NCCL implementation of Communicator, for buffers in GPU memory. MPI stays for control: a
// companion MPI communicator of the same ranks broadcasts NCCL's unique id, splits groups and
// aborts the job; the sub-communicator structure is the MPI one's (split() splits both).
// No NCCL or CUDA types here; a build without CUDA refuses with a clear error.
//
// Semantics as the interface states them: a blocking call has finished (its GPU work included)
// when it returns; iallreduce returns a request whose wait() waits for the GPU. NCCL has no
// tags: sends and receives between two ranks match in the order they are issued.
// isend/irecv are not offered yet (separate NCCL sends on one stream can deadlock where MPI's
// would not): they refuse with a clear error; alltoallv, which groups its transfers, is the way
// to exchange with several peers.
#include <memory>

#include "tessera/core/communicator.hpp"

namespace tessera {

/// One GPU per rank: the current GPU of each rank (cuda::set_device) joins. Collective over
/// `control`; refuses when two ranks of a node would share a GPU (NCCL cannot), naming them.
std::unique_ptr<Communicator> make_nccl_communicator(const Communicator& control);

}  // namespace tessera
