#pragma once
// Saving and restoring the training state as a checkpoint file (io/checkpoint.hpp): every
// parameter, the optimizer's state tensors and step count, the layers' buffers (batch-norm running
// statistics), and the attributes that say what was trained: the next step, epoch, global batch,
// seed, model file text and fingerprint, plan, optimizer type.
//
// Nothing else needs saving. Data order, dropout masks and the learning rate are functions of
// (seed, step) in Tessera: EpochSampler(epoch, index) draws the epoch's permutation from the
// counter-based RNG keyed by the seed, dropout masks are keyed by (seed, layer, step, global
// element), and LrSchedule::lr(step) is a pure function. Restoring the step restores all three, so
// a resumed run on the same ranks is bit-identical to an uninterrupted one.
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/train/executor.hpp"
#include "tessera/train/model.hpp"
#include "tessera/train/onnx.hpp"
#include "tessera/train/optimizer.hpp"

namespace tessera {

class Synchronizer;

struct CheckpointMeta {
  std::int64_t step = 0;  ///< the next step to run
  std::int64_t epoch = 0;
  std::int64_t global_batch = 0;
  std::uint64_t seed = 0;
  std::string plan_text;
};

/// "layer type [output shape]" per line: what a checkpoint must match to be restored.
std::string model_fingerprint(const Model& model);

/// Writes the state to `<dir>/ckpt-<step>.h5` (collective over executor.world()) and keeps the
/// newest `keep` checkpoints. Returns the path. With replica groups, `sync` (may be null) adds
/// what its mode needs: its state tensors ("sync/<kind>/<parameter>"), its counters (attributes
/// "sync_*"), and where groups differ each group's parameters and optimizer state as
/// "replica/<name>" (one more, outermost dimension: the group) while "param/" holds the consensus.
std::string save_checkpoint(const std::string& dir, Model& model, Executor& executor, Optimizer& optimizer,
                            const CheckpointMeta& meta, int keep = 3, Synchronizer* sync = nullptr);

/// This rank's tensors of the training state, in the order checkpoints list them: parameters,
/// optimizer state, layers' buffers (what healing a fault-tolerant replica group copies).
std::vector<Tensor*> training_state(Model& model, Executor& executor, Optimizer& optimizer);
/// Restores the state from `path` (collective): verifies the file, then checks it against the model
/// (fingerprint: InputError naming the file and the first differing layer) and `expected`'s global
/// batch and seed (InputError saying what differs). Nothing is changed unless every check passes.
/// Returns the checkpoint's metadata (step = the next step to run). With `sync`, a checkpoint of
/// the same mode over as many groups resumes each group's own copies and the mode's state and
/// counters bit for bit; any other starts every group from the consensus model and makes the
/// mode's state anew.
CheckpointMeta restore_checkpoint(const std::string& path, Model& model, Executor& executor, Optimizer& optimizer,
                                  const CheckpointMeta& expected, Synchronizer* sync = nullptr);

/// Starts training from the parameters and layer buffers (batch-norm running statistics) of a
/// weights file (`tessera import onnx`) or a checkpoint of the same model (collective; each rank
/// reads its blocks, so any plan loads any file). The optimizer and the step start afresh.
/// InputError naming the file and the first differing layer for another model's file.
void load_weights(const std::string& path, Model& model, Executor& executor, Optimizer& optimizer);

/// Writes whole tensors named as checkpoints name them ("param/<parameter>", "buffer/<layer>.<i>")
/// as `<dir>/<name>.h5`, with the model they belong to (its text and fingerprint): a file that
/// load_weights() and read_weights() take. Collective over `comm` (rank 0 writes). Returns the path.
std::string save_weights(const std::string& dir, const std::string& name, const Model& model,
                         const std::string& model_text, const std::vector<NamedTensor>& tensors, const Communicator& comm);

/// The model text and every parameter and buffer, whole, of a weights file or checkpoint (verified
/// first; collective).
struct WeightsFile {
  std::string model_text;
  std::vector<NamedTensor> tensors;
};
WeightsFile read_weights(const std::string& path, const Communicator& comm);

}  // namespace tessera
