// The HDF5 dataset at 1-4 ranks: files written with the C API and with h5py read back exactly,
// each rank reading its block of shuffled batches, spatial boxes, duplicates, empty ranks, and
// every bad-input message.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <memory>

#include "io_test_util.hpp"
#include "tessera/io/dataset.hpp"
#include "tessera/io/hdf5_dataset.hpp"
#include "tessera/io/sampler.hpp"
#include "tessera/parallel/mpi_communicator.hpp"

namespace tessera {
namespace {

using namespace io_test;

struct FileCase {
  const char* name;
  bool bytes;             // uint8 inputs (else float)
  std::int64_t width;     // 0: class labels, else regression targets per sample
  std::vector<std::int64_t> sample;
};

const std::vector<FileCase>& file_cases() {
  static const std::vector<FileCase> cases = {
      {"c_u8.h5", true, 0, {2, 5, 6}},
      {"c_f32.h5", false, 3, {1, 3, 4, 5}},
      {"py_u8.h5", true, 0, {1, 6, 7}},
      {"py_f32.h5", false, 2, {2, 3, 4, 5}},
      {"py_f64.h5", false, 0, {1, 4, 4}},
  };
  return cases;
}

class Hdf5DatasetTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new SharedTempDir();
    written_ = on_rank0([] {
      const std::vector<hsize_t> u8{23, 2, 5, 6}, f32{17, 1, 3, 4, 5};
      bool ok = write_file(dir_->file("c_u8.h5"), [&](hid_t file) {
        write_dataset(file, "images", H5T_NATIVE_UINT8, u8, byte_inputs(u8).data());
        write_dataset(file, "labels", H5T_NATIVE_INT32, {23}, labels(23).data());
      });
      ok = ok && write_file(dir_->file("c_f32.h5"), [&](hid_t file) {
        write_dataset(file, "data", H5T_NATIVE_FLOAT, f32, float_inputs(f32).data());
        write_dataset(file, "targets", H5T_NATIVE_FLOAT, {17, 3}, targets(17, 3).data());
      });
      // Bad files, one fault each.
      const std::vector<hsize_t> small{5, 1, 2, 2};
      ok = ok && write_file(dir_->file("no_inputs.h5"), [&](hid_t file) {
        write_dataset(file, "foo", H5T_NATIVE_FLOAT, small, float_inputs(small).data());
        write_dataset(file, "bar", H5T_NATIVE_INT32, {5}, labels(5).data());
      });
      ok = ok && write_file(dir_->file("mismatch.h5"), [&](hid_t file) {
        write_dataset(file, "images", H5T_NATIVE_UINT8, small, byte_inputs(small).data());
        write_dataset(file, "labels", H5T_NATIVE_INT32, {4}, labels(4).data());
      });
      ok = ok && write_file(dir_->file("rank3.h5"), [&](hid_t file) {
        write_dataset(file, "images", H5T_NATIVE_UINT8, {5, 2, 2}, byte_inputs({5, 2, 2}).data());
      });
      ok = ok && write_file(dir_->file("int16.h5"), [&](hid_t file) {
        const std::vector<std::int16_t> data(20, 1);
        write_dataset(file, "images", H5T_NATIVE_INT16, small, data.data());
      });
      ok = ok && write_file(dir_->file("float_labels.h5"), [&](hid_t file) {
        write_dataset(file, "images", H5T_NATIVE_UINT8, small, byte_inputs(small).data());
        write_dataset(file, "labels", H5T_NATIVE_FLOAT, {5}, targets(5, 1).data());
      });
      ok = ok && write_file(dir_->file("no_targets.h5"), [&](hid_t file) {
        write_dataset(file, "images", H5T_NATIVE_UINT8, small, byte_inputs(small).data());
      });
      std::ofstream(dir_->file("not_hdf5.h5")) << "not an HDF5 file\n";
      return ok;
    });
    // h5py is part of the contract (users write their data with it): missing Python or h5py is
    // a failure, not a skip.
    python_ok_ = on_rank0([] {
      const std::string command = std::string("/usr/bin/python3 ") + TESSERA_SOURCE_DIR +
                                  "/tests/io/write_test_files.py " + dir_->path();
      return std::system(command.c_str()) == 0;
    });
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    ASSERT_TRUE(written_) << "rank 0 could not write the test files";
    ASSERT_TRUE(python_ok_) << "/usr/bin/python3 with h5py could not write the test files (Debian: python3-h5py-mpi)";
  }
  std::shared_ptr<Communicator> world() { return MpiCommunicator::world(); }
  static SharedTempDir* dir_;
  static bool written_;
  static bool python_ok_;
};
SharedTempDir* Hdf5DatasetTest::dir_ = nullptr;
bool Hdf5DatasetTest::written_ = false;
bool Hdf5DatasetTest::python_ok_ = false;

