// Opening an HDF5 dataset file and checking it against the layout of io/README.md. Every check
// here sees the same metadata on every rank, so all ranks fail (or succeed) together.
#include <filesystem>

#include <fmt/format.h>

#include "hdf5_dataset_impl.hpp"
#include "io_order.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/log.hpp"

namespace tessera {
namespace {

std::string holds(hid_t file) {
  const auto names = hdf5::list_names(file);
  if (names.empty()) return "the file is empty";
  return fmt::format("the file holds: {}", fmt::join(names, ", "));
}

/// The first of `candidates` that names a dataset, or empty.
std::string find_first(hid_t file, std::initializer_list<const char*> candidates) {
  for (const char* name : candidates) {
    if (hdf5::dataset_exists(file, name)) return name;
  }
  return {};
}

hdf5::Handle open_dataset(hid_t file, const std::string& path, const std::string& name) {
  hdf5::Handle dataset(H5Dopen2(file, name.c_str(), H5P_DEFAULT));
  if (!dataset.valid()) fail_input("{}: cannot open dataset '{}'{}", path, name, hdf5::with_reason());
  return dataset;
}

}  // namespace

Hdf5Dataset::Hdf5Dataset(const std::string& path, const Communicator& comm, const Hdf5DatasetOptions& options)
    : impl_(std::make_unique<Impl>()) {
  auto& d = *impl_;
  d.info.path = path;

  // Checked before any collective call, so a missing file is one clear message on every rank.
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) fail_input("{}: no such dataset file", path);
  if (std::filesystem::is_directory(path, ec)) fail_input("{}: is a directory, not an HDF5 dataset file", path);

  io_order::Turn turn;
  hdf5::silence_errors();
  try {
    open_layout(path, comm, options);
  } catch (...) {
    impl_.reset();  // closes what was opened (collectively) while this thread still has the turn
    throw;
  }
}

