// Collective reads: each rank selects, in the file, the union of the hyperslabs of the unique
// samples it asked for (restricted to its box), reads them in one collective MPI-IO call, and
// scatters them into request order in memory. No rank touches data it did not ask for.
#include <algorithm>
#include <array>
#include <cstring>
#include <exception>

#include <fmt/format.h>

#include "hdf5_dataset_impl.hpp"
#include "io_order.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/log.hpp"

namespace tessera {
namespace {

/// Exactly v / 255 for every byte (a table: as fast as a multiply, without its rounding error).
const std::array<float, 256>& byte_scale() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int v = 0; v < 256; ++v) t[static_cast<std::size_t>(v)] = static_cast<float>(v) / 255.0f;
    return t;
  }();
  return table;
}

/// Consecutive runs [first, first + length) of sorted unique indices: one hyperslab block each.
struct Run {
  std::int64_t first;
  std::int64_t length;
};

std::vector<Run> runs_of(const std::vector<std::int64_t>& sorted_unique) {
  std::vector<Run> runs;
  for (auto index : sorted_unique) {
    if (!runs.empty() && runs.back().first + runs.back().length == index) {
      ++runs.back().length;
    } else {
      runs.push_back({index, 1});
    }
  }
  return runs;
}

/// Selects, in a copy of `dataset`'s file space, the union of blocks run x (begin, extent) over
/// the dimensions after the first. Empty runs select nothing (the rank still joins the read).
hdf5::Handle select_runs(hid_t dataset, const std::vector<Run>& runs, const std::vector<std::int64_t>& begin,
                         const std::vector<std::int64_t>& extent) {
  hdf5::Handle space(H5Dget_space(dataset));
  if (runs.empty()) {
    H5Sselect_none(space.get());
    return space;
  }
  const std::size_t rank = begin.size() + 1;
  std::vector<hsize_t> start(rank), count(rank, 1), block(rank);
  for (std::size_t i = 1; i < rank; ++i) {
    start[i] = static_cast<hsize_t>(begin[i - 1]);
    block[i] = static_cast<hsize_t>(extent[i - 1]);
  }
  bool first = true;
  for (const auto& run : runs) {
    start[0] = static_cast<hsize_t>(run.first);
    block[0] = static_cast<hsize_t>(run.length);
    H5Sselect_hyperslab(space.get(), first ? H5S_SELECT_SET : H5S_SELECT_OR, start.data(), nullptr, count.data(),
                        block.data());
    first = false;
  }
  return space;
}

const char* io_mode_name(H5D_mpio_actual_io_mode_t mode) {
  switch (mode) {
    case H5D_MPIO_NO_COLLECTIVE: return "independent";
    case H5D_MPIO_CHUNK_INDEPENDENT: return "chunk independent";
    case H5D_MPIO_CHUNK_COLLECTIVE: return "chunk collective";
    case H5D_MPIO_CHUNK_MIXED: return "chunk mixed";
    case H5D_MPIO_CONTIGUOUS_COLLECTIVE: return "contiguous collective";
  }
  return "?";
}

/// One collective H5Dread of the selection `file_space` into `buffer` (contiguous, in file order).
/// Returns the number of elements selected; `collective` becomes false if HDF5 did not do it
/// collectively.
std::int64_t collective_read(hid_t dataset, hid_t memory_type, hid_t file_space, void* buffer, const std::string& path,
                             const std::string& name, bool& collective) {
  const auto selected = static_cast<std::int64_t>(H5Sget_select_npoints(file_space));
  const hsize_t memory_extent = static_cast<hsize_t>(std::max<std::int64_t>(selected, 1));
  hdf5::Handle memory_space(H5Screate_simple(1, &memory_extent, nullptr));
  if (selected == 0) H5Sselect_none(memory_space.get());
  hdf5::Handle transfer(H5Pcreate(H5P_DATASET_XFER));
  H5Pset_dxpl_mpio(transfer.get(), H5FD_MPIO_COLLECTIVE);
  unsigned char unused = 0;  // HDF5 wants a buffer even when this rank selects nothing
  if (H5Dread(dataset, memory_type, memory_space.get(), file_space, transfer.get(),
              buffer != nullptr ? buffer : &unused) < 0) {
    fail("{}: reading dataset '{}' failed{}", path, name, hdf5::with_reason());
  }
  H5D_mpio_actual_io_mode_t mode{};
  std::uint32_t local_cause = 0, global_cause = 0;
  if (H5Pget_mpio_actual_io_mode(transfer.get(), &mode) < 0 ||
      H5Pget_mpio_no_collective_cause(transfer.get(), &local_cause, &global_cause) < 0) {
    collective = false;
  } else {
    if (mode == H5D_MPIO_NO_COLLECTIVE || mode == H5D_MPIO_CHUNK_INDEPENDENT) collective = false;
    // A cause other than 0 says why HDF5 fell back to independent I/O (H5D_mpio_no_collective_cause_t).
    const std::string cause =
        global_cause == 0 ? std::string() : fmt::format(", not collective because of cause 0x{:x}", global_cause);
    log_debug("{}: read {} elements of '{}' ({} I/O{})", path, selected, name, io_mode_name(mode), cause);
  }
  return selected;
}

}  // namespace