std::vector<std::int64_t> my_block(const std::vector<std::int64_t>& batch, const Communicator& comm) {
  const auto n = static_cast<std::int64_t>(batch.size());
  return {batch.begin() + block_begin(n, comm.size(), comm.rank()),
          batch.begin() + block_begin(n, comm.size(), comm.rank() + 1)};
}

TEST_F(Hdf5DatasetTest, InfoDescribesTheFile) {
  auto comm = world();
  for (const auto& c : file_cases()) {
    SCOPED_TRACE(c.name);
    auto dataset = open_hdf5_dataset(dir_->file(c.name), *comm);
    const auto& info = dataset->info();
    EXPECT_EQ(info.path, dir_->file(c.name));
    EXPECT_EQ(info.sample_shape.dims(), c.sample);
    EXPECT_EQ(info.sample_shape.kind(0), DimKind::Channel);
    for (int i = 1; i < info.sample_shape.rank(); ++i) EXPECT_EQ(info.sample_shape.kind(i), DimKind::Spatial);
    EXPECT_TRUE(info.has_labels);
    EXPECT_EQ(info.target_shape.rank(), c.width == 0 ? 0 : 1);
    if (c.width > 0) {
      EXPECT_EQ(info.target_shape[0], c.width);
    }
  }
}

TEST_F(Hdf5DatasetTest, EachRankReadsItsBlockOfShuffledBatches) {
  auto comm = world();
  for (const auto& c : file_cases()) {
    SCOPED_TRACE(c.name);
    auto dataset = open_hdf5_dataset(dir_->file(c.name), *comm);
    const auto& info = dataset->info();
    EpochSampler sampler({.dataset_size = info.size, .global_batch = 7, .seed = 5, .shuffle = true});
    Tensor inputs, targets;
    for (std::int64_t epoch = 0; epoch < 2; ++epoch) {
      for (std::int64_t b = 0; b < sampler.batches_per_epoch(); ++b) {
        const auto indices = my_block(sampler.batch(epoch, b), *comm);
        dataset->read(indices, inputs, targets);
        check_inputs(inputs, indices, info.sample_shape, whole_sample_box(info.sample_shape), c.bytes);
        check_targets(targets, indices, c.width);
        EXPECT_TRUE(dynamic_cast<Hdf5Dataset&>(*dataset).last_read_collective());
      }
    }
  }
}

TEST_F(Hdf5DatasetTest, DuplicatesAreReadOnceAndEmptyRanksJoin) {
  auto comm = world();
  for (const auto& c : file_cases()) {
    SCOPED_TRACE(c.name);
    auto dataset = open_hdf5_dataset(dir_->file(c.name), *comm);
    auto& hdf5 = dynamic_cast<Hdf5Dataset&>(*dataset);
    const auto& info = dataset->info();
    // Rank 0 asks for duplicates out of order; the last rank (when not rank 0) for nothing.
    std::vector<std::int64_t> indices;
    std::int64_t unique = 0;
    if (comm->rank() == 0) {
      indices = {3, 1, 3, 0, info.size - 1, 1};
      unique = 4;
    } else if (comm->rank() != comm->size() - 1) {
      indices = {2};
      unique = 1;
    }
    Tensor inputs, targets;
    dataset->read(indices, inputs, targets);
    check_inputs(inputs, indices, info.sample_shape, whole_sample_box(info.sample_shape), c.bytes);
    check_targets(targets, indices, c.width);
    EXPECT_EQ(hdf5.last_read_elements(), unique * info.sample_shape.numel());
  }
}

