// Training state <-> checkpoint files. See include/tessera/train/checkpoint.hpp.
#include "tessera/train/checkpoint.hpp"

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "tessera/core/error.hpp"
#include "tessera/io/checkpoint.hpp"

namespace tessera {
namespace {

/// Where a tensor goes in the file and whether this rank writes it. A whole tensor (replicated on
/// every rank) is written by rank 0; a block of a model-parallel layer's weight (or of its
/// optimizer state) goes to its box of the global tensor, written by rank 0 of its replica group,
/// so that a checkpoint holds global tensors whatever the plan, and any plan can restore it.
struct Placement {
  std::vector<std::int64_t> global_shape;
  Box box;
  bool writes = false;
};

Placement replicated(const Tensor& tensor, Executor& executor) {
  Placement p;
  p.global_shape = tensor.shape().dims();
  if (p.global_shape.empty()) p.global_shape = {1};  // a scalar is stored as [1]
  p.box.begin.assign(p.global_shape.size(), 0);
  p.box.extent = p.global_shape;
  p.writes = executor.world().rank() == 0;
  return p;
}

/// Every tensor of the training state with its name in the file and its placement.
struct StateTensor {
  std::string name;
  Tensor* tensor;
  Placement placement;
  /// Buffers: the ranks holding the same block (their local statistics may differ).
  Communicator* group = nullptr;
};

std::string read_text_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return {};
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

Placement block_of(const Parameter& param, Communicator& replica_group) {
  Placement p;
  p.global_shape = param.whole_shape();
  p.box = param.whole_box();
  p.writes = replica_group.rank() == 0;
  return p;
}

std::vector<StateTensor> state_tensors(Model& model, Executor& executor, Optimizer& optimizer) {
  std::vector<StateTensor> out;
  // A parameter's optimizer state ("<parameter>.<suffix>") has the parameter's block.
  std::map<std::string, Placement> blocks;
  auto& nodes = model.nodes();
  for (std::size_t k = 0; k < nodes.size(); ++k)
    for (Parameter* p : nodes[k].layer->parameters()) {
      const Placement placement = p->sharded() ? block_of(*p, executor.replica_group(k, *p)) : replicated(p->value, executor);
      blocks[p->name] = placement;
      out.push_back({"param/" + p->name, &p->value, placement, nullptr});
    }
  for (auto& [name, tensor] : optimizer.state()) {
    const auto dot = name.rfind('.');
    const auto found = dot == std::string::npos ? blocks.end() : blocks.find(name.substr(0, dot));
    out.push_back({"optimizer/" + name, tensor, found != blocks.end() ? found->second : replicated(*tensor, executor),
                   nullptr});
  }
  for (std::size_t k = 0; k < nodes.size(); ++k) {
    const auto buffers = nodes[k].layer->buffers();
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      // A filter-split batch norm holds its block of the running statistics.
      Placement placement;
      placement.box = nodes[k].layer->buffer_box(i, placement.global_shape);
      if (placement.global_shape.empty()) placement = replicated(*buffers[i], executor);
      else placement.writes = executor.buffer_group(k).rank() == 0;
      out.push_back({fmt::format("buffer/{}.{}", nodes[k].layer->name(), i), buffers[i], placement,
                     &executor.buffer_group(k)});
    }
  }
  return out;
}

}  // namespace

std::string model_fingerprint(const Model& model) {
  std::string out;
  for (const auto& node : model.nodes())
    out += fmt::format("{} {} {}\n", node.layer->name(), node.layer->type(), node.output.to_string());
  return out;
}

