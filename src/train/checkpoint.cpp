// Training state <-> checkpoint files. See include/tessera/train/checkpoint.hpp.
#include "tessera/train/checkpoint.hpp"

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "tessera/core/error.hpp"
#include "tessera/io/checkpoint.hpp"
#include "tessera/parallel/synchronizer.hpp"

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
  /// Writes its replica group's copy (the same rule within each group; `writes` is group 0's).
  bool group_writes = false;
};

Placement replicated(const Tensor& tensor, Executor& executor) {
  Placement p;
  p.global_shape = tensor.shape().dims();
  if (p.global_shape.empty()) p.global_shape = {1};  // a scalar is stored as [1]
  p.box.begin.assign(p.global_shape.size(), 0);
  p.box.extent = p.global_shape;
  p.group_writes =
      replica_place(executor.world().rank(), executor.world().size(), executor.replica_groups()).rank == 0;
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
  /// Parameters and optimizer state: each replica group's own copy is kept too where groups differ.
  bool per_group = false;
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
  p.group_writes = replica_group.rank() == 0;
  p.writes = p.group_writes;
  return p;
}

Placement per_group(const Placement& p, int group, int groups);

/// Is the file's model this one? Compares layer by layer and names the first that differs.
void check_same_model(const CheckpointReader& reader, const Model& model);

/// With replica groups, parameters and optimizer state are written by group 0 (each group's
/// copies of them are the same, or the consensus is written: see save_checkpoint).
bool in_first_group(Executor& executor) { return executor.replica_group_index() == 0; }

std::vector<StateTensor> state_tensors(Model& model, Executor& executor, Optimizer& optimizer,
                                       Synchronizer* sync) {
  std::vector<StateTensor> out;
  // A parameter's optimizer state ("<parameter>.<suffix>") has the parameter's block.
  std::map<std::string, Placement> blocks;
  auto& nodes = model.nodes();
  const bool first = in_first_group(executor);
  for (std::size_t k = 0; k < nodes.size(); ++k)
    for (Parameter* p : nodes[k].layer->parameters()) {
      Placement placement = p->sharded() ? block_of(*p, executor.replica_group(k, *p)) : replicated(p->value, executor);
      placement.writes = placement.writes && first;
      blocks[p->name] = placement;
      out.push_back({"param/" + p->name, &p->value, placement, nullptr, true});
    }
  for (auto& [name, tensor] : optimizer.state()) {
    const auto dot = name.rfind('.');
    const auto found = dot == std::string::npos ? blocks.end() : blocks.find(name.substr(0, dot));
    out.push_back({"optimizer/" + name, tensor, found != blocks.end() ? found->second : replicated(*tensor, executor),
                   nullptr, true});
  }
  if (sync)
    for (auto& [name, tensor, per_group_state] : sync->state()) {
      const auto found = blocks.find(name.substr(name.rfind('/') + 1));
      if (found == blocks.end()) fail("checkpoint: synchronizer state '{}' names no parameter", name);
      StateTensor t{"sync/" + name, tensor, found->second, nullptr, false};
      if (per_group_state) {  // each group's own: stored with the group outermost
        t.placement = per_group(found->second, executor.replica_group_index(), sync->groups());
      }
      out.push_back(t);
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
                     &executor.buffer_group(k), false});
    }
  }
  return out;
}

/// Where group `group`'s copy of a tensor placed as `p` goes among `groups` copies: one more
/// (outermost) dimension; written by the ranks of that group that would write `p` in group 0.
Placement per_group(const Placement& p, int group, int groups) {
  Placement q;
  q.global_shape = p.global_shape;
  q.global_shape.insert(q.global_shape.begin(), groups);
  q.box = p.box;
  q.box.begin.insert(q.box.begin.begin(), group);
  q.box.extent.insert(q.box.extent.begin(), 1);
  q.writes = p.group_writes;
  return q;
}

/// The synchronizer's counters as attributes, and back.
void write_sync_stats(CheckpointWriter& writer, const Synchronizer& sync) {
  const SyncStats& s = sync.stats();
  writer.set_attribute("sync_mode", sync.options().mode);
  writer.set_attribute("sync_groups", static_cast<std::int64_t>(sync.groups()));
  writer.set_attribute("sync_syncs", s.syncs);
  writer.set_attribute("sync_bytes", s.bytes);
  writer.set_attribute("sync_gain", s.gain);
  writer.set_attribute("sync_scaled_time", s.scaled_time);
  writer.set_attribute("sync_consensus", s.consensus.value_or(-1.0));
  writer.set_attribute("sync_gain_variance", s.gain_variance);
  writer.set_attribute("sync_gain_square", s.gain_square);
  writer.set_attribute("sync_gain_updates", s.gain_updates);
  writer.set_attribute("sync_staleness", s.staleness);
  writer.set_attribute("sync_wait_seconds", s.wait_seconds);
}

