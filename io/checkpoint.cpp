// Checkpoint files (see include/tessera/io/checkpoint.hpp and io/README.md).
#include "tessera/io/checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include <fmt/format.h>

#include "hdf5_dataset_impl.hpp"  // OwnedComm
#include "hdf5_util.hpp"
#include "io_order.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/log.hpp"

namespace tessera {
namespace fs = std::filesystem;
namespace {

constexpr const char* kFormat = "tessera-checkpoint";
constexpr const char* kFormatAttr = "format";
constexpr const char* kCompleteAttr = "complete";
constexpr const char* kChecksumAttr = "checksum";

std::uint64_t mix64(std::uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

MPI_Comm duplicate(const Communicator& comm, const std::string& path) {
  const int handle = comm.mpi_handle();
  if (handle == -1)
    fail("{}: communicator '{}' is not MPI-based; checkpoints are written through MPI-IO", path, comm.name());
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_Comm_f2c(handle), &dup);
  MPI_Comm_set_name(dup, "tessera checkpoint");
  return dup;
}

hdf5::Handle mpio_fapl(MPI_Comm comm) {
  hdf5::Handle fapl(H5Pcreate(H5P_FILE_ACCESS));
  H5Pset_fapl_mpio(fapl.get(), comm, MPI_INFO_NULL);
  H5Pset_all_coll_metadata_ops(fapl.get(), true);
  H5Pset_coll_metadata_write(fapl.get(), true);
  // Dense attribute storage (below) needs the 1.8 file format.
  H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V18, H5F_LIBVER_LATEST);
  return fapl;
}

std::uint64_t allreduce_sum(std::uint64_t value, MPI_Comm comm) {
  std::uint64_t total = 0;
  MPI_Allreduce(&value, &total, 1, MPI_UINT64_T, MPI_SUM, comm);  // unsigned: wraps mod 2^64
  return total;
}

/// Runs `work` on rank 0 only; every rank then throws rank 0's error, if any.
template <typename F> void on_rank0(MPI_Comm comm, F&& work) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  std::string error;
  int input = 0;
  if (rank == 0) {
    try {
      work();
    } catch (const InputError& e) {
      error = e.message();
      input = 1;
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  std::int64_t sizes[2] = {static_cast<std::int64_t>(error.size()), input};
  MPI_Bcast(sizes, 2, MPI_INT64_T, 0, comm);
  if (sizes[0] == 0) return;
  error.resize(static_cast<std::size_t>(sizes[0]));
  MPI_Bcast(error.data(), static_cast<int>(sizes[0]), MPI_CHAR, 0, comm);
  if (sizes[1]) throw InputError(error);
  throw Error(error);
}

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

/// Selects `box` of `space` (or nothing when `selected` is false or the box is empty).
void select_box(hid_t space, const Box& box, bool selected) {
  if (!selected || box.numel() == 0) {
    H5Sselect_none(space);
    return;
  }
  std::vector<hsize_t> start(box.begin.begin(), box.begin.end()), count(box.extent.begin(), box.extent.end());
  H5Sselect_hyperslab(space, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
}

hdf5::Handle memory_space(std::int64_t elements, bool selected) {
  const hsize_t extent = static_cast<hsize_t>(std::max<std::int64_t>(elements, 1));
  hdf5::Handle space(H5Screate_simple(1, &extent, nullptr));
  if (!selected || elements == 0) H5Sselect_none(space.get());
  return space;
}

hdf5::Handle collective_transfer() {
  hdf5::Handle transfer(H5Pcreate(H5P_DATASET_XFER));
  H5Pset_dxpl_mpio(transfer.get(), H5FD_MPIO_COLLECTIVE);
  return transfer;
}

void check_box(const std::string& path, const std::string& name, const std::vector<std::int64_t>& shape,
               const Box& box) {
  bool ok = box.begin.size() == shape.size() && box.extent.size() == shape.size();
  for (std::size_t d = 0; ok && d < shape.size(); ++d)
    ok = box.begin[d] >= 0 && box.extent[d] >= 0 && box.begin[d] + box.extent[d] <= shape[d];
  if (!ok)
    fail("{}: box [{}] + [{}] is outside tensor '{}' of shape [{}]", path, fmt::join(box.begin, ", "),
         fmt::join(box.extent, ", "), name, fmt::join(shape, ", "));
}

void write_attribute(hid_t object, const std::string& name, hid_t type, const void* value, const std::string& path) {
  if (H5Aexists(object, name.c_str()) > 0) H5Adelete(object, name.c_str());
  hdf5::Handle space(H5Screate(H5S_SCALAR));
  hdf5::Handle attribute(H5Acreate2(object, name.c_str(), type, space.get(), H5P_DEFAULT, H5P_DEFAULT));
  if (!attribute.valid() || H5Awrite(attribute.get(), type, value) < 0)
    fail("{}: cannot write attribute '{}'{}", path, name, hdf5::with_reason());
}

herr_t collect_dataset(hid_t /*object*/, const char* name, const H5O_info_t* info, void* data) {
  if (info->type == H5O_TYPE_DATASET) static_cast<std::vector<std::string>*>(data)->emplace_back(name);
  return 0;
}

}  // namespace

std::string checkpoint_name(std::int64_t step) { return fmt::format("ckpt-{:08}", step); }

std::optional<std::int64_t> checkpoint_step(const std::string& file_name) {
  const std::string prefix = "ckpt-", suffix = ".h5";
  if (file_name.size() <= prefix.size() + suffix.size() || file_name.rfind(prefix, 0) != 0 ||
      file_name.compare(file_name.size() - suffix.size(), suffix.size(), suffix) != 0)
    return std::nullopt;
  const std::string digits = file_name.substr(prefix.size(), file_name.size() - prefix.size() - suffix.size());
  if (digits.empty() || digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), ::isdigit))
    return std::nullopt;
  return std::stoll(digits);
}

