// `tessera generate`: synthetic datasets written in parallel into Tessera's HDF5 layout.
#include <fmt/format.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "commands.hpp"
#include "tessera/core/error.hpp"
#include "tessera/io/generate.hpp"
#include "tessera/parallel/collective_guard.hpp"

namespace tessera {
namespace {

struct CosmoArgs {
  std::string output;
  // -1: not given. Checked by the command, not by CLI11, so that bad values end with exit code 2
  // and one message, like every other bad input.
  std::int64_t train = -1;
  std::int64_t validation = 0;
  std::int64_t size = 64;
  std::int64_t channels = 1;
  std::uint64_t seed = 0;
  bool lognormal = true;
};

void run_generate_cosmo(Communicator& world, const CosmoArgs& args) {
  CosmoOptions train, validation;
  collectively(world, [&] {
    if (args.output.empty()) fail_input("tessera generate cosmo: --output DIR is required");
    if (args.train < 0) fail_input("tessera generate cosmo: --train N (the number of training samples) is required");
    if (args.train < 1) fail_input("--train must be at least 1 (got {})", args.train);
    if (args.validation < 0) fail_input("--validation must be 0 or more (got {})", args.validation);
    train = CosmoOptions{.samples = args.train,
                         .size = args.size,
                         .channels = args.channels,
                         .seed = args.seed,
                         .split = DataSplit::Train,
                         .lognormal = args.lognormal};
    validation = train;
    validation.samples = std::max<std::int64_t>(args.validation, 1);
    validation.split = DataSplit::Validation;
    check_cosmo_options(train);
    // Problems with the folder show here, on every rank alike, before any collective file work.
    std::error_code ec;
    if (std::filesystem::exists(args.output, ec) && !std::filesystem::is_directory(args.output, ec))
      fail_input("--output {}: exists and is not a folder", args.output);
    std::filesystem::create_directories(args.output, ec);
    if (!std::filesystem::is_directory(args.output, ec))
      fail_input("--output {}: cannot create the folder{}", args.output, ec ? ": " + ec.message() : std::string());
    if (::access(args.output.c_str(), W_OK | X_OK) != 0)
      fail_input("--output {}: the folder is not writable", args.output);
  });
  auto report = [&](const GenerateSummary& s, const CosmoOptions& o) {
    if (world.rank() != 0) return;
    fmt::print("{}: {} samples of {}x{}^3, {:.1f} MiB, {:.2f} s ({:.1f} samples/s, {} ranks)\n", s.path, s.samples,
               o.channels, o.size, static_cast<double>(s.bytes) / (1 << 20), s.seconds,
               static_cast<double>(s.samples) / std::max(s.seconds, 1e-9), world.size());
    std::fflush(stdout);
  };
  const auto dir = std::filesystem::path(args.output);
  report(generate_cosmo((dir / "train.h5").string(), train, world), train);
  if (args.validation > 0) report(generate_cosmo((dir / "validation.h5").string(), validation, world), validation);
}

}  // namespace

std::function<void(Communicator&)> add_generate_command(CLI::App& app) {
  auto args = std::make_shared<CosmoArgs>();
  auto* generate = app.add_subcommand("generate", "Generate synthetic datasets (in parallel, into HDF5)");
  generate->require_subcommand(1);
  auto* cosmo = generate->add_subcommand(
      "cosmo",
      "CosmoFlow-class 3-D volumes: Gaussian (log-normal) random fields with P(k) = A k^n exp(-(k/k_c)^2), 4 "
      "regression targets (sigma, n, k_c, lambda) -> DIR/train.h5 and DIR/validation.h5 (see io/README.md)");
  cosmo->add_option("--output", args->output, "Output folder (created if needed)");
  cosmo->add_option("--train", args->train, "Training samples (N >= 1)");
  cosmo->add_option("--validation", args->validation, "Validation samples (0: no validation.h5)")
      ->capture_default_str();
  cosmo->add_option("--size", args->size, "Grid points per side S (8..1024): samples are C x S x S x S")
      ->capture_default_str();
  cosmo->add_option("--channels", args->channels,
                    "Channels C (1..16): the same field at growth factors (c+1)/C, like CosmoFlow's redshifts")
      ->capture_default_str();
  cosmo->add_option("--seed", args->seed, "Seed (validation uses its own random streams of it)")
      ->capture_default_str();
  cosmo->add_flag("!--no-lognormal", args->lognormal, "Store the Gaussian fields (no log-normal transform)");
  return [args](Communicator& world) { run_generate_cosmo(world, *args); };
}

}  // namespace tessera