void Hdf5Dataset::read(std::span<const std::int64_t> indices, const Box& sample_box, Tensor& inputs, Tensor& targets) {
  io_order::Turn turn;
  hdf5::silence_errors();
  auto& d = *impl_;
  const Shape& sample = d.info.sample_shape;
  const auto n = static_cast<std::int64_t>(indices.size());

  // Check this rank's request. A bad one must not leave the other ranks waiting in the
  // collective reads below: this rank joins them with an empty selection, then throws.
  std::exception_ptr request_error;
  Box box;
  std::vector<std::int64_t> unique;
  try {
    box = sample_box.begin.empty() && sample_box.extent.empty() ? whole_sample_box(sample) : sample_box;
    TESSERA_CHECK(static_cast<int>(box.begin.size()) == sample.rank() && box.extent.size() == box.begin.size(),
                  "{}: a box of {} dimensions for samples of shape {}", d.info.path, box.begin.size(),
                  sample.to_string());
    for (int i = 0; i < sample.rank(); ++i) {
      const auto b = box.begin[static_cast<std::size_t>(i)], e = box.extent[static_cast<std::size_t>(i)];
      TESSERA_CHECK(b >= 0 && e >= 1 && b + e <= sample[i], "{}: box [{}] + [{}] outside samples of shape {}",
                    d.info.path, fmt::join(box.begin, ", "), fmt::join(box.extent, ", "), sample.to_string());
    }
    for (auto index : indices) {
      TESSERA_CHECK(index >= 0 && index < d.info.size, "{}: sample index {} outside [0, {})", d.info.path, index,
                    d.info.size);
    }
    unique.assign(indices.begin(), indices.end());
    std::sort(unique.begin(), unique.end());
    unique.erase(std::unique(unique.begin(), unique.end()), unique.end());

    std::vector<std::int64_t> spatial(box.extent.begin() + 1, box.extent.end());
    inputs.resize(Shape::image(n, box.extent[0], spatial));
    const std::int64_t width = d.target_kind == TargetKind::Regression ? d.info.target_shape[0] : 0;
    if (d.target_kind == TargetKind::Labels) {
      targets.resize(Shape({n}, {DimKind::Sample}));
    } else {
      targets.resize(Shape({n, width}, {DimKind::Sample, DimKind::Feature}));
    }
  } catch (...) {
    request_error = std::current_exception();
    unique.clear();
    box = whole_sample_box(sample);
  }
  const auto runs = runs_of(unique);
  const std::int64_t box_numel = box.numel();
  const auto unique_count = static_cast<std::int64_t>(unique.size());

  // Inputs. When the request is already sorted and unique (unshuffled batches), float samples go
  // straight into the output; otherwise they land in file order in scratch and are scattered.
  {
    hdf5::Handle file_space = select_runs(d.inputs.get(), runs, box.begin, box.extent);
    const bool direct = !request_error && d.input_number == Number::F32 && unique_count == n &&
                        std::equal(unique.begin(), unique.end(), indices.begin());
    const std::size_t element = number_size(d.input_number);
    const auto sample_bytes = static_cast<std::size_t>(box_numel) * element;
    void* buffer = nullptr;
    if (direct) {
      buffer = inputs.data();
    } else if (unique_count > 0) {
      d.scratch.resize(static_cast<std::size_t>(unique_count) * sample_bytes);
      buffer = d.scratch.data();
    }
    d.last_read_collective = true;
    d.last_read_elements = collective_read(d.inputs.get(), native_type(d.input_number), file_space.get(), buffer,
                                           d.info.path, d.inputs_name, d.last_read_collective);
    if (!request_error && !direct) {
      for (std::int64_t r = 0; r < n; ++r) {
        const auto position = static_cast<std::size_t>(
            std::lower_bound(unique.begin(), unique.end(), indices[static_cast<std::size_t>(r)]) - unique.begin());
        const unsigned char* source = d.scratch.data() + position * sample_bytes;
        float* destination = inputs.data() + r * box_numel;
        if (d.input_number == Number::U8) {
          const auto& scale = byte_scale();
          for (std::int64_t i = 0; i < box_numel; ++i) destination[i] = scale[source[i]];
        } else if (d.input_number == Number::F32) {
          std::memcpy(destination, source, sample_bytes);
        } else {
          convert_numbers(d.input_number, source, static_cast<std::size_t>(box_numel), destination);
        }
      }
    }
  }

  // Targets: the whole row of every requested sample (they are small).
  if (d.target_kind != TargetKind::None) {
    const bool labels = d.target_kind == TargetKind::Labels;
    const std::int64_t width = labels ? 1 : d.info.target_shape[0];
    std::vector<std::int64_t> begin, extent;
    if (d.targets_file_rank == 2) {
      begin.push_back(0);
      extent.push_back(width);
    }
    hdf5::Handle file_space = select_runs(d.targets.get(), runs, begin, extent);
    const auto row_bytes = static_cast<std::size_t>(width) * number_size(d.target_number);
    std::vector<unsigned char> values(unique.size() * row_bytes);
    collective_read(d.targets.get(), native_type(d.target_number), file_space.get(),
                    values.empty() ? nullptr : values.data(), d.info.path, d.targets_name, d.last_read_collective);
    if (!request_error) {
      float* out = targets.data();
      for (std::int64_t r = 0; r < n; ++r) {
        const auto index = indices[static_cast<std::size_t>(r)];
        const auto position =
            static_cast<std::size_t>(std::lower_bound(unique.begin(), unique.end(), index) - unique.begin());
        const unsigned char* source = values.data() + position * row_bytes;
        if (labels) {
          std::int64_t label = 0;
          convert_numbers(d.target_number, source, 1, &label);
          if (label < 0) {
            request_error = std::make_exception_ptr(InputError(fmt::format(
                "{}: labels dataset '{}' holds a negative class index {} at sample {}", d.info.path, d.targets_name,
                label, index)));
            break;
          }
          out[r] = static_cast<float>(label);
        } else {
          convert_numbers(d.target_number, source, static_cast<std::size_t>(width), out + r * width);
        }
      }
    }
  }
  if (request_error) std::rethrow_exception(request_error);
}

}  // namespace tessera
