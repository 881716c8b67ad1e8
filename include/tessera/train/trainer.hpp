#pragma once
// The training loop: epochs over a shuffled dataset (the same order on every rank), each rank
// reading only its samples of each batch, the next batch prefetched while this one trains;
// validation every N steps; metrics as JSON lines and CSV; a progress line on rank 0.
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "tessera/core/clock.hpp"
#include "tessera/parallel/fault_tolerance.hpp"
#include "tessera/parallel/straggler.hpp"
#include "tessera/parallel/synchronizer.hpp"
#include "tessera/train/executor.hpp"
#include "tessera/train/optimizer.hpp"
#include "tessera/train/schedule.hpp"

namespace tessera {

class Dataset;

struct TrainerOptions {
  std::int64_t epochs = 1;
  /// Stop after this many steps (0: run all epochs).
  std::int64_t max_steps = 0;
  std::int64_t global_batch = 64;
  /// Validate every this many steps (0: at the end of each epoch only).
  std::int64_t eval_every = 0;
  /// Samples per validation batch (0: global_batch, so that validation holds no more activation
  /// memory than a training step, which is what the planner counts; a larger one also grows the
  /// executor's buffers for the rest of the run).
  std::int64_t eval_batch = 0;
  std::uint64_t seed = 1;
  bool shuffle = true;
  /// Print a progress line every this many steps.
  std::int64_t progress_every = 50;
  /// Folder for metrics.jsonl, metrics.csv and summary.json (empty: none).
  std::string metrics_dir;
  OptimizerConfig optimizer;
  ScheduleConfig schedule;
  /// Checkpoints (see train/checkpoint.hpp): folder (empty: none), every this many steps (0: only
  /// at the end and when a stop is requested), how many to keep.
  std::string checkpoint_dir;
  std::int64_t checkpoint_every = 0;
  int keep_checkpoints = 3;
  /// "": start from scratch; "auto": the newest valid checkpoint in checkpoint_dir (from scratch
  /// when there is none); else the path of a checkpoint file.
  std::string resume;
  /// A weights file (`tessera import onnx`) or checkpoint whose parameters and layer buffers a run
  /// that resumes nothing starts from (empty: the seed's initial weights).
  std::string init;
  /// The plan's text, stored in checkpoints.
  std::string plan_text;
  /// How replica groups synchronize (synchronizer.hpp); the executor must have been made with
  /// ExecutorOptions::within_groups = sums_within_groups(sync).
  SyncOptions sync;
  /// Fault-tolerant replica groups (store empty: off): this job is group fault_tolerance.group of
  /// fault_tolerance.groups, each its own MPI job, exchanging over Gloo; global_batch is then one
  /// group's batch, and group g reads block g of each batch of groups x global_batch samples.
  FaultToleranceOptions fault_tolerance;
  /// With fewer live groups than started: "keep-lr" keeps the learning rate (each group keeps its
  /// batch, so the step's batch shrinks), "scale-lr" scales it by live / started groups.
  std::string on_shrink = "keep-lr";
  /// Testing aid: rank 0 sends itself SIGKILL at step `kill_step` (-1: never): before the step's
  /// compute, or with kill_in_sync as the step's exchange across groups begins.
  std::int64_t kill_step = -1;
  bool kill_in_sync = false;
  /// Keep the metrics files' rows of the steps before this run's first step (a restarted replica
  /// group; resuming from a checkpoint does so too).
  bool append_metrics = false;
  /// A testing aid: every collective across replica groups takes this much longer.
  CommDelay comm_delay;
  /// A testing aid: replica groups that sleep after a step's compute (straggler.hpp).
  StragglerSpec straggler;
  /// Set by anyone (a signal handler) to stop at the next step boundary: every rank agrees on it
  /// (one tiny allreduce per step, only when this is set), saves a checkpoint at the same step
  /// and run() returns with TrainSummary::stopped.
  const std::atomic<bool>* stop_request = nullptr;
  /// Testing aid: rank `fail_rank` throws at step `fail_step` (-1: never).
  int fail_rank = -1;
  std::int64_t fail_step = -1;
  /// A rank that sees no finished step for this many seconds prints what it is stuck in and ends
  /// the job with exit code 4 (0: no watchdog).
  double watchdog_seconds = 600;
  /// Testing aid: rank `hang_rank` sleeps forever at step `hang_step` (-1: never).
  int hang_rank = -1;
  std::int64_t hang_step = -1;
};

struct TrainSummary {
  /// The step reached (the next step to run), counted from the start of training.
  std::int64_t steps = 0;
  /// The step this run started at (> 0 after a resume).
  std::int64_t start_step = 0;
  /// True when a stop request ended the run early (after saving a checkpoint).
  bool stopped = false;
  /// Path of the last checkpoint written (empty: none).
  std::string last_checkpoint;
  /// Seconds spent writing checkpoints (included in `seconds`).
  double checkpoint_seconds = 0;
  double final_loss = 0;
  std::optional<double> val_loss;
  std::optional<double> val_accuracy;
  double samples_per_second = 0;
  double seconds = 0;
  /// Seconds waiting for communication (the slowest rank's).
  double comm_wait_seconds = 0;
  /// What crossed replica groups (Synchronizer::stats): syncs, bytes, the last gain and consensus.
  SyncStats sync;
  /// Per replica group: the seconds it waited for the others (its slowest rank's sync wait).
  std::vector<double> group_wait_seconds;
  /// Fault-tolerant replica groups: what this group saw, and the seconds of its steps that were
  /// committed (effective training time = committed_seconds / seconds).
  std::optional<ReplicaStats> replicas;
  double committed_seconds = 0;
  /// Fault-tolerant replica groups: the other groups had finished training before this one joined.
  bool finished_elsewhere = false;
};

/// Every parameter block of the model with its gradient, its optimizer state (prepared here) and
/// how many ranks of its replica group hold it, in the model's order (nodes, then each layer's
/// parameters: the order of Model::parameters and of checkpoints), for Synchronizer::attach.
std::vector<SyncTensor> synchronized_tensors(Model& model, Executor& executor, Optimizer& optimizer);

class Trainer {
 public:
  /// `validation` may be null (no validation).
  Trainer(Model& model, Executor& executor, std::shared_ptr<Dataset> train, std::shared_ptr<Dataset> validation,
          TrainerOptions options);
  ~Trainer();
  /// Checks that the data fits the model (sample and target shapes, enough samples for a batch).
  void check() const;
  /// Trains. A failure on one rank alone ends the whole job (Communicator::abort) rather than
  /// leaving the other ranks waiting in a collective.
  TrainSummary run();
  /// One pass over `data` in order, summed over all ranks.
  BatchResult evaluate(Dataset& data);

