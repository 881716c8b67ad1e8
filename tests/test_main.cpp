// The main of every Tessera test binary: starts MPI and the layers' runtime, lets only rank 0
// print, and makes every rank exit with the same code (non-zero if any rank failed).
#include <gtest/gtest.h>
#include <mpi.h>

#include "tessera/core/error.hpp"
#include "tessera/layers/runtime.hpp"

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  tessera::set_process_rank(rank);
  int result = 1;
  {
    tessera::LayersRuntime runtime(1);
    ::testing::InitGoogleTest(&argc, argv);
    if (rank != 0) {
      auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
      delete listeners.Release(listeners.default_result_printer());
    }
    result = RUN_ALL_TESTS();
  }
  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (worst != 0 && result != 0 && rank != 0) std::fprintf(stderr, "[rank %d] tests failed on this rank\n", rank);
  MPI_Finalize();
  return worst;
}
