// `tessera` — one binary for every user-facing command. Runs under mpirun/srun; rank 0 speaks.
#include <mpi.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>
#include <thread>

#include "commands.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/log.hpp"
#include "tessera/core/signal_mask.hpp"
#include "tessera/io/convert.hpp"
#include "tessera/layers/runtime.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/parallel/mpi_communicator.hpp"

namespace {

/// Ranks on this node, from a shared-memory split of the world.
int ranks_on_node() {
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  int size = 1;
  MPI_Comm_size(node, &size);
  MPI_Comm_free(&node);
  return size;
}

int default_threads() {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / ranks_on_node());
}

}  // namespace

int& tessera::command_exit_code() {
  static int code = 0;
  return code;
}

/// `tessera scale ARGS`: the scaling-study driver (jobs/scale.py, Python for its plots), told to
/// submit with this binary. Runs before MPI starts: it is a plain front-end process.
int run_scale_driver(int argc, char** argv) {
  const std::string script = std::string(TESSERA_SOURCE_DIR) + "/jobs/scale.py";
  std::vector<std::string> args{"/usr/bin/python3", script};
  char self[4096];
  const ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  bool has_tessera = false;
  for (int i = 2; i < argc; ++i) has_tessera = has_tessera || std::string(argv[i]).rfind("--tessera", 0) == 0;
  if (length > 0 && !has_tessera) {
    args.emplace_back("--tessera");
    args.emplace_back(self, static_cast<std::size_t>(length));
  }
  for (int i = 2; i < argc; ++i) args.emplace_back(argv[i]);
  std::vector<char*> raw;
  for (auto& a : args) raw.push_back(a.data());
  raw.push_back(nullptr);
  execv(raw[0], raw.data());
  std::fprintf(stderr, "tessera: error: cannot run the study driver %s with %s: %s\n", script.c_str(), raw[0],
               std::strerror(errno));
  return 2;
}

int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "scale") return run_scale_driver(argc, argv);
  if (argc >= 2 && std::string(argv[1]) == "launch") return tessera::run_launch(argc, argv);
  tessera::record_launch(argc, argv);
  int provided = 0;
  // The MPI library's threads inherit this mask: the stop signals never reach them (`tessera
  // train` gives them a thread of their own, signals.hpp; other commands take their default action).
  tessera::block_stop_signals();
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  tessera::unblock_stop_signals();
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  tessera::set_process_rank(rank);
  auto world = tessera::MpiCommunicator::world();

  CLI::App app{"Tessera: hybrid-parallel deep-learning training (batch x model x domain) on MPI"};
  app.require_subcommand(1);
  app.fallthrough();  // options of the whole command (--threads, --verbose) also after the subcommand
  int threads = 0;
  app.add_option("--threads", threads, "Threads per rank (default: cores of the node / ranks on the node)");
  bool verbose = false;
  app.add_flag("--verbose", verbose, "Debug logging");

  std::function<void(tessera::Communicator&)> command;
  auto train = tessera::add_train_command(app);
  auto job = tessera::add_job_command(app);
  auto generate = tessera::add_generate_command(app);
  auto plan = tessera::add_plan_command(app);
  auto calibrate = tessera::add_calibrate_command(app);
  auto onnx = tessera::add_onnx_commands(app);

  auto* convert = app.add_subcommand("convert", "Convert a dataset to Tessera's HDF5 layout");
  convert->require_subcommand(1);
  auto* fmnist = convert->add_subcommand("fashion-mnist", "Fashion-MNIST IDX files -> train.h5 and test.h5");
  std::string source = "/usr/share/datasets/fashion-mnist", output = "data/fashion-mnist";
  fmnist->add_option("--source", source, "Folder with the gzipped IDX files (Debian: dataset-fashion-mnist)")
      ->capture_default_str();
  fmnist->add_option("--output", output, "Output folder")->capture_default_str();

  // Listed for --help; `main` runs these before MPI starts.
  app.add_subcommand("launch", "Run fault-tolerant replica groups, each its own MPI job, restarting any that fails "
                               "(--help for its options)")
      ->fallthrough(false)
      ->allow_extras();
  app.add_subcommand("scale", "Run a strong- or weak-scaling study under Slurm (jobs/scale.py; --help for its options)")
      ->fallthrough(false)
      ->allow_extras();

  int code = 0;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Every rank parses the same arguments and reaches the same verdict; rank 0 speaks.
    if (rank == 0) code = app.exit(e);
    else code = e.get_exit_code();
    MPI_Finalize();
    // --help exits 0; a malformed command line is bad input like any other: exit code 2 (CLI11's
    // own codes, 104 for a value that does not convert, 106 for a missing option, ..., say less).
    return code == 0 ? 0 : 2;
  }
  if (verbose) tessera::set_log_level(tessera::LogLevel::Debug);
  if (!command) {
    if (app.got_subcommand("train")) command = train;
    else if (app.got_subcommand("job")) command = job;
    else if (app.got_subcommand("generate")) command = generate;
    else if (app.got_subcommand("plan")) command = plan;
    else if (app.got_subcommand("calibrate")) command = calibrate;
    else if (app.got_subcommand("import") || app.got_subcommand("export")) command = onnx;
    else if (fmnist->parsed())
      command = [&](tessera::Communicator& comm) { tessera::convert_fashion_mnist(source, output, comm); };
  }

  try {
    if (threads <= 0) threads = default_threads();
    tessera::LayersRuntime runtime(threads);
    // Commands check their inputs collectively (every rank fails together, see
    // collective_guard.hpp); what fails on one rank alone after that ends the whole job below.
    command(*world);
    code = tessera::command_exit_code();  // e.g. kExitStopped: stopped on a signal, checkpoint written
  } catch (const tessera::AgreedFailure& e) {
    // Every rank is here with the same code: end cleanly, one message.
    if (e.is_origin()) {
      const std::string where = world->size() > 1 ? fmt::format(" (rank {})", e.failed_rank()) : "";
      std::fprintf(stderr, "tessera: error%s: %s\n", where.c_str(), e.origin_message().c_str());
    }
    code = e.exit_code();
  } catch (const std::exception& e) {
    // This rank alone failed while the others may wait for it in a collective: end them all.
    code = tessera::exit_code_for(e);
    std::fprintf(stderr, "tessera: error: %s\n", e.what());
    std::fflush(stderr);
    if (world->size() > 1) world->abort(code);
  }
  MPI_Finalize();
  return code;
}