std::uint64_t dataset_checksum(const std::vector<std::int64_t>& global_shape, const Box& box, const float* data) {
  const std::size_t rank = global_shape.size();
  if (rank == 0 || box.numel() == 0) return 0;
  std::vector<std::int64_t> stride(rank, 1);
  for (std::size_t d = rank - 1; d > 0; --d) stride[d - 1] = stride[d] * global_shape[d];
  const std::int64_t inner = box.extent[rank - 1];
  std::vector<std::int64_t> index(rank - 1, 0);  // odometer over the outer dimensions of the box
  std::uint64_t sum = 0;
  const float* p = data;
  while (true) {
    std::int64_t base = box.begin[rank - 1];
    for (std::size_t d = 0; d + 1 < rank; ++d) base += (box.begin[d] + index[d]) * stride[d];
    for (std::int64_t i = 0; i < inner; ++i) {
      std::uint32_t bits;
      std::memcpy(&bits, p + i, sizeof bits);
      sum += mix64(mix64(static_cast<std::uint64_t>(base + i)) ^ bits);
    }
    p += inner;
    std::size_t d = rank - 1;
    while (d > 0) {
      --d;
      if (++index[d] < box.extent[d]) break;
      index[d] = 0;
      if (d == 0) return sum;
    }
    if (rank == 1) return sum;
  }
}

// ---------------------------------------------------------------------------------------------
// Writer

struct CheckpointWriter::Impl {
  std::string dir, name, tmp_path, final_path;
  bool finished = false;
  // Destroyed in reverse: the file first, then the communicator its MPI-IO uses.
  OwnedComm comm;
  hdf5::Handle file;
};

CheckpointWriter::CheckpointWriter(const std::string& dir, const std::string& name, const Communicator& comm)
    : impl_(std::make_unique<Impl>()) {
  auto& w = *impl_;
  w.dir = dir;
  w.name = name;
  w.final_path = (fs::path(dir) / (name + ".h5")).string();
  w.tmp_path = w.final_path + ".tmp";
  io_order::Turn turn;
  hdf5::silence_errors();
  w.comm.adopt(duplicate(comm, w.tmp_path));
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (!fs::is_directory(dir, ec)) fail_input("cannot create checkpoint folder '{}'", dir);
  hdf5::Handle fapl = mpio_fapl(w.comm.get());
  hdf5::Handle fcpl(H5Pcreate(H5P_FILE_CREATE));
  H5Pset_attr_phase_change(fcpl.get(), 0, 0);  // dense attributes: no 64 KiB limit on the model text
  w.file = hdf5::Handle(H5Fcreate(w.tmp_path.c_str(), H5F_ACC_TRUNC, fcpl.get(), fapl.get()));
  if (!w.file.valid()) fail_input("{}: cannot create the checkpoint file{}", w.tmp_path, hdf5::with_reason());
  set_attribute(kFormatAttr, std::string(kFormat));
  set_attribute("format_version", std::int64_t{1});
}

