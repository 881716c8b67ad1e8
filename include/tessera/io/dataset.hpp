#pragma once
// The data interface: a Dataset hands each rank exactly the samples (and the part of each sample)
// it asks for. Training code sees only this interface; the HDF5 implementation is one of many
// possible sources (flashlight's small composable Dataset is the model).
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "tessera/core/communicator.hpp"
#include "tessera/tensor/box.hpp"
#include "tessera/tensor/shape.hpp"
#include "tessera/tensor/tensor.hpp"

namespace tessera {

struct DatasetInfo {
  std::string path;
  /// Number of samples.
  std::int64_t size = 0;
  /// Per-sample shape: C x H x W or C x D x H x W, kinds Channel then Spatial.
  Shape sample_shape;
  /// {} (rank 0) for class labels, {T} (kind Feature) for regression targets.
  Shape target_shape;
  /// Whether the dataset carries targets at all (class labels or regression targets).
  bool has_labels = false;
};

class Dataset {
 public:
  virtual ~Dataset();
  virtual const DatasetInfo& info() const = 0;

  /// Collective over the dataset's communicator: every rank calls it the same number of times
  /// (possibly with no indices), in the same order relative to its other io calls (reads of other
  /// datasets, Prefetcher::submit), from one thread. See io/README.md, "Threads and ordering".
  /// Reads samples `indices` (dataset rows, any order, duplicates allowed) restricted to
  /// `sample_box` (a box over the per-sample dimensions C,(D),H,W; an empty Box means the whole
  /// sample) into `inputs` (n x box extents, float32, kinds Sample/Channel/Spatial) and `targets`
  /// (n class indices as floats, or n x T; n x 0 when the dataset has no targets). Both tensors
  /// are resized as needed, reusing their memory when it is large enough.
  virtual void read(std::span<const std::int64_t> indices, const Box& sample_box, Tensor& inputs,
                    Tensor& targets) = 0;

  /// Whole samples.
  void read(std::span<const std::int64_t> indices, Tensor& inputs, Tensor& targets) {
    read(indices, Box{}, inputs, targets);
  }
};

/// The box covering a whole sample of `sample_shape`.
Box whole_sample_box(const Shape& sample_shape);

struct Hdf5DatasetOptions {
  /// Name (or path) of the inputs dataset; empty: `images`, else `data`.
  std::string inputs{};
  /// Name (or path) of the targets dataset; empty: `labels`, else `targets`, else none.
  /// An integer dataset holds class labels, a floating-point one regression targets.
  std::string targets{};
};

/// Opens an HDF5 file laid out as described in io/README.md for collective parallel reads.
/// Collective over `comm`: every rank of it calls this. The dataset duplicates the communicator's
/// MPI communicator, so its MPI-IO traffic never mixes with training's collectives.
/// Throws InputError naming the file and the dataset when the file does not fit the layout.
std::unique_ptr<Dataset> open_hdf5_dataset(const std::string& path, const Communicator& comm,
                                           const Hdf5DatasetOptions& options = {});

}  // namespace tessera
