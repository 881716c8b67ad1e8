// Prefetcher: the batches equal direct reads, errors come back from take(), and shutting down
// with reads in flight neither hangs nor leaks (at 1-3 ranks: reads stay collective).
#include <gtest/gtest.h>

#include "io_test_util.hpp"
#include "tessera/io/dataset.hpp"
#include "tessera/io/prefetch.hpp"
#include "tessera/io/sampler.hpp"
#include "tessera/parallel/mpi_communicator.hpp"

namespace tessera {
namespace {

using namespace io_test;

class PrefetchTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new SharedTempDir();
    written_ = on_rank0([] {
      const std::vector<hsize_t> dims{29, 3, 4, 5};
      return write_file(dir_->file("u8.h5"), [&](hid_t file) {
        write_dataset(file, "images", H5T_NATIVE_UINT8, dims, byte_inputs(dims).data());
        write_dataset(file, "labels", H5T_NATIVE_INT32, {29}, labels(29).data());
      });
    });
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(written_); }
  std::shared_ptr<Dataset> open() { return open_hdf5_dataset(dir_->file("u8.h5"), *MpiCommunicator::world()); }

  static SharedTempDir* dir_;
  static bool written_;
};
SharedTempDir* PrefetchTest::dir_ = nullptr;
bool PrefetchTest::written_ = false;

std::vector<std::int64_t> my_block(const std::vector<std::int64_t>& batch) {
  const auto n = static_cast<std::int64_t>(batch.size());
  return {batch.begin() + block_begin(n, world_size(), world_rank()),
          batch.begin() + block_begin(n, world_size(), world_rank() + 1)};
}

TEST_F(PrefetchTest, SameBatchesAsDirectReads) {
  auto direct = open();
  Prefetcher prefetcher(open());
  EpochSampler sampler({.dataset_size = 29, .global_batch = 6, .seed = 77});
  const auto batches = sampler.batches_per_epoch();
  Box box = whole_sample_box(direct->info().sample_shape);
  box.begin[1] = 1;
  box.extent[1] = 2;
  // One request ahead, as a training loop would: submit k+1, then take k.
  auto request = [&](std::int64_t b) { return ReadRequest{my_block(sampler.batch(1, b)), b % 2 ? box : Box{}}; };
  prefetcher.submit(request(0));
  for (std::int64_t b = 0; b < batches; ++b) {
    if (b + 1 < batches) prefetcher.submit(request(b + 1));
    Batch batch = prefetcher.take();
    const ReadRequest expected = request(b);
    EXPECT_EQ(batch.indices, expected.indices);
    Tensor inputs, targets;
    direct->read(expected.indices, expected.box, inputs, targets);
    ASSERT_EQ(batch.inputs.shape().dims(), inputs.shape().dims());
    EXPECT_EQ(max_relative_difference(batch.inputs, inputs), 0.0);
    EXPECT_EQ(max_relative_difference(batch.targets, targets), 0.0);
    check_targets(batch.targets, batch.indices, 0);
  }
  EXPECT_EQ(prefetcher.pending(), 0u);
}

TEST_F(PrefetchTest, ReaderErrorsComeBackFromTake) {
  Prefetcher prefetcher(open());
  prefetcher.submit({{0, 1}, {}});
  prefetcher.submit({{0, 1000}, {}});  // out of range on every rank
  prefetcher.submit({{2}, {}});
  EXPECT_NO_THROW(prefetcher.take());
  EXPECT_THROW(prefetcher.take(), Error);
  Batch last = prefetcher.take();  // the reader carries on after an error
  check_targets(last.targets, {2}, 0);
  EXPECT_THROW(prefetcher.take(), Error);  // nothing submitted
}

TEST_F(PrefetchTest, DestructorFinishesSubmittedReads) {
  Prefetcher prefetcher(open());
  for (std::int64_t i = 0; i < 5; ++i) prefetcher.submit({my_block({i, i + 1, i + 2, 28}), {}});
  prefetcher.take();
  // Four reads not taken: the destructor must complete them (they are collective) and join.
}

}  // namespace
}  // namespace tessera
