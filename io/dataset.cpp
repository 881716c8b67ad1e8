#include "tessera/io/dataset.hpp"

#include "tessera/io/hdf5_dataset.hpp"

namespace tessera {

Dataset::~Dataset() = default;

Box whole_sample_box(const Shape& sample_shape) {
  Box box;
  box.begin.assign(static_cast<std::size_t>(sample_shape.rank()), 0);
  box.extent = sample_shape.dims();
  return box;
}

std::unique_ptr<Dataset> open_hdf5_dataset(const std::string& path, const Communicator& comm,
                                           const Hdf5DatasetOptions& options) {
  return std::make_unique<Hdf5Dataset>(path, comm, options);
}

}  // namespace tessera
