// The Fashion-MNIST converter on tiny synthetic gzipped IDX files: values survive exactly, a
// second run keeps valid outputs, and bad inputs give clear errors on every rank.
#include <gtest/gtest.h>
#include <zlib.h>

#include <filesystem>

#include "io_test_util.hpp"
#include "tessera/io/convert.hpp"
#include "tessera/io/dataset.hpp"
#include "tessera/parallel/mpi_communicator.hpp"

namespace tessera {
namespace {

using namespace io_test;

void put_u32(std::vector<unsigned char>& bytes, std::uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) bytes.push_back(static_cast<unsigned char>(v >> shift));
}

/// A gzipped IDX file of unsigned bytes: magic, extents, data (pixel/label = byte_value(n, f)).
bool write_idx(const std::string& path, std::uint32_t magic, const std::vector<std::uint32_t>& dims) {
  std::vector<unsigned char> bytes;
  put_u32(bytes, magic);
  for (auto d : dims) put_u32(bytes, d);
  std::int64_t per = 1;
  for (std::size_t i = 1; i < dims.size(); ++i) per *= dims[i];
  for (std::int64_t n = 0; n < dims[0]; ++n)
    for (std::int64_t f = 0; f < per; ++f) {
      bytes.push_back(dims.size() == 1 ? static_cast<unsigned char>(label_value(n)) : byte_value(n, f));
    }
  gzFile file = gzopen(path.c_str(), "wb");
  if (file == nullptr) return false;
  const int written = gzwrite(file, bytes.data(), static_cast<unsigned>(bytes.size()));
  return gzclose(file) == Z_OK && written == static_cast<int>(bytes.size());
}

bool write_source(const std::string& dir, std::uint32_t image_magic = 0x803, std::uint32_t test_labels = 3) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  return write_idx(dir + "/train-images-idx3-ubyte.gz", image_magic, {5, 4, 3}) &&
         write_idx(dir + "/train-labels-idx1-ubyte.gz", 0x801, {5}) &&
         write_idx(dir + "/t10k-images-idx3-ubyte.gz", 0x803, {3, 4, 3}) &&
         write_idx(dir + "/t10k-labels-idx1-ubyte.gz", 0x801, {test_labels});
}

TEST(ConvertFashionMnist, ConvertsExactlyAndSkipsValidOutputs) {
  SharedTempDir dir;
  auto comm = MpiCommunicator::world();
  ASSERT_TRUE(on_rank0([&] { return write_source(dir.file("src")); }));
  convert_fashion_mnist(dir.file("src"), dir.file("out"), *comm);
  for (const auto& [name, n] : {std::pair{"train.h5", 5}, std::pair{"test.h5", 3}}) {
    auto dataset = open_hdf5_dataset(dir.file("out") + "/" + name, *comm);
    EXPECT_EQ(dataset->info().size, n);
    EXPECT_EQ(dataset->info().sample_shape.dims(), (std::vector<std::int64_t>{1, 4, 3}));
    std::vector<std::int64_t> all(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) all[static_cast<std::size_t>(i)] = i;
    Tensor inputs, targets;
    dataset->read(all, inputs, targets);
    check_inputs(inputs, all, dataset->info().sample_shape, whole_sample_box(dataset->info().sample_shape), true);
    check_targets(targets, all, 0);
  }
  // No temporary left behind; a second run leaves the files alone.
  std::int64_t entries = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir.file("out"))) ++entries;
  EXPECT_EQ(entries, 2);
  const auto stamp = std::filesystem::last_write_time(dir.file("out/train.h5"));
  MPI_Barrier(MPI_COMM_WORLD);
  convert_fashion_mnist(dir.file("src"), dir.file("out"), *comm);
  EXPECT_EQ(std::filesystem::last_write_time(dir.file("out/train.h5")), stamp);
}

TEST(ConvertFashionMnist, BadInputsFailOnEveryRank) {
  SharedTempDir dir;
  auto comm = MpiCommunicator::world();
  ASSERT_TRUE(on_rank0([&] {
    return write_source(dir.file("magic"), 0x802) && write_source(dir.file("count"), 0x803, 2);
  }));
  expect_input_error([&] { convert_fashion_mnist(dir.file("magic"), dir.file("out1"), *comm); },
                     {"train-images-idx3-ubyte.gz", "bad magic number 0x00000802", "0x00000803"});
  expect_input_error([&] { convert_fashion_mnist(dir.file("count"), dir.file("out2"), *comm); },
                     {"t10k-images-idx3-ubyte.gz", "3 images", "t10k-labels-idx1-ubyte.gz", "2 labels"});
  expect_input_error([&] { convert_fashion_mnist(dir.file("nowhere"), dir.file("out3"), *comm); },
                     {"train-images-idx3-ubyte.gz", "no such"});
  // Nothing half-written was left where a reader would find it.
  EXPECT_FALSE(std::filesystem::exists(dir.file("out1/train.h5")));
  EXPECT_FALSE(std::filesystem::exists(dir.file("out2/test.h5")));
}

}  // namespace
}  // namespace tessera
