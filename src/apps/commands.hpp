#pragma once
// The `tessera` command's subcommands.
#include <CLI/CLI.hpp>

#include "tessera/core/communicator.hpp"

namespace tessera {

/// Options are filled while parsing; the returned function runs the command.
std::function<void(Communicator&)> add_train_command(CLI::App& app);
std::function<void(Communicator&)> add_job_command(CLI::App& app);
std::function<void(Communicator&)> add_generate_command(CLI::App& app);
std::function<void(Communicator&)> add_plan_command(CLI::App& app);
std::function<void(Communicator&)> add_calibrate_command(CLI::App& app);
/// `tessera import onnx` and `tessera export onnx`.
std::function<void(Communicator&)> add_onnx_commands(CLI::App& app);

/// `tessera launch ARGS`: the supervisor of fault-tolerant replica groups (before MPI starts).
int run_launch(int argc, char** argv);
/// The exit code a command asks for when it ends without an error (0 unless set; every rank sets
/// the same). `tessera train` sets kExitStopped (signals.hpp) when it stopped on a signal.
int& command_exit_code();

/// Remembers the command line and the environment as the process started, before MPI_Init adds
/// its own variables (`tessera job --submit` hands sbatch the environment from before).
void record_launch(int argc, char** argv);

}  // namespace tessera