CheckpointWriter::~CheckpointWriter() {
  io_order::Turn turn;
  impl_.reset();
}

const std::string& CheckpointWriter::path() const { return impl_->finished ? impl_->final_path : impl_->tmp_path; }

void CheckpointWriter::write_tensor(const std::string& name, const std::vector<std::int64_t>& global_shape,
                                   const Box& local_box, const float* local, bool this_rank_writes) {
  auto& w = *impl_;
  if (!w.file.valid()) fail("{}: write_tensor after finish()", w.final_path);
  if (global_shape.empty()) fail("{}: tensor '{}' has no dimensions", w.tmp_path, name);
  check_box(w.tmp_path, name, global_shape, local_box);
  io_order::Turn turn;
  std::vector<hsize_t> dims(global_shape.begin(), global_shape.end());
  hdf5::Handle file_space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr));
  hdf5::Handle lcpl(H5Pcreate(H5P_LINK_CREATE));
  H5Pset_create_intermediate_group(lcpl.get(), 1);
  hdf5::Handle dcpl(H5Pcreate(H5P_DATASET_CREATE));
  H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER);
  hdf5::Handle dataset(
      H5Dcreate2(w.file.get(), name.c_str(), H5T_IEEE_F32LE, file_space.get(), lcpl.get(), dcpl.get(), H5P_DEFAULT));
  if (!dataset.valid()) fail("{}: cannot create dataset '{}'{}", w.tmp_path, name, hdf5::with_reason());
  select_box(file_space.get(), local_box, this_rank_writes);
  const hdf5::Handle memory = memory_space(local_box.numel(), this_rank_writes);
  const hdf5::Handle transfer = collective_transfer();
  float unused = 0;
  const float* buffer = this_rank_writes && local_box.numel() > 0 ? local : &unused;
  if (H5Dwrite(dataset.get(), H5T_NATIVE_FLOAT, memory.get(), file_space.get(), transfer.get(), buffer) < 0)
    fail("{}: writing dataset '{}' failed{}", w.tmp_path, name, hdf5::with_reason());
  const std::uint64_t mine = this_rank_writes ? dataset_checksum(global_shape, local_box, local) : 0;
  const std::uint64_t checksum = allreduce_sum(mine, w.comm.get());
  write_attribute(dataset.get(), kChecksumAttr, H5T_NATIVE_UINT64, &checksum, w.tmp_path);
}

void CheckpointWriter::set_attribute(const std::string& name, const std::string& value) {
  auto& w = *impl_;
  io_order::Turn turn;
  hdf5::Handle type(H5Tcopy(H5T_C_S1));
  H5Tset_size(type.get(), value.size() + 1);
  H5Tset_strpad(type.get(), H5T_STR_NULLTERM);
  write_attribute(w.file.get(), name, type.get(), value.c_str(), w.tmp_path);
}

void CheckpointWriter::set_attribute(const std::string& name, std::int64_t value) {
  io_order::Turn turn;
  write_attribute(impl_->file.get(), name, H5T_NATIVE_INT64, &value, impl_->tmp_path);
}

void CheckpointWriter::set_attribute(const std::string& name, double value) {
  io_order::Turn turn;
  write_attribute(impl_->file.get(), name, H5T_NATIVE_DOUBLE, &value, impl_->tmp_path);
}

