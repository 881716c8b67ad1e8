#pragma once
// The training loop: epochs over a shuffled dataset (the same order on every rank), each rank
// reading only its samples of each batch, the next batch prefetched while this one trains;
// validation every N steps; metrics as JSON lines and CSV; a progress line on rank 0.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

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
  std::int64_t eval_batch = 256;
  std::uint64_t seed = 1;
  bool shuffle = true;
  /// Print a progress line every this many steps.
  std::int64_t progress_every = 50;
  /// Folder for metrics.jsonl, metrics.csv and summary.json (empty: none).
  std::string metrics_dir;
  OptimizerConfig optimizer;
  ScheduleConfig schedule;
  /// Testing aid: rank `fail_rank` throws at step `fail_step` (-1: never).
  int fail_rank = -1;
  std::int64_t fail_step = -1;
};

struct TrainSummary {
  std::int64_t steps = 0;
  double final_loss = 0;
  std::optional<double> val_loss;
  std::optional<double> val_accuracy;
  double samples_per_second = 0;
  double seconds = 0;
  /// Seconds waiting for communication (the slowest rank's).
  double comm_wait_seconds = 0;
};

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
  Model& model_;
  Executor& executor_;
  std::shared_ptr<Dataset> train_;
  std::shared_ptr<Dataset> validation_;
  TrainerOptions options_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<Metrics> metrics_;
};

}  // namespace tessera