TEST_F(Hdf5DatasetTest, BoxReadsOnlyTheBox) {
  auto comm = world();
  for (const char* name : {"c_u8.h5", "py_f32.h5", "py_u8.h5"}) {
    SCOPED_TRACE(name);
    const auto& c = *std::find_if(file_cases().begin(), file_cases().end(),
                                  [&](const FileCase& f) { return std::string(f.name) == name; });
    auto dataset = open_hdf5_dataset(dir_->file(name), *comm);
    auto& hdf5 = dynamic_cast<Hdf5Dataset&>(*dataset);
    const Shape& sample = dataset->info().sample_shape;
    // Each rank its own tile: H split over the ranks (as a spatially parallel input layer
    // would), the last channel only, W without its first column.
    const int h = sample.rank() - 2;
    Box box = whole_sample_box(sample);
    box.begin[0] = sample[0] - 1;
    box.extent[0] = 1;
    const int parts = std::min<int>(comm->size(), static_cast<int>(sample[h]));
    const int part = comm->rank() % parts;
    box.begin[static_cast<std::size_t>(h)] = block_begin(sample[h], parts, part);
    box.extent[static_cast<std::size_t>(h)] = block_extent(sample[h], parts, part);
    box.begin.back() = 1;
    box.extent.back() = sample[h + 1] - 1;

    EpochSampler sampler({.dataset_size = dataset->info().size, .global_batch = 6, .seed = 11});
    auto indices = sampler.batch(1, 0);
    indices.push_back(indices.front());  // a duplicate costs nothing more
    Tensor inputs, targets;
    dataset->read(indices, box, inputs, targets);
    check_inputs(inputs, indices, sample, box, c.bytes);
    check_targets(targets, indices, c.width);
    EXPECT_EQ(hdf5.last_read_elements(), box.numel() * 6);
    EXPECT_LT(box.numel(), sample.numel());
  }
}

TEST_F(Hdf5DatasetTest, SortedRequestsAndReusedTensors) {
  auto comm = world();
  auto dataset = open_hdf5_dataset(dir_->file("c_f32.h5"), *comm);
  const auto& info = dataset->info();
  EpochSampler sampler({.dataset_size = info.size, .global_batch = 8, .shuffle = false});
  Tensor inputs, targets;
  for (std::int64_t b = 0; b < sampler.batches_per_epoch(); ++b) {  // 8, 8, then a partial 1
    const auto indices = my_block(sampler.batch(0, b), *comm);
    dataset->read(indices, inputs, targets);
    check_inputs(inputs, indices, info.sample_shape, whole_sample_box(info.sample_shape), false);
    check_targets(targets, indices, 3);
  }
}

TEST_F(Hdf5DatasetTest, BadRequestOnOneRankThrowsThereWithoutHangingTheOthers) {
  auto comm = world();
  auto dataset = open_hdf5_dataset(dir_->file("c_u8.h5"), *comm);
  const auto& info = dataset->info();
  Tensor inputs, targets;
  std::vector<std::int64_t> indices{0, 1};
  if (comm->rank() == 0) indices.push_back(info.size);
  if (comm->rank() == 0) {
    EXPECT_THROW(dataset->read(indices, inputs, targets), Error);
  } else {
    dataset->read(indices, inputs, targets);
    check_inputs(inputs, indices, info.sample_shape, whole_sample_box(info.sample_shape), true);
  }
  // A box that does not fit the samples fails the same way.
  Box bad = whole_sample_box(info.sample_shape);
  if (comm->rank() == 0) bad.extent[1] += 1;
  if (comm->rank() == 0) {
    EXPECT_THROW(dataset->read(std::vector<std::int64_t>{2}, bad, inputs, targets), Error);
  } else {
    dataset->read(std::vector<std::int64_t>{2}, bad, inputs, targets);
  }
  // The dataset still works for everyone afterwards.
  const std::vector<std::int64_t> good{4, 2};
  dataset->read(good, inputs, targets);
  check_inputs(inputs, good, info.sample_shape, whole_sample_box(info.sample_shape), true);
}

