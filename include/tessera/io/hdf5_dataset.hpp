#pragma once
// The HDF5 implementation of Dataset, exposed for code that needs more than the interface
// (tests proving the selection size, tools reporting I/O). hdf5.h and mpi.h stay in io/.
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "tessera/io/dataset.hpp"

namespace tessera {

class Hdf5Dataset final : public Dataset {
 public:
  /// Prefer open_hdf5_dataset(); same contract.
  Hdf5Dataset(const std::string& path, const Communicator& comm, const Hdf5DatasetOptions& options = {});
  ~Hdf5Dataset() override;
  Hdf5Dataset(const Hdf5Dataset&) = delete;
  Hdf5Dataset& operator=(const Hdf5Dataset&) = delete;

  const DatasetInfo& info() const override;
  void read(std::span<const std::int64_t> indices, const Box& sample_box, Tensor& inputs,
            Tensor& targets) override;
  using Dataset::read;

  /// Number of input elements this rank selected in the file on the last read: the proof that a
  /// rank reads only the unique samples and the part of each sample it asked for.
  std::int64_t last_read_elements() const;
  /// Whether HDF5 performed every part of the last read as collective MPI-IO (it silently falls
  /// back to independent I/O, e.g. when it must convert types itself).
  bool last_read_collective() const;
  /// Name of the inputs and targets datasets in the file (targets: empty when there are none).
  const std::string& inputs_name() const;
  const std::string& targets_name() const;

 private:
  void open_layout(const std::string& path, const Communicator& comm, const Hdf5DatasetOptions& options);

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera
