// The main of every Tessera test binary: starts MPI and the layers' runtime, lets only rank 0
// print, and makes every rank exit with the same code (non-zero if any rank failed).
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <string>

#include "tessera/core/error.hpp"
#include "tessera/layers/runtime.hpp"

namespace {
/// On ranks other than 0: prints only failed assertions, prefixed with the rank, so a failure
/// that happens on one rank alone is visible.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestStart(const ::testing::TestInfo& test) override {
    test_ = std::string(test.test_suite_name()) + "." + test.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s: %s:%d\n%s\n", rank_, test_.c_str(),
                 result.file_name() ? result.file_name() : "?", result.line_number(), result.summary());
  }

 private:
  int rank_;
  std::string test_;
};
}  // namespace

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
      listeners.Append(new FailurePrinter(rank));
    }
    result = RUN_ALL_TESTS();
  }
  int worst = 0;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (worst != 0 && result != 0 && rank != 0) std::fprintf(stderr, "[rank %d] tests failed on this rank\n", rank);
  MPI_Finalize();
  return worst;
}
