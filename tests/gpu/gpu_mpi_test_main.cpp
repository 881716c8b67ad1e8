// The main of the multi-rank GPU tests: one GPU per rank, chosen from the node-local rank.
// Where two ranks would share a GPU (compared by UUID) or there is none, every rank exits with
// 77 after rank 0 printed why, which ctest reports as Skipped, never as Passed. Built with
// TESSERA_GPU_TESTS_MAY_SHARE_GPUS (tests whose messages go through host memory, not NCCL),
// ranks may share a GPU: then several ranks run on one GPU.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/layers/runtime.hpp"

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, local_rank = 0, local_size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  MPI_Comm_rank(node, &local_rank);
  MPI_Comm_size(node, &local_size);
  MPI_Comm_free(&node);
  tessera::set_process_rank(rank);
  const int gpus = tessera::cuda::device_count();
  int fewest = 0;
  MPI_Allreduce(&gpus, &fewest, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  // Each rank's GPU by UUID (device numbers repeat under per-rank CUDA_VISIBLE_DEVICES).
  std::string uuid(32, '-');
  if (fewest > 0) uuid = tessera::cuda::device_uuid(local_rank % gpus);
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<char> all(uuid.size() * static_cast<std::size_t>(size));
  MPI_Allgather(uuid.data(), static_cast<int>(uuid.size()), MPI_CHAR, all.data(), static_cast<int>(uuid.size()),
                MPI_CHAR, MPI_COMM_WORLD);
  std::set<std::string> distinct;
  for (int r = 0; r < size; ++r) distinct.insert(std::string(all.data() + uuid.size() * static_cast<std::size_t>(r), uuid.size()));
#ifdef TESSERA_GPU_TESTS_MAY_SHARE_GPUS
  constexpr bool may_share = true;
#else
  constexpr bool may_share = false;
#endif
  if (fewest == 0 || (!may_share && static_cast<int>(distinct.size()) < size)) {
    if (rank == 0) {
      if (fewest == 0)
        std::printf("SKIPPED: no GPU to test on: %s\n", tessera::cuda::unavailable_reason().c_str());
      else
        std::printf("SKIPPED: %d ranks share %zu GPU(s) (%d ranks on a node with %d): these tests need one GPU per rank\n",
                    size, distinct.size(), local_size, gpus);
    }
    MPI_Finalize();
    return 77;
  }
  int result = 1;
  try {
    const int device = tessera::cuda::select_device_for_local_rank(local_rank);
    if (rank == 0) std::printf("rank 0 on GPU %d: %s\n", device, tessera::cuda::describe_device(device).c_str());
    tessera::LayersRuntime runtime(1);
    ::testing::InitGoogleTest(&argc, argv);
    if (rank != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
    }
    result = RUN_ALL_TESTS();
  } catch (const std::exception& error) {
    std::fprintf(stderr, "[rank %d] GPU tests could not start: %s\n", rank, error.what());
  }
  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (result != 0) std::fprintf(stderr, "[rank %d] tests failed on this rank\n", rank);
  MPI_Finalize();
  return worst;
}
