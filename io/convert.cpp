// Fashion-MNIST IDX -> HDF5. Rank 0 converts (70 000 small images take well under a second; a
// collective write would only add coordination) while the others wait in the broadcast of its
// outcome, so every rank returns or throws the same error.
#include "tessera/io/convert.hpp"

#include <unistd.h>

#include <filesystem>

#include <fmt/format.h>

#include "hdf5_util.hpp"
#include "idx.hpp"
#include "io_order.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/log.hpp"

namespace tessera {
namespace {

namespace fs = std::filesystem;

struct Split {
  const char* output;  // file name in the output folder
  const char* prefix;  // IDX file prefix in the source folder
};
constexpr Split kSplits[] = {{"train.h5", "train"}, {"test.h5", "t10k"}};

std::string images_file(const std::string& dir, const Split& split) {
  return (fs::path(dir) / fmt::format("{}-images-idx3-ubyte.gz", split.prefix)).string();
}
std::string labels_file(const std::string& dir, const Split& split) {
  return (fs::path(dir) / fmt::format("{}-labels-idx1-ubyte.gz", split.prefix)).string();
}

/// Whether `path` is a finished conversion: images uint8 N x 1 x R x C and labels uint8 N,
/// with N, R, C as in `image_dims` (from the source header) when known.
bool valid_output(const std::string& path, const std::vector<std::int64_t>& image_dims) {
  if (!fs::exists(path)) return false;
  hdf5::Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
  if (!file.valid() || !hdf5::dataset_exists(file.get(), "images") || !hdf5::dataset_exists(file.get(), "labels")) {
    H5Eclear2(H5E_DEFAULT);
    return false;
  }
  auto check = [&](const char* name, std::size_t rank) -> std::vector<hsize_t> {
    hdf5::Handle dataset(H5Dopen2(file.get(), name, H5P_DEFAULT));
    hdf5::Handle type(H5Dget_type(dataset.get()));
    hdf5::Handle space(H5Dget_space(dataset.get()));
    auto dims = hdf5::extents(space.get());
    const bool ok = H5Tget_class(type.get()) == H5T_INTEGER && H5Tget_size(type.get()) == 1 && dims.size() == rank;
    return ok ? dims : std::vector<hsize_t>{};
  };
  const auto images = check("images", 4);
  const auto labels = check("labels", 1);
  if (images.empty() || labels.empty() || images[1] != 1 || images[0] != labels[0]) return false;
  if (image_dims.empty()) return true;
  return static_cast<std::int64_t>(images[0]) == image_dims[0] &&
         static_cast<std::int64_t>(images[2]) == image_dims[1] &&
         static_cast<std::int64_t>(images[3]) == image_dims[2];
}

void write_uint8(hid_t file, const std::string& path, const char* name, const std::vector<hsize_t>& dims,
                 const std::vector<std::uint8_t>& data) {
  hdf5::Handle space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr));
  hdf5::Handle dataset(H5Dcreate2(file, name, H5T_STD_U8LE, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
  if (!dataset.valid() || H5Dwrite(dataset.get(), H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data()) < 0) {
    fail_input("{}: cannot write dataset '{}'{}", path, name, hdf5::with_reason());
  }
}

void convert_split(const std::string& source_dir, const std::string& output_dir, const Split& split) {
  const std::string output = (fs::path(output_dir) / split.output).string();
  const std::string images_path = images_file(source_dir, split), labels_path = labels_file(source_dir, split);
  const bool have_source = fs::exists(images_path);
  const auto header = have_source ? read_idx_header(images_path, 3) : std::vector<std::int64_t>{};
  if (valid_output(output, header)) {
    log_info("{} exists and is valid: not converting it again", output);
    return;
  }
  const IdxArray images = read_idx(images_path, 3);
  const IdxArray labels = read_idx(labels_path, 1);
  if (images.dims[0] != labels.dims[0]) {
    fail_input("{} holds {} images but {} holds {} labels", images_path, images.dims[0], labels_path, labels.dims[0]);
  }

  // Written under a temporary name and renamed: a reader never sees a half-written file, and a
  // crash leaves only the temporary behind (overwritten by the next run).
  const std::string temporary = fmt::format("{}.tmp.{}", output, ::getpid());
  {
    hdf5::Handle file(H5Fcreate(temporary.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
    if (!file.valid()) fail_input("{}: cannot create{}", temporary, hdf5::with_reason());
    const auto n = static_cast<hsize_t>(images.dims[0]);
    write_uint8(file.get(), temporary, "images",
                {n, 1, static_cast<hsize_t>(images.dims[1]), static_cast<hsize_t>(images.dims[2])}, images.data);
    write_uint8(file.get(), temporary, "labels", {n}, labels.data);
  }
  std::error_code ec;
  fs::rename(temporary, output, ec);
  if (ec) {
    fs::remove(temporary, ec);
    fail_input("{}: cannot rename the converted file into place", output);
  }
  log_info("converted {} + {} -> {} ({} images of {}x{})", images_path, labels_path, output, images.dims[0],
           images.dims[1], images.dims[2]);
}

}  // namespace

void convert_fashion_mnist(const std::string& source_dir, const std::string& output_dir, const Communicator& comm) {
  std::int32_t status = 0;  // 0 ok, 1 InputError, 2 other error
  std::string message;
  if (comm.rank() == 0) {
    io_order::Turn turn;  // HDF5 is not thread-safe: wait for any read in flight
    hdf5::silence_errors();
    try {
      std::error_code ec;
      fs::create_directories(output_dir, ec);
      if (ec) fail_input("{}: cannot create the output folder ({})", output_dir, ec.message());
      for (const auto& split : kSplits) convert_split(source_dir, output_dir, split);
    } catch (const Error& error) {
      status = dynamic_cast<const InputError*>(&error) != nullptr ? 1 : 2;
      message = error.message();
    } catch (const std::exception& error) {
      status = 2;
      message = error.what();
    }
  }
  // The broadcast is also the barrier: the other ranks return only once the files are in place.
  // It runs on a duplicate, so it can never match a collective the caller has in flight.
  const auto own = comm.duplicate();
  own->broadcast(&status, 1, DType::I32, 0);
  if (status == 0) return;
  auto length = static_cast<std::int64_t>(message.size());
  own->broadcast(&length, 1, DType::I64, 0);
  message.resize(static_cast<std::size_t>(length));
  own->broadcast(message.data(), message.size(), DType::U8, 0);
  if (status == 1) throw InputError(message);
  throw Error(message);
}

}  // namespace tessera