std::string CheckpointWriter::finish(int keep) {
  auto& w = *impl_;
  if (w.finished) return w.final_path;
  io_order::Turn turn;
  // The marker goes in last: a file without it was not finished (a kill during the write).
  set_attribute(kCompleteAttr, std::int64_t{1});
  if (H5Fflush(w.file.get(), H5F_SCOPE_GLOBAL) < 0) fail("{}: flush failed{}", w.tmp_path, hdf5::with_reason());
  w.file.reset();  // collective close
  on_rank0(w.comm.get(), [&] {
    fsync_path(w.tmp_path);
    std::error_code ec;
    fs::rename(w.tmp_path, w.final_path, ec);
    if (ec) fail("cannot rename '{}' to '{}': {}", w.tmp_path, w.final_path, ec.message());
    fsync_path(w.dir);
    // Only checkpoints (ckpt-<step>) are "latest" and pruned; other files (weights) are left alone.
    const auto current = checkpoint_step(w.name + ".h5");
    if (!current) return;
    const std::string latest = (fs::path(w.dir) / "latest").string();
    {
      std::ofstream out(latest + ".tmp", std::ios::trunc);
      out << w.name << ".h5\n";
      out.flush();
      if (!out) fail("cannot write '{}.tmp'", latest);
    }
    fsync_path(latest + ".tmp");
    fs::rename(latest + ".tmp", latest, ec);
    if (ec) fail("cannot rename '{}.tmp' to '{}': {}", latest, latest, ec.message());
    fsync_path(w.dir);
    // Keep the newest `keep` checkpoints; drop .tmp files older than this one (left by kills).
    std::vector<std::pair<std::int64_t, fs::path>> found;
    for (const auto& entry : fs::directory_iterator(w.dir, ec)) {
      const std::string file = entry.path().filename().string();
      if (const auto step = checkpoint_step(file)) found.emplace_back(*step, entry.path());
      if (file.size() > 4 && file.ends_with(".tmp")) {
        const auto step = checkpoint_step(file.substr(0, file.size() - 4));
        if (step && current && *step < *current) fs::remove(entry.path(), ec);
      }
    }
    std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    for (std::size_t i = static_cast<std::size_t>(std::max(keep, 0)); keep > 0 && i < found.size(); ++i)
      fs::remove(found[i].second, ec);
  });
  w.finished = true;
  return w.final_path;
}

// ---------------------------------------------------------------------------------------------
// Reader

struct CheckpointReader::Impl {
  std::string path;
  std::vector<std::string> names;
  OwnedComm comm;
  hdf5::Handle file;

  hdf5::Handle open_dataset(const std::string& name) const {
    if (!std::binary_search(names.begin(), names.end(), name))
      fail_input("{}: the checkpoint holds no tensor '{}'", path, name);
    hdf5::Handle dataset(H5Dopen2(file.get(), name.c_str(), H5P_DEFAULT));
    if (!dataset.valid()) fail_input("{}: cannot open tensor '{}'{}", path, name, hdf5::with_reason());
    return dataset;
  }
  hdf5::Handle open_attribute(const std::string& name) const {
    if (H5Aexists(file.get(), name.c_str()) <= 0) {
      H5Eclear2(H5E_DEFAULT);
      fail_input("{}: the checkpoint has no attribute '{}'", path, name);
    }
    return hdf5::Handle(H5Aopen(file.get(), name.c_str(), H5P_DEFAULT));
  }
};

CheckpointReader::CheckpointReader(const std::string& path, const Communicator& comm)
    : impl_(std::make_unique<Impl>()) {
  auto& r = *impl_;
  r.path = path;
  std::error_code ec;
  if (!fs::exists(path, ec)) fail_input("{}: no such checkpoint file", path);
  if (fs::is_directory(path, ec)) fail_input("{}: is a directory, not a checkpoint file", path);
  io_order::Turn turn;
  hdf5::silence_errors();
  try {
    r.comm.adopt(duplicate(comm, path));
    hdf5::Handle fapl = mpio_fapl(r.comm.get());
    r.file = hdf5::Handle(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()));
    if (!r.file.valid())
      fail_input("{}: cannot open as an HDF5 file (not HDF5, or truncated){}", path, hdf5::with_reason());
    if (!has_attribute(kFormatAttr) || string_attribute(kFormatAttr) != kFormat)
      fail_input("{}: not a Tessera checkpoint (no '{}' attribute '{}')", path, kFormatAttr, kFormat);
    if (H5Ovisit(r.file.get(), H5_INDEX_NAME, H5_ITER_INC, collect_dataset, &r.names) < 0)
      fail_input("{}: cannot list the checkpoint's tensors{}", path, hdf5::with_reason());
    std::sort(r.names.begin(), r.names.end());
  } catch (...) {
    impl_.reset();
    throw;
  }
}

CheckpointReader::~CheckpointReader() {
  io_order::Turn turn;
  impl_.reset();
}

const std::string& CheckpointReader::path() const { return impl_->path; }
std::vector<std::string> CheckpointReader::tensor_names() const { return impl_->names; }
bool CheckpointReader::has_tensor(const std::string& name) const {
  return std::binary_search(impl_->names.begin(), impl_->names.end(), name);
}

