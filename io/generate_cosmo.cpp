// `generate cosmo`: Gaussian (optionally log-normal) random fields with a parametrised power
// spectrum, made with FFTW and written collectively into HDF5 (see include/tessera/io/generate.hpp
// and io/README.md, "Synthetic data").
#include "tessera/io/generate.hpp"

#include <fftw3.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>

#include <fmt/format.h>

#include "hdf5_dataset_impl.hpp"  // OwnedComm
#include "hdf5_util.hpp"
#include "io_order.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/rng.hpp"

namespace tessera {
namespace fs = std::filesystem;
namespace {

constexpr std::int64_t kMinSize = 8;
constexpr std::int64_t kMaxSize = 1024;
constexpr std::int64_t kMaxChannels = 16;
/// One sample must stay below this (one collective write per sample at least; HDF5 1.10's
/// MPI-IO path handles at most 2 GiB per call).
constexpr std::int64_t kMaxSampleBytes = std::int64_t{1} << 30;
/// Samples are generated and written in rounds of at most this many bytes per rank.
constexpr std::int64_t kRoundBytes = std::int64_t{64} << 20;

/// Random streams of a sample: its white noise and its parameters.
std::uint64_t noise_stream(DataSplit split, std::int64_t index) {
  return rng_substream(RngStream::Data, 2 * static_cast<std::uint64_t>(split), static_cast<std::uint64_t>(index));
}
std::uint64_t parameter_stream(DataSplit split, std::int64_t index) {
  return rng_substream(RngStream::Data, 2 * static_cast<std::uint64_t>(split) + 1, static_cast<std::uint64_t>(index));
}

/// Signed wave number of FFT index i on a grid of n points (i <= n/2: i, else i - n).
std::int64_t wave_number(std::int64_t i, std::int64_t n) { return i <= n / 2 ? i : i - n; }

/// How many of the size^3 modes have |k|^2 = q, for q = 0 .. 3 (size/2)^2.
std::vector<double> mode_multiplicity(std::int64_t size) {
  const std::int64_t half = size / 2;
  std::vector<std::int64_t> per_axis(static_cast<std::size_t>(half + 1), 0);  // modes per k_x^2 / |k_x|
  for (std::int64_t i = 0; i < size; ++i) ++per_axis[static_cast<std::size_t>(std::abs(wave_number(i, size)))];
  std::vector<double> count(static_cast<std::size_t>(3 * half * half + 1), 0.0);
  for (std::int64_t a = 0; a <= half; ++a)
    for (std::int64_t b = 0; b <= half; ++b)
      for (std::int64_t c = 0; c <= half; ++c) {
        const auto n = per_axis[static_cast<std::size_t>(a)] * per_axis[static_cast<std::size_t>(b)] *
                       per_axis[static_cast<std::size_t>(c)];
        if (n != 0) count[static_cast<std::size_t>(a * a + b * b + c * c)] += static_cast<double>(n);
      }
  return count;
}

/// The spectrum's shape k^n exp(-(k/k_c)^2) at |k|^2 = q (0 at q = 0: the field has zero mean).
double spectrum_shape(std::int64_t q, double spectral_index, double cutoff) {
  if (q == 0) return 0.0;
  const auto k2 = static_cast<double>(q);
  return std::exp(0.5 * spectral_index * std::log(k2) - k2 / (cutoff * cutoff));
}

double amplitude_from(const std::vector<double>& multiplicity, std::int64_t size, double sigma, double spectral_index,
                      double cutoff) {
  double sum = 0;
  for (std::size_t q = 1; q < multiplicity.size(); ++q)
    if (multiplicity[q] != 0) sum += multiplicity[q] * spectrum_shape(static_cast<std::int64_t>(q), spectral_index, cutoff);
  const double modes = static_cast<double>(size) * static_cast<double>(size) * static_cast<double>(size);
  return sigma * sigma / (sum / modes);
}

std::vector<double> growth_factors(std::int64_t channels) {
  std::vector<double> growth(static_cast<std::size_t>(channels));
  for (std::int64_t c = 0; c < channels; ++c)
    growth[static_cast<std::size_t>(c)] = static_cast<double>(c + 1) / static_cast<double>(channels);
  return growth;
}

const char* split_name(DataSplit split) { return split == DataSplit::Train ? "train" : "validation"; }

constexpr const char* kModelText =
    "Gaussian random field g on a periodic S^3 grid, power spectrum P(k) = A k^n exp(-(k/k_c)^2) "
    "(k = |k| in cycles per box, the mode numbers of the grid's FFT), A set so that the expected variance of g "
    "is sigma^2 (A = sigma^2 / mean over all S^3 modes of k^n exp(-(k/k_c)^2), the k = 0 mode being 0); "
    "white noise N(0,1) per voxel from Philox keyed by (seed, split, sample, voxel), filtered by sqrt(P) in "
    "Fourier space. Channel c holds the realisation at growth factor D_c = (c+1)/C: "
    "log-normal: (exp(lambda D_c g - (lambda D_c s)^2 / 2) - 1) / lambda, s the realisation's rms; "
    "otherwise D_c g.";

// ---------------------------------------------------------------------------------------------
// HDF5 and MPI helpers

/// Runs `work` on rank 0 of `comm`; every rank then throws rank 0's error, if any (the broadcast
/// is also the barrier).
template <typename F> void on_rank0(MPI_Comm comm, F&& work) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  std::string error;
  std::int64_t header[2] = {0, 0};  // message length, is-InputError
  if (rank == 0) {
    try {
      work();
    } catch (const InputError& e) {
      error = e.message();
      header[1] = 1;
    } catch (const Error& e) {
      error = e.message();
    } catch (const std::exception& e) {
      error = e.what();
    }
    header[0] = static_cast<std::int64_t>(error.size());
  }
  MPI_Bcast(header, 2, MPI_INT64_T, 0, comm);
  if (header[0] == 0) return;
  error.resize(static_cast<std::size_t>(header[0]));
  MPI_Bcast(error.data(), static_cast<int>(header[0]), MPI_CHAR, 0, comm);
  if (header[1] != 0) throw InputError(error);
  throw Error(error);
}

void write_attribute(hid_t object, const char* name, hid_t memory_type, hid_t file_type, const void* value,
                     std::size_t count, const std::string& path) {
  const hsize_t extent = count;
  hdf5::Handle space(count == 0 ? H5Screate(H5S_SCALAR) : H5Screate_simple(1, &extent, nullptr));
  hdf5::Handle attribute(H5Acreate2(object, name, file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT));
  if (!attribute.valid() || H5Awrite(attribute.get(), memory_type, value) < 0)
    fail("{}: cannot write attribute '{}'{}", path, name, hdf5::with_reason());
}

/// Strings are variable-length UTF-8: h5py reads them as `str`.
void write_attribute(hid_t object, const char* name, const std::string& value, const std::string& path) {
  hdf5::Handle type(H5Tcopy(H5T_C_S1));
  H5Tset_size(type.get(), H5T_VARIABLE);
  H5Tset_cset(type.get(), H5T_CSET_UTF8);
  const char* pointer = value.c_str();
  write_attribute(object, name, type.get(), type.get(), &pointer, 0, path);
}

void write_attribute(hid_t object, const char* name, std::int64_t value, const std::string& path) {
  write_attribute(object, name, H5T_NATIVE_INT64, H5T_STD_I64LE, &value, 0, path);
}

void write_attribute(hid_t object, const char* name, const std::vector<double>& values, const std::string& path) {
  write_attribute(object, name, H5T_NATIVE_DOUBLE, H5T_IEEE_F64LE, values.data(), values.size(), path);
}

void write_attribute(hid_t object, const char* name, const std::vector<std::string>& values, const std::string& path) {
  hdf5::Handle type(H5Tcopy(H5T_C_S1));
  H5Tset_size(type.get(), H5T_VARIABLE);
  H5Tset_cset(type.get(), H5T_CSET_UTF8);
  std::vector<const char*> pointers;
  for (const auto& v : values) pointers.push_back(v.c_str());
  write_attribute(object, name, type.get(), type.get(), pointers.data(), pointers.size(), path);
}

/// A float32 dataset of extents `dims`, contiguous, never filled (every element is written).
hdf5::Handle create_dataset(hid_t file, const char* name, const std::vector<hsize_t>& dims, const std::string& path) {
  hdf5::Handle space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr));
  hdf5::Handle dcpl(H5Pcreate(H5P_DATASET_CREATE));
  H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS);
  H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER);
  hdf5::Handle dataset(H5Dcreate2(file, name, H5T_IEEE_F32LE, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT));
  if (!dataset.valid()) fail_input("{}: cannot create dataset '{}'{}", path, name, hdf5::with_reason());
  return dataset;
}

