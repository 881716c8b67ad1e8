// tessera_onnx_oracle: plain SGD steps of a model from its weights file on one batch, under a
// plan on this job's ranks; writes each step's loss, every parameter's first gradient and the
// final parameters (whole tensors) for tests/onnx/pytorch_oracle.py to compare with PyTorch.
#include <hdf5.h>
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>

#include "training_test_util.hpp"
#include "tessera/core/error.hpp"
#include "tessera/io/checkpoint.hpp"
#include "tessera/layers/runtime.hpp"
#include "tessera/parallel/mpi_communicator.hpp"
#include "tessera/train/checkpoint.hpp"
#include "tessera/train/executor.hpp"
#include "tessera/train/optimizer.hpp"

namespace tessera {
namespace {

/// Dataset `name` of an HDF5 file, whole, as float32.
Tensor read_whole(const std::string& path, const std::string& name) {
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (file < 0) fail_input("{}: cannot open", path);
  const hid_t set = H5Dopen2(file, name.c_str(), H5P_DEFAULT);
  if (set < 0) fail_input("{}: no dataset '{}'", path, name);
  const hid_t space = H5Dget_space(set);
  std::vector<hsize_t> dims(static_cast<std::size_t>(H5Sget_simple_extent_ndims(space)));
  H5Sget_simple_extent_dims(space, dims.data(), nullptr);
  Tensor out{Shape(std::vector<std::int64_t>(dims.begin(), dims.end()))};
  if (H5Dread(set, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data()) < 0) fail_input("{}: cannot read '{}'", path, name);
  H5Sclose(space);
  H5Dclose(set);
  H5Fclose(file);
  return out;
}

void run(const std::string& model_path, const std::string& plan_path, const std::string& weights,
         const std::string& data, int steps, double lr, const std::string& output) {
  auto world = MpiCommunicator::world();
  ModelOptions model_options;
  model_options.allocate_parameters = false;
  Model model = Model::load(model_path, model_options);
  const Tensor inputs = read_whole(data, "inputs"), targets = read_whole(data, "targets");
  const std::int64_t batch = inputs.dim(0);
  const Plan plan = plan_path.empty() ? Plan::sample_parallel(world->size()) : Plan::load(plan_path);
  ExecutorOptions options;
  options.global_batch = batch;
  options.seed = 1;
  options.init_seed = 1;
  Executor executor(model, plan, world, options);
  auto optimizer = create_optimizer(OptimizerConfig{});
  load_weights(weights, model, executor, *optimizer);

  const auto [begin, end] = executor.local_samples(batch);
  const Tensor local_inputs = testing::local_tile(inputs, begin, end, executor.input_sample_box());
  const Tensor local_targets = targets.slice(begin, end).clone();
  const std::filesystem::path out(output);
  CheckpointWriter writer(out.parent_path().string(), out.stem().string(), *world);
  const auto params = model.parameters();
  /// Writes every parameter's value or gradient, each block by one of the ranks holding it.
  const auto write_all = [&](const std::string& prefix, bool gradients) {
    for (std::size_t k = 0; k < model.nodes().size(); ++k)
      for (Parameter* p : model.nodes()[k].layer->parameters()) {
        const Tensor host = (gradients ? p->grad : p->value).to(Device::host()).clone();
        const bool writes = p->sharded() ? executor.replica_group(k, *p).rank() == 0 : world->rank() == 0;
        writer.write_tensor(prefix + p->name, p->whole_shape(), p->whole_box(), host.data(), writes);
      }
  };
  for (int step = 0; step < steps; ++step) {
    const BatchResult r = executor.train_step(local_inputs, local_targets, batch, step);
    writer.set_attribute(fmt::format("loss_{}", step), r.mean_loss());
    if (step == 0) write_all("grad/", true);
    optimizer->step(params, lr);
  }
  write_all("param/", false);
  writer.finish(0);
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  CLI::App app{"Plain SGD steps of a model from a weights file on one batch (tests/onnx)"};
  std::string model, plan, weights, data, output;
  int steps = 3;
  double lr = 0.05;
  app.add_option("--model", model)->required();
  app.add_option("--plan", plan);
  app.add_option("--weights", weights)->required();
  app.add_option("--data", data)->required();
  app.add_option("--steps", steps);
  app.add_option("--lr", lr);
  app.add_option("--output", output)->required();
  int code = 0;
  try {
    app.parse(argc, argv);
    tessera::LayersRuntime runtime(1);
    tessera::run(model, plan, weights, data, steps, lr, output);
  } catch (const CLI::ParseError& e) {
    code = app.exit(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessera_onnx_oracle: error: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return code;
}