 private:
  struct Metrics;
  struct Run;
  /// Finds and reads the checkpoint to resume from (every rank together) and returns its step (0: none).
  std::int64_t resume_from_checkpoint(Clock::time_point start);
  /// Runs training step `step` through its validation and checkpoint; returns true when a stop request ends the run.
  bool train_step(Run& state, std::int64_t step);
  /// Writes a step's metrics row and, every progress_every steps, its progress line.
  void report_step(Run& state, std::int64_t step, const BatchResult& r, double lr);
  /// Validates after `step` and writes the validation row (no-op without validation data).
  void validate(Run& state, std::int64_t step, std::int64_t epoch);
  /// Agrees on a stop request, saves a checkpoint when due and returns true when the run stops here.
  bool checkpoint_or_stop(Run& state, bool last);
  /// Writes a checkpoint before step `next`.
  void save(Run& state, std::int64_t next);
  /// Fault-tolerant replica groups: joins the next quorum at `position` (after a failed exchange, or
  /// for a group waiting to join) and continues from where it puts this group (the batch of step
  /// `prefetched` is being read); returns false when the other groups had finished training.
  bool rejoin(Run& state, TrainingPosition position, std::int64_t prefetched);
  Model& model_;
  Executor& executor_;
  std::shared_ptr<Dataset> train_;
  std::shared_ptr<Dataset> validation_;
  TrainerOptions options_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<Synchronizer> sync_;
  std::unique_ptr<Metrics> metrics_;
  /// Fault-tolerant replica groups (null: off), this rank's state tensors that healing copies and
  /// the gradients they average.
  std::unique_ptr<ReplicaSet> replicas_;
  std::vector<Tensor*> replica_state_, replica_gradients_;
  /// Validation falls back to this group alone after a failed sum across groups.
  bool evaluate_alone_ = false;
  /// Evaluates `data` with the consensus model where replica groups differ (their own values
  /// restored after).
  BatchResult evaluate_consensus(Dataset& data);
};

}  // namespace tessera