void Hdf5Dataset::open_layout(const std::string& path, const Communicator& comm, const Hdf5DatasetOptions& options) {
  auto& d = *impl_;
  const int handle = comm.mpi_handle();
  if (handle == -1) {
    fail("{}: communicator '{}' is not MPI-based; HDF5 datasets read through MPI-IO", path, comm.name());
  }
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_Comm_f2c(handle), &dup);
  MPI_Comm_set_name(dup, "tessera io");
  d.comm.adopt(dup);

  hdf5::Handle fapl(H5Pcreate(H5P_FILE_ACCESS));
  H5Pset_fapl_mpio(fapl.get(), d.comm.get(), MPI_INFO_NULL);
  // One rank reads the metadata and broadcasts it, instead of every rank hitting the file
  // system for it (the metadata storm of thousands of ranks opening one file).
  H5Pset_all_coll_metadata_ops(fapl.get(), true);
  d.file = hdf5::Handle(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()));
  if (!d.file.valid()) fail_input("{}: cannot open as an HDF5 file{}", path, hdf5::with_reason());
  const hid_t file = d.file.get();

  // Inputs.
  if (!options.inputs.empty()) {
    d.inputs_name = options.inputs;
    if (!hdf5::dataset_exists(file, d.inputs_name)) {
      fail_input("{}: no inputs dataset '{}' (named by the options); {}", path, d.inputs_name, holds(file));
    }
  } else {
    d.inputs_name = find_first(file, {"images", "data"});
    if (d.inputs_name.empty()) fail_input("{}: no inputs dataset ('images' or 'data'); {}", path, holds(file));
  }
  d.inputs = open_dataset(file, path, d.inputs_name);
  hdf5::Handle input_space(H5Dget_space(d.inputs.get()));
  const auto dims = hdf5::extents(input_space.get());
  if (dims.size() != 4 && dims.size() != 5) {
    fail_input("{}: inputs dataset '{}' has shape {} ({} dimensions); expected N x C x H x W or N x C x D x H x W "
               "(add a channel axis for single-channel images)",
               path, d.inputs_name, hdf5::extents_string(dims), dims.size());
  }
  hdf5::Handle input_type(H5Dget_type(d.inputs.get()));
  const auto input_number = number_of(input_type.get());
  // float64 (numpy's default) is accepted too, and converted after reading.
  if (input_number == Number::U8 || input_number == Number::F32 || input_number == Number::F64) {
    d.input_number = *input_number;
  } else {
    fail_input("{}: inputs dataset '{}' has unsupported dtype {}; use uint8 (scaled by 1/255) or float32", path,
               d.inputs_name, hdf5::type_name(input_type.get()));
  }
  d.info.size = static_cast<std::int64_t>(dims[0]);
  std::vector<std::int64_t> sample_dims;
  std::vector<DimKind> kinds;
  for (std::size_t i = 1; i < dims.size(); ++i) {
    sample_dims.push_back(static_cast<std::int64_t>(dims[i]));
    kinds.push_back(i == 1 ? DimKind::Channel : DimKind::Spatial);
  }
  d.info.sample_shape = Shape(std::move(sample_dims), std::move(kinds));

  // Targets: class labels (integers) or regression targets (floats), or none.
  const bool named = !options.targets.empty();
  d.targets_name = named ? options.targets : find_first(file, {"labels", "targets"});
  if (named && !hdf5::dataset_exists(file, d.targets_name)) {
    fail_input("{}: no targets dataset '{}' (named by the options); {}", path, d.targets_name, holds(file));
  }
  if (!d.targets_name.empty()) {
    d.targets = open_dataset(file, path, d.targets_name);
    hdf5::Handle target_space(H5Dget_space(d.targets.get()));
    hdf5::Handle target_type(H5Dget_type(d.targets.get()));
    const auto tdims = hdf5::extents(target_space.get());
    const auto target_number = number_of(target_type.get());
    const std::string type = hdf5::type_name(target_type.get());
    const bool integer = target_number && is_integer(*target_number);
    if (!target_number) {
      fail_input("{}: targets dataset '{}' has unsupported dtype {}; use an integer type for class labels or "
                 "float32 for regression targets", path, d.targets_name, type);
    }
    if (!named && d.targets_name == "labels" && !integer) {
      fail_input("{}: dataset 'labels' has dtype {}, but labels are class indices (any integer type); store "
                 "regression targets as 'targets' (float32, N x T)", path, type);
    }
    if (!named && d.targets_name == "targets" && integer) {
      fail_input("{}: dataset 'targets' has dtype {}, but targets are regression values (float32, N x T); store "
                 "class indices as 'labels'", path, type);
    }
    if (tdims.empty() || tdims.size() > 2 || (integer && tdims.size() == 2 && tdims[1] != 1)) {
      fail_input("{}: {} dataset '{}' has shape {}; expected {}", path, integer ? "labels" : "targets",
                 d.targets_name, hdf5::extents_string(tdims), integer ? "N or N x 1" : "N or N x T");
    }
    if (tdims[0] != dims[0]) {
      fail_input("{}: {} dataset '{}' has {} entries but inputs dataset '{}' has {} samples", path,
                 integer ? "labels" : "targets", d.targets_name, tdims[0], d.inputs_name, dims[0]);
    }
    d.target_number = *target_number;
    d.targets_file_rank = static_cast<int>(tdims.size());
    d.info.has_labels = true;
    if (integer) {
      d.target_kind = TargetKind::Labels;
      d.info.target_shape = Shape();
    } else {
      d.target_kind = TargetKind::Regression;
      d.info.target_shape = Shape({tdims.size() == 2 ? static_cast<std::int64_t>(tdims[1]) : 1}, {DimKind::Feature});
    }
  }
  log_debug("{}: {} samples of {} from '{}' ({}), targets {}", path, d.info.size, d.info.sample_shape.to_string(),
            d.inputs_name, hdf5::type_name(input_type.get()),
            d.targets_name.empty() ? std::string("none") : "'" + d.targets_name + "'");
}

Hdf5Dataset::~Hdf5Dataset() {
  // Closing the file is collective (MPI_File_close): it takes its turn like a read.
  io_order::Turn turn;
  impl_.reset();
}

const DatasetInfo& Hdf5Dataset::info() const { return impl_->info; }
std::int64_t Hdf5Dataset::last_read_elements() const { return impl_->last_read_elements; }
bool Hdf5Dataset::last_read_collective() const { return impl_->last_read_collective; }
const std::string& Hdf5Dataset::inputs_name() const { return impl_->inputs_name; }
const std::string& Hdf5Dataset::targets_name() const { return impl_->targets_name; }

}  // namespace tessera
