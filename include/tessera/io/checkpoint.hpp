#pragma once
// Checkpoint files: one HDF5 file per checkpoint, written collectively through MPI-IO by the ranks
// of a communicator. Every tensor is stored as its GLOBAL tensor; each rank that writes a part of
// it writes its box as a hyperslab (ranks holding a replica that another rank writes select
// nothing). See io/README.md, "Checkpoint files", for the layout.
//
// Crash safety: a writer writes `<dir>/<name>.h5.tmp`; finish() marks it complete (the last
// attribute written), flushes, closes and fsyncs it, renames it to `<dir>/<name>.h5`, then
// replaces `<dir>/latest` (tmp + rename) and deletes all but the newest `keep` checkpoints. A job
// killed at any point leaves either a complete newer checkpoint or the older ones untouched.
//
// Every call here is collective over the communicator given at construction (same calls, same
// order, same names and attribute values on every rank). HDF5 and MPI stay inside io/.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/core/communicator.hpp"
#include "tessera/tensor/box.hpp"

namespace tessera {

/// "ckpt-00000120": the file name stem of the checkpoint taken before step `step`. Only files
/// named like this are found by find_resume_checkpoint() and pruned by finish().
std::string checkpoint_name(std::int64_t step);
/// The step in a checkpoint file name ("ckpt-00000120.h5" -> 120), or nothing.
std::optional<std::int64_t> checkpoint_step(const std::string& file_name);

class CheckpointWriter {
 public:
  /// Creates `dir` if needed and opens `<dir>/<name>.h5.tmp` (replacing a stale one).
  CheckpointWriter(const std::string& dir, const std::string& name, const Communicator& comm);
  /// Without finish(): closes the file and leaves the .tmp (never mistaken for a checkpoint).
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  /// Stores dataset `name` (a path: "param/conv1.weight" creates the group "param") of shape
  /// `global_shape`, float32. `local` holds this rank's `local_box` of it, row-major; it is
  /// written when `this_rank_writes` (the boxes of the writing ranks must tile the tensor once).
  /// Also stores the dataset's checksum (see dataset_checksum()).
  void write_tensor(const std::string& name, const std::vector<std::int64_t>& global_shape, const Box& local_box,
                    const float* local, bool this_rank_writes);
  /// Attributes of the file (the root group). Same value on every rank.
  void set_attribute(const std::string& name, const std::string& value);
  void set_attribute(const std::string& name, std::int64_t value);
  void set_attribute(const std::string& name, double value);
  /// Marks the file complete, closes it, fsyncs it, renames it into place, updates `latest` and
  /// removes all but the newest `keep` checkpoints (0: keep all). Returns the final path.
  std::string finish(int keep = 3);

  const std::string& path() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class CheckpointReader {
 public:
  /// Opens `path` (collective). InputError naming the file: missing, not an HDF5 file (or
  /// truncated), not a Tessera checkpoint.
  CheckpointReader(const std::string& path, const Communicator& comm);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  /// Checks the complete marker and recomputes every dataset's checksum (the ranks split each
  /// dataset's rows between them). InputError naming the file (and the dataset) otherwise.
  void verify();

  const std::string& path() const;
  /// Every dataset's path ("param/conv1.weight", ...), sorted.
  std::vector<std::string> tensor_names() const;
  bool has_tensor(const std::string& name) const;
  std::vector<std::int64_t> tensor_shape(const std::string& name) const;
  /// Reads this rank's `local_box` of tensor `name` into `out` (row-major, local_box.numel()
  /// floats). InputError naming the file for a missing tensor or a box outside it.
  void read_tensor(const std::string& name, const Box& local_box, float* out);

  bool has_attribute(const std::string& name) const;
  std::string string_attribute(const std::string& name) const;
  std::int64_t int_attribute(const std::string& name) const;
  double double_attribute(const std::string& name) const;

  /// Testing aid: byte offset and size of a (contiguous) dataset's data in the file.
  std::pair<std::int64_t, std::int64_t> tensor_file_extent(const std::string& name) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The order-independent checksum of a tensor: the sum (mod 2^64) over its elements of a 64-bit
/// mix of (global flat index, float bits). Over a box of a tensor of shape `global_shape`.
std::uint64_t dataset_checksum(const std::vector<std::int64_t>& global_shape, const Box& box, const float* data);

/// The checkpoint in `dir` to resume from: the newest by step among the files named by
/// checkpoint_name() (and the one `latest` names) that verifies; corrupt or incomplete ones are
/// skipped with a warning naming them. Nothing when `dir` holds none. Collective.
std::optional<std::string> find_resume_checkpoint(const std::string& dir, const Communicator& comm);

}  // namespace tessera