SyncStats read_sync_stats(CheckpointReader& reader) {
  SyncStats s;
  s.syncs = reader.int_attribute("sync_syncs");
  s.bytes = reader.double_attribute("sync_bytes");
  s.gain = reader.double_attribute("sync_gain");
  s.scaled_time = reader.double_attribute("sync_scaled_time");
  const double consensus = reader.double_attribute("sync_consensus");
  if (consensus >= 0) s.consensus = consensus;
  s.gain_variance = reader.double_attribute("sync_gain_variance");
  s.gain_square = reader.double_attribute("sync_gain_square");
  s.gain_updates = reader.int_attribute("sync_gain_updates");
  s.staleness = reader.int_attribute("sync_staleness");
  s.wait_seconds = reader.double_attribute("sync_wait_seconds");
  return s;
}

/// Whether the checkpoint was written by the same synchronization over as many groups (its
/// per-group tensors and counters then resume bit for bit).
bool same_sync(CheckpointReader& reader, const Synchronizer& sync) {
  return reader.has_attribute("sync_mode") && reader.string_attribute("sync_mode") == sync.options().mode &&
         reader.int_attribute("sync_groups") == sync.groups();
}

void check_same_model(const CheckpointReader& reader, const Model& model) {
  const auto saved = lines(reader.string_attribute("model_fingerprint"));
  const auto mine = lines(model_fingerprint(model));
  for (std::size_t i = 0; i < std::max(saved.size(), mine.size()); ++i) {
    if (i < saved.size() && i < mine.size() && saved[i] == mine[i]) continue;
    fail_input("{}: the file is of another model ('{}'): layer {} is '{}' there but '{}' in model '{}'",
               reader.path(), reader.string_attribute("model_name"), i + 1, i < saved.size() ? saved[i] : "(none)",
               i < mine.size() ? mine[i] : "(none)", model.source());
  }
}

/// Reads `box` of tensor `name` into `tensor`: straight into host memory, or through a host copy
/// to a GPU.
void read_into(CheckpointReader& reader, const std::string& name, const Box& box, Tensor& tensor) {
  if (tensor.device().is_host()) {
    reader.read_tensor(name, box, tensor.data());
    return;
  }
  Tensor staging(tensor.shape());
  reader.read_tensor(name, box, staging.data());
  tensor.copy_from(staging);
}

bool is_weight(const std::string& name) { return name.rfind("param/", 0) == 0 || name.rfind("buffer/", 0) == 0; }

}  // namespace

std::vector<Tensor*> training_state(Model& model, Executor& executor, Optimizer& optimizer) {
  optimizer.prepare(model.parameters());
  std::vector<Tensor*> out;
  for (const StateTensor& t : state_tensors(model, executor, optimizer, nullptr)) out.push_back(t.tensor);
  return out;
}

std::string model_fingerprint(const Model& model) {
  std::string out;
  for (const auto& node : model.nodes())
    out += fmt::format("{} {} {}\n", node.layer->name(), node.layer->type(), node.output.to_string());
  return out;
}

std::string save_checkpoint(const std::string& dir, Model& model, Executor& executor, Optimizer& optimizer,
                            const CheckpointMeta& meta, int keep, Synchronizer* sync) {
  const auto params = model.parameters();
  optimizer.prepare(params);  // every state tensor exists, even for a parameter not stepped yet
  // Where groups differ, param/ holds the consensus model (what evaluation uses) and replica/
  // each group's own parameters and optimizer state.
  const bool differ = sync && sync->groups() > 1 && sync->groups_differ();
  std::vector<Tensor> consensus;
  if (differ) consensus = sync->consensus(/*record=*/false);  // in model.parameters() order, as state_tensors lists them
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
  if (sync) write_sync_stats(writer, *sync);
  std::size_t param_index = 0;
  for (auto& [name, device_tensor, p, buffer_group, per_group_copy] : state_tensors(model, executor, optimizer, sync)) {
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
    const float* data = contiguous.defined() ? contiguous.data() : tensor->data();
    if (differ && per_group_copy) {
      const Placement q = per_group(p, executor.replica_group_index(), sync->groups());
      writer.write_tensor("replica/" + name, q.global_shape, q.box, data, q.writes);
      if (name.rfind("param/", 0) == 0) data = consensus[param_index++].data();
    }
    writer.write_tensor(name, p.global_shape, p.box, data, p.writes);
  }
  return writer.finish(keep);
}

