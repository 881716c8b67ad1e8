#pragma once
// The `tessera` command's subcommands.
#include <CLI/CLI.hpp>

#include "tessera/core/communicator.hpp"

namespace tessera {

/// Options are filled while parsing; the returned function runs the command.
std::function<void(Communicator&)> add_train_command(CLI::App& app);

}  // namespace tessera