TEST_F(Hdf5DatasetTest, OptionsNameTheDatasets) {
  auto comm = world();
  auto dataset = open_hdf5_dataset(dir_->file("no_inputs.h5"), *comm, {.inputs = "foo", .targets = "bar"});
  auto& hdf5 = dynamic_cast<Hdf5Dataset&>(*dataset);
  EXPECT_EQ(hdf5.inputs_name(), "foo");
  EXPECT_EQ(hdf5.targets_name(), "bar");
  EXPECT_EQ(dataset->info().size, 5);
  EXPECT_EQ(dataset->info().target_shape.rank(), 0);  // integer: class labels
  Tensor inputs, targets;
  const std::vector<std::int64_t> indices{4, 0};
  dataset->read(indices, inputs, targets);
  check_inputs(inputs, indices, dataset->info().sample_shape, whole_sample_box(dataset->info().sample_shape), false);
  check_targets(targets, indices, 0);
}

TEST_F(Hdf5DatasetTest, DatasetWithoutTargets) {
  auto comm = world();
  auto dataset = open_hdf5_dataset(dir_->file("no_targets.h5"), *comm);
  EXPECT_FALSE(dataset->info().has_labels);
  Tensor inputs, targets;
  const std::vector<std::int64_t> indices{1, 2, 3};
  dataset->read(indices, inputs, targets);
  check_inputs(inputs, indices, dataset->info().sample_shape, whole_sample_box(dataset->info().sample_shape), true);
  EXPECT_EQ(targets.shape().dims(), (std::vector<std::int64_t>{3, 0}));
}

TEST_F(Hdf5DatasetTest, BadInputsSayWhatIsWrong) {
  auto comm = world();
  const auto open = [&](const std::string& name, Hdf5DatasetOptions options = {}) {
    return [&comm, path = dir_->file(name), options] { open_hdf5_dataset(path, *comm, options); };
  };
  expect_input_error(open("missing.h5"), {dir_->file("missing.h5"), "no such"});
  expect_input_error(open("not_hdf5.h5"), {dir_->file("not_hdf5.h5"), "cannot open as an HDF5 file", "signature"});
  expect_input_error(open("no_inputs.h5"), {dir_->file("no_inputs.h5"), "'images' or 'data'", "foo", "bar"});
  expect_input_error(open("no_inputs.h5", {.inputs = "pixels"}), {dir_->file("no_inputs.h5"), "'pixels'", "foo"});
  expect_input_error(open("no_inputs.h5", {.inputs = "foo", .targets = "classes"}),
                     {dir_->file("no_inputs.h5"), "'classes'", "bar"});
  expect_input_error(open("mismatch.h5"),
                     {dir_->file("mismatch.h5"), "'labels'", "4 entries", "'images'", "5 samples"});
  expect_input_error(open("rank3.h5"), {dir_->file("rank3.h5"), "'images'", "3 dimensions", "N x C x H x W"});
  expect_input_error(open("int16.h5"), {dir_->file("int16.h5"), "'images'", "int16", "uint8", "float32"});
  expect_input_error(open("float_labels.h5"), {dir_->file("float_labels.h5"), "'labels'", "float32", "integer"});
}

}  // namespace
}  // namespace tessera
