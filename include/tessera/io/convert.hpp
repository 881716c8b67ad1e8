#pragma once
// Converters from public dataset formats to the HDF5 layout of io/README.md.
#include <string>

#include "tessera/core/communicator.hpp"

namespace tessera {

/// Converts Fashion-MNIST (or MNIST) from its gzipped IDX files in `source_dir`
/// ({train,t10k}-{images-idx3,labels-idx1}-ubyte.gz) into `output_dir`/train.h5 and
/// `output_dir`/test.h5 (images uint8 N x 1 x 28 x 28, labels uint8 N). Collective over `comm`:
/// rank 0 converts while the others wait; every rank throws the same InputError on bad input.
/// Outputs that already exist and are valid are kept (and logged). Files appear atomically
/// (written under a temporary name, then renamed).
void convert_fashion_mnist(const std::string& source_dir, const std::string& output_dir, const Communicator& comm);

}  // namespace tessera
