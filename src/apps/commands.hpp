#pragma once
// The `tessera` command's subcommands.
#include <CLI/CLI.hpp>

#include "tessera/core/communicator.hpp"

namespace tessera {

/// Options are filled while parsing; the returned function runs the command.
std::function<void(Communicator&)> add_train_command(CLI::App& app);
std::function<void(Communicator&)> add_job_command(CLI::App& app);

/// Remembers the command line and the environment as the process started, before MPI_Init adds
/// its own variables (`tessera job --submit` hands sbatch the environment from before).
void record_launch(int argc, char** argv);

}  // namespace tessera