std::vector<std::int64_t> CheckpointReader::tensor_shape(const std::string& name) const {
  io_order::Turn turn;
  const hdf5::Handle dataset = impl_->open_dataset(name);
  const hdf5::Handle space(H5Dget_space(dataset.get()));
  const auto dims = hdf5::extents(space.get());
  return {dims.begin(), dims.end()};
}

void CheckpointReader::read_tensor(const std::string& name, const Box& local_box, float* out) {
  auto& r = *impl_;
  io_order::Turn turn;
  const hdf5::Handle dataset = r.open_dataset(name);
  const hdf5::Handle file_space(H5Dget_space(dataset.get()));
  const auto dims = hdf5::extents(file_space.get());
  const std::vector<std::int64_t> shape(dims.begin(), dims.end());
  bool ok = local_box.begin.size() == shape.size() && local_box.extent.size() == shape.size();
  for (std::size_t d = 0; ok && d < shape.size(); ++d)
    ok = local_box.begin[d] >= 0 && local_box.extent[d] >= 0 && local_box.begin[d] + local_box.extent[d] <= shape[d];
  if (!ok)
    fail_input("{}: tensor '{}' has shape [{}]; it does not hold the box [{}] + [{}] asked for", r.path, name,
               fmt::join(shape, ", "), fmt::join(local_box.begin, ", "), fmt::join(local_box.extent, ", "));
  select_box(file_space.get(), local_box, true);
  const hdf5::Handle memory = memory_space(local_box.numel(), true);
  const hdf5::Handle transfer = collective_transfer();
  float unused = 0;
  if (H5Dread(dataset.get(), H5T_NATIVE_FLOAT, memory.get(), file_space.get(), transfer.get(),
              local_box.numel() > 0 ? out : &unused) < 0)
    fail_input("{}: reading tensor '{}' failed{}", r.path, name, hdf5::with_reason());
}

void CheckpointReader::verify() {
  auto& r = *impl_;
  io_order::Turn turn;
  if (!has_attribute(kCompleteAttr) || int_attribute(kCompleteAttr) != 1)
    fail_input("{}: incomplete checkpoint (no '{}' marker: the job was probably stopped while writing it)", r.path,
               kCompleteAttr);
  int rank = 0, size = 1;
  MPI_Comm_rank(r.comm.get(), &rank);
  MPI_Comm_size(r.comm.get(), &size);
  std::vector<float> buffer;
  for (const auto& name : r.names) {
    const hdf5::Handle dataset = r.open_dataset(name);
    if (H5Aexists(dataset.get(), kChecksumAttr) <= 0) {
      H5Eclear2(H5E_DEFAULT);
      fail_input("{}: tensor '{}' has no checksum", r.path, name);
    }
    std::uint64_t stored = 0;
    {
      const hdf5::Handle attribute(H5Aopen(dataset.get(), kChecksumAttr, H5P_DEFAULT));
      if (H5Aread(attribute.get(), H5T_NATIVE_UINT64, &stored) < 0)
        fail_input("{}: cannot read the checksum of tensor '{}'{}", r.path, name, hdf5::with_reason());
    }
    const hdf5::Handle space(H5Dget_space(dataset.get()));
    const auto dims = hdf5::extents(space.get());
    const std::vector<std::int64_t> shape(dims.begin(), dims.end());
    if (shape.empty()) fail_input("{}: tensor '{}' is not an array", r.path, name);
    // This rank's block along the first dimension that every rank gets a part of (else the
    // largest), so that no rank reads a whole tensor that a split holds in blocks.
    std::size_t d = 0;
    while (d < shape.size() && shape[d] < size) ++d;
    if (d == shape.size()) d = static_cast<std::size_t>(std::max_element(shape.begin(), shape.end()) - shape.begin());
    Box box;
    box.begin.assign(shape.size(), 0);
    box.extent = shape;
    box.begin[d] = block_begin(shape[d], size, rank);
    box.extent[d] = block_extent(shape[d], size, rank);
    buffer.resize(static_cast<std::size_t>(std::max<std::int64_t>(box.numel(), 1)));
    read_tensor(name, box, buffer.data());
    const std::uint64_t computed = allreduce_sum(dataset_checksum(shape, box, buffer.data()), r.comm.get());
    if (computed != stored)
      fail_input("{}: tensor '{}' is corrupt (checksum {:016x}, stored {:016x})", r.path, name, computed, stored);
  }
}

