// `tessera import onnx` and `tessera export onnx`: networks from and to ONNX (docs/onnx.md).
#include <filesystem>
#include <fstream>
#include <sstream>

#include "commands.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/log.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/train/checkpoint.hpp"
#include "tessera/train/model.hpp"
#include "tessera/train/onnx.hpp"

namespace tessera {
namespace {

namespace fs = std::filesystem;

std::string read_file(const std::string& path) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) fail_input("{}: no such file", path);
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  if (!in) fail_input("{}: cannot read it", path);
  return bytes.str();
}

/// Writes `bytes` to `path` through a temporary file and a rename: never half a file.
void write_file(const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << bytes;
    out.flush();
    if (!out) fail_input("cannot write '{}'", tmp);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) fail_input("cannot rename '{}' to '{}': {}", tmp, path, ec.message());
}

struct ImportArgs {
  std::string onnx, output;
  OnnxImportOptions options;
};

void run_import(const ImportArgs& args, Communicator& comm) {
  ImportedModel imported;
  std::optional<Model> model;
  collectively(comm, [&] {
    OnnxImportOptions options = args.options;
    options.fallback_name = fs::path(args.onnx).stem().string();
    imported = import_onnx(read_file(args.onnx), args.onnx, options);
    std::error_code ec;
    fs::create_directories(args.output, ec);
    if (ec) fail_input("cannot create '{}': {}", args.output, ec.message());
    ModelOptions model_options;
    model_options.allocate_parameters = false;
    model.emplace(Model::parse(imported.model_text, args.onnx, model_options));
  });
  // The weights first, the model file last: a model.yaml is only ever there with its weights.
  const std::string weights = save_weights(args.output, "weights", *model, imported.model_text, imported.tensors, comm);
  const std::string model_path = (fs::path(args.output) / "model.yaml").string();
  collectively(comm, [&] {
    if (comm.rank() == 0) write_file(model_path, imported.model_text);
  });
  if (comm.rank() == 0) {
    fmt::print("imported {}: {} layers, {} parameters\n  model file: {}\n  weights:    {}\n", args.onnx,
               model->nodes().size(), model->parameter_count(), model_path, weights);
    fmt::print("train from them with: tessera train --model {} --init {} --data ...\n", model_path, weights);
  }
}

struct ExportArgs {
  std::string checkpoint, output;
};

void run_export(const ExportArgs& args, Communicator& comm) {
  collectively(comm, [&] {
    const WeightsFile weights = read_weights(args.checkpoint, comm);
    const std::string bytes = export_onnx(weights.model_text, args.checkpoint, weights.tensors);
    if (comm.rank() == 0) {
      const auto parent = fs::path(args.output).parent_path();
      std::error_code ec;
      if (!parent.empty()) fs::create_directories(parent, ec);
      write_file(args.output, bytes);
      fmt::print("exported {} to {} ({} bytes, ONNX opset 13)\n", args.checkpoint, args.output, bytes.size());
    }
  });
}

}  // namespace

std::function<void(Communicator&)> add_onnx_commands(CLI::App& app) {
  auto import_args = std::make_shared<ImportArgs>();
  auto export_args = std::make_shared<ExportArgs>();
  auto* import_cmd = app.add_subcommand("import", "Import a network from another framework's format");
  import_cmd->require_subcommand(1);
  auto* import_onnx_cmd = import_cmd->add_subcommand(
      "onnx", "An ONNX graph (e.g. from torch.onnx.export) -> DIR/model.yaml and its weights DIR/weights.h5 "
              "(train from them with --init)");
  import_onnx_cmd->add_option("model", import_args->onnx, "The .onnx file")->required();
  import_onnx_cmd->add_option("-o,--output", import_args->output, "Folder for model.yaml and weights.h5")->required();
  import_onnx_cmd->add_option("--loss", import_args->options.loss,
                              "The model's loss: softmax_cross_entropy (default) or mse (a graph Tessera exported "
                              "names its own)")
      ->check(CLI::IsMember({"softmax_cross_entropy", "mse"}));
  import_onnx_cmd->add_option("--name", import_args->options.name, "The model's name (default: the file's stem)");

  auto* export_cmd = app.add_subcommand("export", "Export a trained network to another framework's format");
  export_cmd->require_subcommand(1);
  auto* export_onnx_cmd = export_cmd->add_subcommand(
      "onnx", "A checkpoint (or weights file) -> an ONNX inference graph with its weights (opset 13)");
  export_onnx_cmd->add_option("--checkpoint", export_args->checkpoint, "Checkpoint or weights file (.h5)")->required();
  export_onnx_cmd->add_option("-o,--output", export_args->output, "The .onnx file to write")->required();

  return [import_onnx_cmd, import_args, export_args](Communicator& comm) {
    if (import_onnx_cmd->parsed()) run_import(*import_args, comm);
    else run_export(*export_args, comm);
  };
}

}  // namespace tessera