/// Collectively writes rows [first, first + rows) of `dataset` (row = `row_elements` floats) from
/// `data`; a rank with no rows selects nothing and still joins.
void write_rows(hid_t dataset, std::int64_t first, std::int64_t rows, std::int64_t row_elements, const float* data,
                const char* name, const std::string& path) {
  hdf5::Handle file_space(H5Dget_space(dataset));
  auto dims = hdf5::extents(file_space.get());
  const hsize_t elements = static_cast<hsize_t>(std::max<std::int64_t>(rows * row_elements, 1));
  hdf5::Handle memory(H5Screate_simple(1, &elements, nullptr));
  if (rows > 0) {
    std::vector<hsize_t> start(dims.size(), 0), count = dims;
    start[0] = static_cast<hsize_t>(first);
    count[0] = static_cast<hsize_t>(rows);
    H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
  } else {
    H5Sselect_none(file_space.get());
    H5Sselect_none(memory.get());
  }
  hdf5::Handle transfer(H5Pcreate(H5P_DATASET_XFER));
  H5Pset_dxpl_mpio(transfer.get(), H5FD_MPIO_COLLECTIVE);
  float unused = 0;
  if (H5Dwrite(dataset, H5T_NATIVE_FLOAT, memory.get(), file_space.get(), transfer.get(), rows > 0 ? data : &unused) < 0)
    fail("{}: writing dataset '{}' failed{}", path, name, hdf5::with_reason());
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Parameters

std::vector<GeneratorParameter> cosmo_parameters(std::int64_t size) {
  const double s = static_cast<double>(size);
  return {
      {"sigma", "rms of the Gaussian field at growth factor 1 (the power spectrum's amplitude)", 0.5, 1.0},
      {"n", "spectral index: P(k) ~ k^n below the cutoff", -3.0, -1.0},
      {"k_c", "cutoff wave number in cycles per box (grid units); its range is [S/8, S/4]", s / 8.0, s / 4.0},
      {"lambda", "log-normal strength (no effect on the data when the log-normal transform is off)", 0.2, 0.8},
  };
}

void check_cosmo_options(const CosmoOptions& o) {
  if (o.samples < 1) fail_input("the number of samples must be at least 1 (got {})", o.samples);
  if (o.size < kMinSize || o.size > kMaxSize)
    fail_input("--size must be between {} and {} grid points per side (got {})", kMinSize, kMaxSize, o.size);
  if (o.channels < 1 || o.channels > kMaxChannels)
    fail_input("--channels must be between 1 and {} (got {})", kMaxChannels, o.channels);
  const std::int64_t bytes = o.channels * o.size * o.size * o.size * 4;
  if (bytes > kMaxSampleBytes)
    fail_input("one sample of {} x {}^3 float32 values takes {} MiB; at most {} MiB is supported", o.channels,
               o.size, bytes >> 20, kMaxSampleBytes >> 20);
}

std::array<double, kCosmoParameters> cosmo_sample_parameters(const CosmoOptions& options, std::int64_t index) {
  const auto ranges = cosmo_parameters(options.size);
  std::array<double, kCosmoParameters> values{};
  const std::uint64_t stream = parameter_stream(options.split, index);
  for (int p = 0; p < kCosmoParameters; ++p) {
    const double u = random_uniform(options.seed, stream, static_cast<std::uint64_t>(p));
    const auto& r = ranges[static_cast<std::size_t>(p)];
    values[static_cast<std::size_t>(p)] = r.low + u * (r.high - r.low);
  }
  return values;
}

double cosmo_amplitude(std::int64_t size, double sigma, double spectral_index, double cutoff) {
  return amplitude_from(mode_multiplicity(size), size, sigma, spectral_index, cutoff);
}

// ---------------------------------------------------------------------------------------------
// One sample

struct CosmoGenerator::Impl {
  CosmoOptions options;
  std::int64_t size = 0, voxels = 0, half = 0;
  std::vector<double> multiplicity;
  std::vector<double> growth;
  std::vector<GeneratorParameter> ranges;
  std::vector<float> filter;  // sqrt(P) / S^3 per |k|^2
  float* field = nullptr;
  fftwf_complex* spectrum = nullptr;
  fftwf_plan forward = nullptr, inverse = nullptr;

  ~Impl() {
    if (forward != nullptr) fftwf_destroy_plan(forward);
    if (inverse != nullptr) fftwf_destroy_plan(inverse);
    fftwf_free(field);
    fftwf_free(spectrum);
  }
};

CosmoGenerator::CosmoGenerator(const CosmoOptions& options) : impl_(std::make_unique<Impl>()) {
  check_cosmo_options(options);
  auto& g = *impl_;
  g.options = options;
  g.size = options.size;
  g.voxels = g.size * g.size * g.size;
  g.half = g.size / 2 + 1;
  g.multiplicity = mode_multiplicity(g.size);
  g.growth = growth_factors(options.channels);
  g.ranges = cosmo_parameters(g.size);
  g.filter.resize(g.multiplicity.size());
  g.field = fftwf_alloc_real(static_cast<std::size_t>(g.voxels));
  g.spectrum = fftwf_alloc_complex(static_cast<std::size_t>(g.size * g.size * g.half));
  if (g.field == nullptr || g.spectrum == nullptr) fail("cannot allocate the FFT buffers for a {}^3 grid", g.size);
  // FFTW_ESTIMATE: the plan (and so every rounding) is a function of the size alone, never of
  // timings, so every rank computes bit-identical fields.
  const int n = static_cast<int>(g.size);
  g.forward = fftwf_plan_dft_r2c_3d(n, n, n, g.field, g.spectrum, FFTW_ESTIMATE);
  g.inverse = fftwf_plan_dft_c2r_3d(n, n, n, g.spectrum, g.field, FFTW_ESTIMATE);
  if (g.forward == nullptr || g.inverse == nullptr) fail("FFTW could not plan a {}^3 real transform", g.size);
}

CosmoGenerator::~CosmoGenerator() = default;

void CosmoGenerator::sample(std::int64_t index, float* data, float* targets, double* parameters) {
  auto& g = *impl_;
  const auto& o = g.options;
  const auto values = cosmo_sample_parameters(o, index);
  for (int p = 0; p < kCosmoParameters; ++p) {
    const auto& r = g.ranges[static_cast<std::size_t>(p)];
    const double x = values[static_cast<std::size_t>(p)];
    targets[p] = static_cast<float>(2.0 * (x - r.low) / (r.high - r.low) - 1.0);
    if (parameters != nullptr) parameters[p] = x;
  }
  const double sigma = values[0], spectral_index = values[1], cutoff = values[2], lambda = values[3];

  // White noise, N(0, 1) per voxel: Box-Muller on the 4 words of the Philox counter voxel / 4.
  const std::uint64_t stream = noise_stream(o.split, index);
  for (std::int64_t block = 0; block * 4 < g.voxels; ++block) {
    const auto w = philox4x32(o.seed, stream, static_cast<std::uint64_t>(block));
    double normal[4];
    for (int pair = 0; pair < 2; ++pair) {
      const double u1 = (static_cast<double>(w[2 * pair]) + 1.0) / 4294967297.0;  // (0, 1]
      const double angle = 2.0 * M_PI * static_cast<double>(w[2 * pair + 1]) / 4294967296.0;
      const double radius = std::sqrt(-2.0 * std::log(u1));
      normal[2 * pair] = radius * std::cos(angle);
      normal[2 * pair + 1] = radius * std::sin(angle);
    }
    const std::int64_t lanes = std::min<std::int64_t>(4, g.voxels - block * 4);
    for (std::int64_t l = 0; l < lanes; ++l) g.field[block * 4 + l] = static_cast<float>(normal[l]);
  }

  // Filter in Fourier space: multiply each mode by sqrt(P(k)); FFTW's round trip scales by S^3.
  fftwf_execute(g.forward);
  const double amplitude = amplitude_from(g.multiplicity, g.size, sigma, spectral_index, cutoff);
  const double scale = 1.0 / static_cast<double>(g.voxels);
  for (std::size_t q = 0; q < g.filter.size(); ++q)
    g.filter[q] = g.multiplicity[q] == 0
                      ? 0.0f
                      : static_cast<float>(
                            std::sqrt(amplitude * spectrum_shape(static_cast<std::int64_t>(q), spectral_index, cutoff)) *
                            scale);
  for (std::int64_t i = 0; i < g.size; ++i) {
    const std::int64_t kx = wave_number(i, g.size);
    for (std::int64_t j = 0; j < g.size; ++j) {
      const std::int64_t ky = wave_number(j, g.size);
      fftwf_complex* row = g.spectrum + (i * g.size + j) * g.half;
      for (std::int64_t l = 0; l < g.half; ++l) {
        const float f = g.filter[static_cast<std::size_t>(kx * kx + ky * ky + l * l)];
        row[l][0] *= f;
        row[l][1] *= f;
      }
    }
  }
  fftwf_execute(g.inverse);

  // Channels: the realisation at each growth factor, log-normal transformed or not.
  double sum_squares = 0;
  for (std::int64_t v = 0; v < g.voxels; ++v) sum_squares += static_cast<double>(g.field[v]) * g.field[v];
  const double rms = std::sqrt(sum_squares / static_cast<double>(g.voxels));
  for (std::int64_t c = 0; c < o.channels; ++c) {
    const double d = g.growth[static_cast<std::size_t>(c)];
    float* out = data + c * g.voxels;
    if (o.lognormal) {
      const double a = lambda * d, shift = 0.5 * (a * rms) * (a * rms);
      for (std::int64_t v = 0; v < g.voxels; ++v)
        out[v] = static_cast<float>(std::expm1(a * static_cast<double>(g.field[v]) - shift) / lambda);
    } else {
      for (std::int64_t v = 0; v < g.voxels; ++v) out[v] = static_cast<float>(d * static_cast<double>(g.field[v]));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The file

GenerateSummary generate_cosmo(const std::string& path, const CosmoOptions& options, const Communicator& comm) {
  check_cosmo_options(options);
  const auto started = std::chrono::steady_clock::now();
  const int handle = comm.mpi_handle();
  if (handle == -1) fail("{}: communicator '{}' is not MPI-based; generated files are written through MPI-IO", path,
                         comm.name());
  OwnedComm own;
  {
    MPI_Comm dup = MPI_COMM_NULL;
    MPI_Comm_dup(MPI_Comm_f2c(handle), &dup);
    MPI_Comm_set_name(dup, "tessera generate");
    own.adopt(dup);
  }
  const int rank = comm.rank(), ranks = comm.size();
  const std::string temporary = path + ".tmp";
  on_rank0(own.get(), [&] {
    std::error_code ec;
    if (fs::is_directory(path, ec)) fail_input("{}: is a directory", path);
    const fs::path parent = fs::path(path).parent_path();
    if (!parent.empty()) {
      fs::create_directories(parent, ec);
      if (!fs::is_directory(parent, ec)) fail_input("{}: cannot create the output folder {}", path, parent.string());
    }
  });

  const std::int64_t n = options.samples, s = options.size, c = options.channels;
  const std::int64_t per_sample = c * s * s * s;
  const std::int64_t begin = rank * n / ranks, end = (rank + 1) * n / ranks;
  const std::int64_t largest_block = (n + ranks - 1) / ranks;  // every rank knows the round count
  const std::int64_t per_round =
      std::clamp<std::int64_t>(kRoundBytes / (per_sample * 4), 1, std::max<std::int64_t>(largest_block, 1));
  const std::int64_t rounds = (largest_block + per_round - 1) / per_round;

  // A rank without samples (more ranks than samples) allocates nothing but still joins every write.
  std::unique_ptr<CosmoGenerator> generator;
  if (end > begin) generator = std::make_unique<CosmoGenerator>(options);
  std::vector<float> buffer(static_cast<std::size_t>(std::min(per_round, end - begin) * per_sample));
  std::vector<float> targets(static_cast<std::size_t>((end - begin) * kCosmoParameters));
  std::vector<float> parameters(targets.size());

  {
    io_order::Turn turn;  // HDF5 is not thread-safe: wait for any read in flight
    hdf5::silence_errors();
    hdf5::Handle fapl(H5Pcreate(H5P_FILE_ACCESS));
    H5Pset_fapl_mpio(fapl.get(), own.get(), MPI_INFO_NULL);
    H5Pset_all_coll_metadata_ops(fapl.get(), true);
    H5Pset_coll_metadata_write(fapl.get(), true);
    hdf5::Handle file(H5Fcreate(temporary.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()));
    if (!file.valid()) fail_input("{}: cannot create the file{}", temporary, hdf5::with_reason());
    const auto hn = static_cast<hsize_t>(n), hs = static_cast<hsize_t>(s);
    hdf5::Handle data = create_dataset(file.get(), "data", {hn, static_cast<hsize_t>(c), hs, hs, hs}, temporary);
    hdf5::Handle target_set = create_dataset(file.get(), "targets", {hn, kCosmoParameters}, temporary);
    hdf5::Handle parameter_set = create_dataset(file.get(), "parameters", {hn, kCosmoParameters}, temporary);

    for (std::int64_t round = 0; round < rounds; ++round) {
      const std::int64_t first = std::min(end, begin + round * per_round);
      const std::int64_t last = std::min(end, first + per_round);
      for (std::int64_t i = first; i < last; ++i) {
        double physical[kCosmoParameters];
        const auto row = static_cast<std::size_t>((i - begin) * kCosmoParameters);
        generator->sample(i, buffer.data() + (i - first) * per_sample, targets.data() + row, physical);
        for (int p = 0; p < kCosmoParameters; ++p) parameters[row + static_cast<std::size_t>(p)] = static_cast<float>(physical[p]);
      }
      write_rows(data.get(), first, last - first, per_sample, buffer.data(), "data", temporary);
    }
    write_rows(target_set.get(), begin, end - begin, kCosmoParameters, targets.data(), "targets", temporary);
    write_rows(parameter_set.get(), begin, end - begin, kCosmoParameters, parameters.data(), "parameters", temporary);

    // Attributes (collective: the same values on every rank).
    const auto ranges = cosmo_parameters(s);
    std::vector<std::string> names, meanings;
    std::vector<double> low, high;
    for (const auto& r : ranges) {
      names.push_back(r.name);
      meanings.push_back(r.meaning);
      low.push_back(r.low);
      high.push_back(r.high);
    }
    const hid_t root = file.get();
    write_attribute(root, "generator", std::string("tessera generate cosmo"), temporary);
    write_attribute(root, "format_version", std::int64_t{1}, temporary);
    write_attribute(root, "model", std::string(kModelText), temporary);
    write_attribute(root, "split", std::string(split_name(options.split)), temporary);
    write_attribute(root, "seed", static_cast<std::int64_t>(options.seed), temporary);
    write_attribute(root, "samples", n, temporary);
    write_attribute(root, "size", s, temporary);
    write_attribute(root, "channels", c, temporary);
    write_attribute(root, "lognormal", std::int64_t{options.lognormal ? 1 : 0}, temporary);
    write_attribute(data.get(), "growth", growth_factors(c), temporary);
    for (hid_t set : {target_set.get(), parameter_set.get()}) {
      write_attribute(set, "names", names, temporary);
      write_attribute(set, "meanings", meanings, temporary);
      write_attribute(set, "low", low, temporary);
      write_attribute(set, "high", high, temporary);
    }
    write_attribute(target_set.get(), "normalisation", std::string("2 * (x - low) / (high - low) - 1"), temporary);
    data.reset();
    target_set.reset();
    parameter_set.reset();
    if (H5Fflush(file.get(), H5F_SCOPE_GLOBAL) < 0) fail("{}: flush failed{}", temporary, hdf5::with_reason());
    file.reset();  // collective close
  }
  on_rank0(own.get(), [&] {
    std::error_code ec;
    fs::rename(temporary, path, ec);
    if (ec) fail_input("cannot rename {} to {}: {}", temporary, path, ec.message());
  });

  GenerateSummary summary;
  summary.path = path;
  summary.samples = n;
  summary.bytes = n * per_sample * 4 + 2 * n * kCosmoParameters * 4;
  summary.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return summary;
}

}  // namespace tessera