bool CheckpointReader::has_attribute(const std::string& name) const {
  io_order::Turn turn;
  const htri_t exists = H5Aexists(impl_->file.get(), name.c_str());
  H5Eclear2(H5E_DEFAULT);
  return exists > 0;
}

std::string CheckpointReader::string_attribute(const std::string& name) const {
  io_order::Turn turn;
  const hdf5::Handle attribute = impl_->open_attribute(name);
  const hdf5::Handle type(H5Aget_type(attribute.get()));
  if (H5Tget_class(type.get()) != H5T_STRING || H5Tis_variable_str(type.get()) > 0)
    fail_input("{}: attribute '{}' is not a fixed-length string", impl_->path, name);
  std::string value(H5Tget_size(type.get()), '\0');
  if (H5Aread(attribute.get(), type.get(), value.data()) < 0)
    fail_input("{}: cannot read attribute '{}'{}", impl_->path, name, hdf5::with_reason());
  value.resize(std::strlen(value.c_str()));
  return value;
}

std::int64_t CheckpointReader::int_attribute(const std::string& name) const {
  io_order::Turn turn;
  const hdf5::Handle attribute = impl_->open_attribute(name);
  std::int64_t value = 0;
  if (H5Aread(attribute.get(), H5T_NATIVE_INT64, &value) < 0)
    fail_input("{}: cannot read attribute '{}' as an integer{}", impl_->path, name, hdf5::with_reason());
  return value;
}

double CheckpointReader::double_attribute(const std::string& name) const {
  io_order::Turn turn;
  const hdf5::Handle attribute = impl_->open_attribute(name);
  double value = 0;
  if (H5Aread(attribute.get(), H5T_NATIVE_DOUBLE, &value) < 0)
    fail_input("{}: cannot read attribute '{}' as a number{}", impl_->path, name, hdf5::with_reason());
  return value;
}

std::pair<std::int64_t, std::int64_t> CheckpointReader::tensor_file_extent(const std::string& name) const {
  io_order::Turn turn;
  const hdf5::Handle dataset = impl_->open_dataset(name);
  const haddr_t offset = H5Dget_offset(dataset.get());
  const hsize_t size = H5Dget_storage_size(dataset.get());
  H5Eclear2(H5E_DEFAULT);
  if (offset == HADDR_UNDEF) return {-1, 0};
  return {static_cast<std::int64_t>(offset), static_cast<std::int64_t>(size)};
}

std::optional<std::string> find_resume_checkpoint(const std::string& dir, const Communicator& comm) {
  // Rank 0 lists the folder and tells the others, so every rank tries the same files in the same order.
  std::string listing;
  {
    io_order::Turn turn;
    OwnedComm dup;
    dup.adopt(duplicate(comm, dir));
    int rank = 0;
    MPI_Comm_rank(dup.get(), &rank);
    if (rank == 0) {
      std::error_code ec;
      std::vector<std::pair<std::int64_t, std::string>> found;
      std::string latest;
      if (std::ifstream in((fs::path(dir) / "latest").string()); in) std::getline(in, latest);
      for (const auto& entry : fs::directory_iterator(dir, ec)) {
        const std::string file = entry.path().filename().string();
        if (const auto step = checkpoint_step(file)) found.emplace_back(*step, file);
      }
      // Newest step first; `latest` names the newest complete one, so it wins a tie.
      std::sort(found.begin(), found.end(), [&](const auto& a, const auto& b) {
        if (a.first != b.first) return a.first > b.first;
        return (a.second == latest) > (b.second == latest);
      });
      for (const auto& [step, file] : found) listing += (fs::path(dir) / file).string() + "\n";
    }
    std::int64_t size = static_cast<std::int64_t>(listing.size());
    MPI_Bcast(&size, 1, MPI_INT64_T, 0, dup.get());
    listing.resize(static_cast<std::size_t>(size));
    if (size > 0) MPI_Bcast(listing.data(), static_cast<int>(size), MPI_CHAR, 0, dup.get());
  }
  std::size_t begin = 0;
  while (begin < listing.size()) {
    const std::size_t end = listing.find('\n', begin);
    const std::string path = listing.substr(begin, end - begin);
    begin = end + 1;
    try {
      CheckpointReader reader(path, comm);
      reader.verify();
      return path;
    } catch (const InputError& e) {
      log_message(LogLevel::Warn, fmt::format("skipping checkpoint: {}", e.message()));
    }
  }
  return std::nullopt;
}

}  // namespace tessera
