#pragma once
// Helpers of the io tests: a temporary folder shared by all ranks, small HDF5 files written with
// the C API by rank 0, and the formulas that define every value in them (so a reader can check
// each element exactly).
#include <hdf5.h>
#include <mpi.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "expect_input_error.hpp"
#include "tessera/core/error.hpp"
#include "tessera/tensor/box.hpp"
#include "tessera/tensor/tensor.hpp"

namespace tessera::io_test {

inline int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

inline int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

/// A folder made by rank 0 (unique per job, so concurrent ctest runs do not collide), known to
/// every rank, removed at the end.
class SharedTempDir {
 public:
  SharedTempDir() {
    std::string path;
    if (world_rank() == 0) {
      path = (std::filesystem::temp_directory_path() /
              ("tessera_io_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++)))
                 .string();
      std::filesystem::create_directories(path);
    }
    int length = static_cast<int>(path.size());
    MPI_Bcast(&length, 1, MPI_INT, 0, MPI_COMM_WORLD);
    path.resize(static_cast<std::size_t>(length));
    MPI_Bcast(path.data(), length, MPI_CHAR, 0, MPI_COMM_WORLD);
    path_ = path;
  }
  ~SharedTempDir() {
    MPI_Barrier(MPI_COMM_WORLD);
    std::error_code ec;
    if (world_rank() == 0) std::filesystem::remove_all(path_, ec);
  }
  SharedTempDir(const SharedTempDir&) = delete;
  SharedTempDir& operator=(const SharedTempDir&) = delete;
  std::string file(const std::string& name) const { return (std::filesystem::path(path_) / name).string(); }
  const std::string& path() const { return path_; }

 private:
  static int& counter() {
    static int value = 0;
    return value;
  }
  std::string path_;
};

/// Runs `write` on rank 0 only; every rank returns after it finished, and all of them see
/// whether it succeeded.
inline bool on_rank0(const std::function<bool()>& write) {
  int ok = 1;
  if (world_rank() == 0) ok = write() ? 1 : 0;
  MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return ok == 1;
}

// The values of the test files. `f` is the element's flat index within its sample.
inline std::uint8_t byte_value(std::int64_t n, std::int64_t f) {
  return static_cast<std::uint8_t>((n * 37 + f * 11) % 251);
}
inline float float_value(std::int64_t n, std::int64_t f) {
  return static_cast<float>(n) * 1000.0f + static_cast<float>(f) * 0.5f;
}
inline std::int64_t label_value(std::int64_t n) { return (n * 7 + 3) % 10; }
inline float target_value(std::int64_t n, std::int64_t t) {
  return static_cast<float>(n) * 10.0f + static_cast<float>(t) + 0.25f;
}

/// Writes a dataset of `type` (file and memory type) with extents `dims`.
inline void write_dataset(hid_t file, const char* name, hid_t type, const std::vector<hsize_t>& dims,
                          const void* data) {
  hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
  hid_t dataset = H5Dcreate2(file, name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  H5Dwrite(dataset, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data);
  H5Dclose(dataset);
  H5Sclose(space);
}

inline std::int64_t product(const std::vector<hsize_t>& dims, std::size_t from = 1) {
  std::int64_t p = 1;
  for (std::size_t i = from; i < dims.size(); ++i) p *= static_cast<std::int64_t>(dims[i]);
  return p;
}

/// Inputs following byte_value (uint8) or float_value (float32), N = dims[0].
inline std::vector<std::uint8_t> byte_inputs(const std::vector<hsize_t>& dims) {
  std::vector<std::uint8_t> data;
  for (std::int64_t n = 0; n < static_cast<std::int64_t>(dims[0]); ++n)
    for (std::int64_t f = 0; f < product(dims); ++f) data.push_back(byte_value(n, f));
  return data;
}
inline std::vector<float> float_inputs(const std::vector<hsize_t>& dims) {
  std::vector<float> data;
  for (std::int64_t n = 0; n < static_cast<std::int64_t>(dims[0]); ++n)
    for (std::int64_t f = 0; f < product(dims); ++f) data.push_back(float_value(n, f));
  return data;
}
inline std::vector<std::int32_t> labels(std::int64_t count) {
  std::vector<std::int32_t> data;
  for (std::int64_t n = 0; n < count; ++n) data.push_back(static_cast<std::int32_t>(label_value(n)));
  return data;
}
inline std::vector<float> targets(std::int64_t count, std::int64_t width) {
  std::vector<float> data;
  for (std::int64_t n = 0; n < count; ++n)
    for (std::int64_t t = 0; t < width; ++t) data.push_back(target_value(n, t));
  return data;
}

/// Creates `path` with the given writer (serial HDF5, called on one rank).
inline bool write_file(const std::string& path, const std::function<void(hid_t)>& write) {
  hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (file < 0) return false;
  write(file);
  return H5Fclose(file) >= 0;
}

/// Checks every element of `inputs` (n x box extents) against the formula of the file's samples
/// of shape `sample`: byte_value / 255 when `bytes`, else float_value.
inline void check_inputs(const Tensor& inputs, const std::vector<std::int64_t>& indices, const Shape& sample,
                         const Box& box, bool bytes) {
  const auto n = static_cast<std::int64_t>(indices.size());
  std::vector<std::int64_t> expected_dims{n};
  expected_dims.insert(expected_dims.end(), box.extent.begin(), box.extent.end());
  ASSERT_EQ(inputs.shape().dims(), expected_dims);
  const int rank = sample.rank();
  std::vector<std::int64_t> strides(static_cast<std::size_t>(rank), 1);
  for (int d = rank - 2; d >= 0; --d) {
    strides[static_cast<std::size_t>(d)] = strides[static_cast<std::size_t>(d) + 1] * sample[d + 1];
  }
  const std::int64_t box_numel = box.numel();
  std::int64_t wrong = 0;
  for (std::int64_t r = 0; r < n; ++r) {
    for (std::int64_t k = 0; k < box_numel; ++k) {
      std::int64_t rest = k, f = 0;
      for (int d = rank - 1; d >= 0; --d) {
        const auto e = box.extent[static_cast<std::size_t>(d)];
        f += (box.begin[static_cast<std::size_t>(d)] + rest % e) * strides[static_cast<std::size_t>(d)];
        rest /= e;
      }
      const std::int64_t index = indices[static_cast<std::size_t>(r)];
      const float expected = bytes ? static_cast<float>(byte_value(index, f)) / 255.0f : float_value(index, f);
      const float got = inputs.data()[r * box_numel + k];
      if (got != expected && wrong++ < 5) {
        ADD_FAILURE() << "sample " << index << " (row " << r << ") element " << k << ": got " << got << ", expected "
                      << expected;
      }
    }
  }
  EXPECT_EQ(wrong, 0);
}

/// Checks class labels (`width` 0) or regression targets (n x width).
inline void check_targets(const Tensor& targets, const std::vector<std::int64_t>& indices, std::int64_t width) {
  const auto n = static_cast<std::int64_t>(indices.size());
  if (width == 0) {
    ASSERT_EQ(targets.shape().dims(), std::vector<std::int64_t>{n});
  } else {
    ASSERT_EQ(targets.shape().dims(), (std::vector<std::int64_t>{n, width}));
  }
  for (std::int64_t r = 0; r < n; ++r) {
    const auto index = indices[static_cast<std::size_t>(r)];
    if (width == 0) {
      EXPECT_EQ(targets.data()[r], static_cast<float>(label_value(index))) << "sample " << index;
    } else {
      for (std::int64_t t = 0; t < width; ++t) {
        EXPECT_EQ(targets.data()[r * width + t], target_value(index, t)) << "sample " << index << " target " << t;
      }
    }
  }
}

}  // namespace tessera::io_test
