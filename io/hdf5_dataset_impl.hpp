#pragma once
// State shared by the two halves of Hdf5Dataset: opening (layout checks) and reading.
#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "hdf5_util.hpp"
#include "numbers.hpp"
#include "tessera/io/hdf5_dataset.hpp"

namespace tessera {

/// An owned duplicate of a communicator, freed last (after the file that uses it is closed).
class OwnedComm {
 public:
  OwnedComm() = default;
  ~OwnedComm() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
  }
  OwnedComm(const OwnedComm&) = delete;
  OwnedComm& operator=(const OwnedComm&) = delete;
  /// Takes ownership of `comm` (this holds none yet).
  void adopt(MPI_Comm comm) { comm_ = comm; }
  MPI_Comm get() const { return comm_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

enum class TargetKind { None, Labels, Regression };

struct Hdf5Dataset::Impl {
  DatasetInfo info;
  std::string inputs_name;
  std::string targets_name;
  /// Element types in the file: inputs uint8, float32 or float64; targets any integer (labels)
  /// or float32/float64 (regression).
  Number input_number = Number::F32;
  Number target_number = Number::F32;
  TargetKind target_kind = TargetKind::None;
  /// Rank of the targets dataset in the file (labels: 1 or 2 with a trailing 1; targets: 1 or 2).
  int targets_file_rank = 0;
  std::int64_t last_read_elements = 0;
  bool last_read_collective = false;
  /// Holds the unique samples in file order before they are scattered into request order.
  std::vector<unsigned char> scratch;

  // Declaration order is destruction order reversed: datasets, then the file, then the
  // communicator the file's MPI-IO uses.
  OwnedComm comm;
  hdf5::Handle file;
  hdf5::Handle inputs;
  hdf5::Handle targets;
};

}  // namespace tessera