CheckpointMeta restore_checkpoint(const std::string& path, Model& model, Executor& executor, Optimizer& optimizer,
                                  const CheckpointMeta& expected, Synchronizer* sync) {
  CheckpointReader reader(path, executor.world());
  reader.verify();
  check_same_model(reader, model);
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
  const auto tensors = state_tensors(model, executor, optimizer, sync);
  // The same synchronization over as many groups resumes each group's own copies, the mode's
  // state and its counters; any other start reads the consensus model and makes the rest anew.
  const bool resumes_sync = sync && same_sync(reader, *sync);
  const bool per_group_copies = resumes_sync && sync->groups() > 1 && sync->groups_differ();
  const auto source = [&](const StateTensor& t) {
    return per_group_copies && t.per_group ? "replica/" + t.name : t.name;
  };
  const auto box = [&](const StateTensor& t) {
    return per_group_copies && t.per_group ? per_group(t.placement, executor.replica_group_index(), sync->groups()).box
                                           : t.placement.box;
  };
  // Check every tensor before changing any.
  for (const auto& t : tensors) {
    if (t.name.rfind("sync/", 0) == 0 && !resumes_sync) continue;
    const std::string name = source(t);
    if (!reader.has_tensor(name)) fail_input("{}: the checkpoint holds no tensor '{}'", path, name);
    auto want = t.placement.global_shape;
    if (name != t.name) want.insert(want.begin(), sync->groups());
    const auto have = reader.tensor_shape(name);
    if (have != want)
      fail_input("{}: tensor '{}' has shape [{}] in the checkpoint, but the model's is [{}]", path, name,
                 fmt::join(have, ", "), fmt::join(want, ", "));
    if (!t.tensor->is_contiguous()) fail("{}: state tensor '{}' is not contiguous", path, name);
  }
  for (const auto& t : tensors) {
    if (t.name.rfind("sync/", 0) == 0 && !resumes_sync) continue;
    read_into(reader, source(t), box(t), *t.tensor);
  }
  if (sync && resumes_sync) {
    sync->set_stats(read_sync_stats(reader));
    sync->restored(reader.int_attribute("step"));
  }
  else if (sync) sync->reset_state();
  optimizer.set_steps_taken(reader.int_attribute("optimizer_steps"));
  CheckpointMeta meta;
  meta.step = reader.int_attribute("step");
  meta.epoch = reader.int_attribute("epoch");
  meta.global_batch = batch;
  meta.seed = seed;
  meta.plan_text = reader.string_attribute("plan_text");
  return meta;
}

void load_weights(const std::string& path, Model& model, Executor& executor, Optimizer& optimizer) {
  CheckpointReader reader(path, executor.world());
  reader.verify();
  check_same_model(reader, model);
  optimizer.prepare(model.parameters());
  std::vector<StateTensor> weights;
  for (auto& t : state_tensors(model, executor, optimizer, nullptr))
    if (is_weight(t.name)) weights.push_back(t);
  for (const auto& t : weights) {  // every check before any change
    if (!reader.has_tensor(t.name)) fail_input("{}: the file holds no tensor '{}'", path, t.name);
    if (reader.tensor_shape(t.name) != t.placement.global_shape)
      fail_input("{}: tensor '{}' has shape [{}] in the file, but the model's is [{}]", path, t.name,
                 fmt::join(reader.tensor_shape(t.name), ", "), fmt::join(t.placement.global_shape, ", "));
    if (!t.tensor->is_contiguous()) fail("{}: tensor '{}' is not contiguous", path, t.name);
  }
  for (const auto& t : weights) {
    read_into(reader, t.name, t.placement.box, *t.tensor);
  }
}

std::string save_weights(const std::string& dir, const std::string& name, const Model& model,
                         const std::string& model_text, const std::vector<NamedTensor>& tensors, const Communicator& comm) {
  CheckpointWriter writer(dir, name, comm);
  writer.set_attribute("model_name", model.name());
  writer.set_attribute("model_text", model_text);
  writer.set_attribute("model_fingerprint", model_fingerprint(model));
  for (const auto& [tensor_name, value] : tensors) {
    const Tensor whole = value.is_contiguous() ? value : value.clone();
    const auto dims = whole.shape().dims();
    Box box;
    box.begin.assign(dims.size(), 0);
    box.extent = dims;
    writer.write_tensor(tensor_name, dims, box, whole.data(), comm.rank() == 0);
  }
  return writer.finish(0);
}

WeightsFile read_weights(const std::string& path, const Communicator& comm) {
  CheckpointReader reader(path, comm);
  reader.verify();
  WeightsFile out;
  out.model_text = reader.has_attribute("model_text") ? reader.string_attribute("model_text") : std::string();
  if (out.model_text.empty()) fail_input("{}: the file holds no model text (it was not written by Tessera's training or import)", path);
  for (const auto& name : reader.tensor_names()) {
    if (!is_weight(name)) continue;
    const auto dims = reader.tensor_shape(name);
    Tensor value{Shape(dims)};
    Box box;
    box.begin.assign(dims.size(), 0);
    box.extent = dims;
    reader.read_tensor(name, box, value.data());
    out.tensors.push_back({name, std::move(value)});
  }
  return out;
}

}  // namespace tessera