std::string save_checkpoint(const std::string& dir, Model& model, Executor& executor, Optimizer& optimizer,
                            const CheckpointMeta& meta, int keep) {
  const auto params = model.parameters();
  optimizer.prepare(params);  // every state tensor exists, even for a parameter not stepped yet
  CheckpointWriter writer(dir, checkpoint_name(meta.step), executor.world());
  writer.set_attribute("step", meta.step);
  writer.set_attribute("epoch", meta.epoch);
  writer.set_attribute("global_batch", meta.global_batch);
  writer.set_attribute("seed", static_cast<std::int64_t>(meta.seed));
  writer.set_attribute("model_name", model.name());
  writer.set_attribute("model_text", read_text_file(model.source()));
  writer.set_attribute("model_fingerprint", model_fingerprint(model));
  writer.set_attribute("plan_text", meta.plan_text);
  writer.set_attribute("optimizer_type", std::string(optimizer.type()));
  writer.set_attribute("optimizer_steps", optimizer.steps_taken());
  writer.set_attribute("ranks", static_cast<std::int64_t>(executor.world().size()));
  for (auto& [name, device_tensor, p, buffer_group] : state_tensors(model, executor, optimizer)) {
    // Tensors on a GPU are written from a host copy (the same tensor when it is on the host).
    const Tensor host_copy = device_tensor->to(Device::host());
    const Tensor* tensor = &host_copy;
    if (buffer_group && buffer_group->size() > 1) {
      Communicator& group = *buffer_group;
      // Running statistics of local batch norm differ between the ranks of the sample group: store
      // their average (what evaluation uses). Global statistics are identical: stored as they are.
      const auto n = static_cast<std::size_t>(tensor->numel());
      Tensor high = tensor->clone(), low = tensor->clone();
      group.allreduce(high.data(), n, DType::F32, ReduceOp::Max);
      group.allreduce(low.data(), n, DType::F32, ReduceOp::Min);
      bool same = true;
      for (std::size_t i = 0; i < n && same; ++i) same = high.data()[i] == low.data()[i];
      if (!same) {
        Tensor mean = tensor->clone();
        group.allreduce(mean.data(), n, DType::F32, ReduceOp::Sum);
        for (std::size_t i = 0; i < n; ++i) mean.data()[i] /= static_cast<float>(group.size());
        writer.write_tensor(name, p.global_shape, p.box, mean.data(), p.writes);
        continue;
      }
    }
    const Tensor contiguous = tensor->is_contiguous() ? Tensor() : tensor->clone();
    writer.write_tensor(name, p.global_shape, p.box, contiguous.defined() ? contiguous.data() : tensor->data(),
                        p.writes);
  }
  return writer.finish(keep);
}

CheckpointMeta restore_checkpoint(const std::string& path, Model& model, Executor& executor, Optimizer& optimizer,
                                  const CheckpointMeta& expected) {
  CheckpointReader reader(path, executor.world());
  reader.verify();
  // Is it this model? Compare layer by layer and name the first that differs.
  const auto saved = lines(reader.string_attribute("model_fingerprint"));
  const auto mine = lines(model_fingerprint(model));
  for (std::size_t i = 0; i < std::max(saved.size(), mine.size()); ++i) {
    if (i < saved.size() && i < mine.size() && saved[i] == mine[i]) continue;
    fail_input("{}: the checkpoint is of another model ('{}'): layer {} is '{}' there but '{}' in model '{}'", path,
               reader.string_attribute("model_name"), i + 1, i < saved.size() ? saved[i] : "(none)",
               i < mine.size() ? mine[i] : "(none)", model.source());
  }
  const std::int64_t batch = reader.int_attribute("global_batch");
  if (batch != expected.global_batch)
    fail_input("{}: the checkpoint was trained with global batch {}, this run asks for {}; resume with --batch {}",
               path, batch, expected.global_batch, batch);
  const auto seed = static_cast<std::uint64_t>(reader.int_attribute("seed"));
  if (seed != expected.seed)
    fail_input("{}: the checkpoint was trained with seed {}, this run asks for {}; resume with --seed {}", path, seed,
               expected.seed, seed);
  const std::string optimizer_type = reader.string_attribute("optimizer_type");
  if (optimizer_type != optimizer.type())
    fail_input("{}: the checkpoint was trained with optimizer '{}', this run uses '{}'", path, optimizer_type,
               optimizer.type());

  optimizer.prepare(model.parameters());
  const auto tensors = state_tensors(model, executor, optimizer);
  // Check every tensor before changing any.
  for (const auto& [name, tensor, p, group] : tensors) {
    if (!reader.has_tensor(name)) fail_input("{}: the checkpoint holds no tensor '{}'", path, name);
    const auto& want = p.global_shape;
    const auto have = reader.tensor_shape(name);
    if (have != want)
      fail_input("{}: tensor '{}' has shape [{}] in the checkpoint, but the model's is [{}]", path, name,
                 fmt::join(have, ", "), fmt::join(want, ", "));
    if (!tensor->is_contiguous()) fail("{}: state tensor '{}' is not contiguous", path, name);
  }
  for (const auto& [name, tensor, p, group] : tensors) {
    if (tensor->device().is_host()) {
      reader.read_tensor(name, p.box, tensor->data());
    } else {  // read on the host, then copied to the GPU
      Tensor staging(tensor->shape());
      reader.read_tensor(name, p.box, staging.data());
      tensor->copy_from(staging);
    }
  }
  optimizer.set_steps_taken(reader.int_attribute("optimizer_steps"));
  CheckpointMeta meta;
  meta.step = reader.int_attribute("step");
  meta.epoch = reader.int_attribute("epoch");
  meta.global_batch = batch;
  meta.seed = seed;
  meta.plan_text = reader.string_attribute("plan_text");
  return meta;
}

}  // namespace tessera
