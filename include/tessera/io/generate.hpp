#pragma once
// Synthetic datasets, generated in parallel straight into the HDF5 layout of io/README.md.
//
// `cosmo`: CosmoFlow-class 3-D volumes. Each sample is a Gaussian random field on a periodic S^3
// grid with power spectrum P(k) = A k^n exp(-(k/k_c)^2) (optionally log-normal transformed), seen
// at C growth factors (channels), and its 4 regression targets are the parameters that made it
// (rms amplitude sigma, spectral index n, cutoff k_c, log-normal strength lambda), drawn per
// sample and stored normalised to [-1, 1]. Every value is a function of (seed, split, sample
// index, voxel index) only: the file is the same whatever the rank count. See io/README.md,
// "Synthetic data: generate cosmo", for the model, the ranges and the file layout.
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/core/communicator.hpp"

namespace tessera {

/// The split a file is generated for; each draws from its own random streams.
enum class DataSplit : std::uint64_t { Train = 0, Validation = 1 };

struct CosmoOptions {
  /// Samples in the file (N >= 1).
  std::int64_t samples = 1;
  /// Grid points per side: each channel of a sample is size^3 voxels (4 <= S <= 1024).
  std::int64_t size = 64;
  /// Channels (1 <= C <= 16): the same realisation at growth factors D_c = (c + 1) / C.
  std::int64_t channels = 1;
  std::uint64_t seed = 0;
  DataSplit split = DataSplit::Train;
  /// Log-normal transform of each channel (otherwise the Gaussian field itself is stored).
  bool lognormal = true;
};

/// A regression target: its name, its physical meaning and the range it is drawn from uniformly.
/// Stored normalised: 2 (x - low) / (high - low) - 1, in [-1, 1].
struct GeneratorParameter {
  std::string name;
  std::string meaning;
  double low = 0;
  double high = 1;
};

constexpr int kCosmoParameters = 4;

/// The 4 parameters of `cosmo` for grid size `size` (k_c's range scales with the grid):
/// sigma, n, k_c, lambda.
std::vector<GeneratorParameter> cosmo_parameters(std::int64_t size);

/// Throws InputError (the same on every rank) when `options` are out of range.
void check_cosmo_options(const CosmoOptions& options);

/// The physical parameters of sample `index` (in the order of cosmo_parameters()).
std::array<double, kCosmoParameters> cosmo_sample_parameters(const CosmoOptions& options, std::int64_t index);

/// The power-spectrum amplitude A that gives the Gaussian field the variance sigma^2:
/// A = sigma^2 / mean over the S^3 modes k != 0 (k = 0 counted as 0) of k^n exp(-(k/k_c)^2).
double cosmo_amplitude(std::int64_t size, double sigma, double spectral_index, double cutoff);

/// Generates single samples (FFTW plans and buffers for one grid size, made once). One thread.
class CosmoGenerator {
 public:
  explicit CosmoGenerator(const CosmoOptions& options);
  ~CosmoGenerator();
  CosmoGenerator(const CosmoGenerator&) = delete;
  CosmoGenerator& operator=(const CosmoGenerator&) = delete;

  /// Writes sample `index` into `data` (C x S x S x S floats) and its normalised targets into
  /// `targets` (4 floats); `parameters` (4 doubles, physical units) when not null.
  void sample(std::int64_t index, float* data, float* targets, double* parameters = nullptr);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct GenerateSummary {
  std::string path;
  std::int64_t samples = 0;
  /// Bytes of the datasets written (data, targets, parameters).
  std::int64_t bytes = 0;
  double seconds = 0;
};

/// Writes `path` (an HDF5 file: `data` float32 N x C x S x S x S, `targets` float32 N x 4,
/// `parameters` float32 N x 4, with attributes). Collective over `comm`: the ranks split the
/// samples in blocks, each generates its own, and all write them with collective MPI-IO
/// hyperslabs. The file appears atomically (written as `<path>.tmp`, then renamed). Creates the
/// parent folder. InputError (same on every rank) for bad options or an unwritable location.
GenerateSummary generate_cosmo(const std::string& path, const CosmoOptions& options, const Communicator& comm);

}  // namespace tessera
