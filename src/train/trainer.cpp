#include "tessera/train/trainer.hpp"

#include <array>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <thread>

#include "tessera/core/clock.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/log.hpp"
#include "tessera/io/checkpoint.hpp"
#include "tessera/io/dataset.hpp"
#include "tessera/io/prefetch.hpp"
#include "tessera/io/sampler.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/parallel/watchdog.hpp"
#include "tessera/train/checkpoint.hpp"

namespace tessera {
namespace {

std::string format_duration(double seconds) {
  const auto s = static_cast<std::int64_t>(seconds);
  if (s >= 3600) return fmt::format("{}h{:02}m", s / 3600, (s / 60) % 60);
  if (s >= 60) return fmt::format("{}m{:02}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}
}  // namespace

/// Metrics written by rank 0: one JSON object per line, and the same rows as CSV.
struct Trainer::Metrics {
  std::ofstream jsonl;
  std::ofstream csv;
  std::string dir;
  static constexpr const char* kCsvHeader =
      "kind,step,epoch,loss,accuracy,lr,samples_per_s,elapsed_s,syncs,cross_group_bytes,gain,consensus,staleness,"
      "sync_wait_s,contributors\n";
  /// With `resume`, the files are opened by resume_from() once the start step is known.
  Metrics(const std::string& folder, bool resume) : dir(folder) {
    std::filesystem::create_directories(dir);
    if (resume) return;
    jsonl.open(dir + "/metrics.jsonl");
    csv.open(dir + "/metrics.csv");
    if (!jsonl || !csv) fail_input("cannot write metrics into '{}'", dir);
    csv << kCsvHeader;
  }
  /// Keeps the rows of the earlier run up to `start` (training rows of steps before it, validation
  /// rows after at most `start` steps) and appends after them.
  void resume_from(std::int64_t start) {
    const auto keep = [&](const std::string& kind, const std::string& step_text) {
      std::int64_t step = 0;
      try {
        std::size_t used = 0;
        step = std::stoll(step_text, &used);
        if (used != step_text.size()) return false;
      } catch (const std::exception&) {
        return false;
      }
      return kind == "train" ? step < start : kind == "validation" && step <= start;
    };
    const auto rewrite = [&](const std::string& path, bool is_csv) {
      std::vector<std::string> kept;
      if (std::ifstream in(path); in) {
        for (std::string line; std::getline(in, line);) {
          if (is_csv) {
            const auto a = line.find(','), b = line.find(',', a + 1);
            if (a == std::string::npos || b == std::string::npos) continue;
            if (keep(line.substr(0, a), line.substr(a + 1, b - a - 1))) kept.push_back(line);
          } else {
            const auto k = line.find(R"("kind":")"), t = line.find(R"(","step":)");
            if (k == std::string::npos || t == std::string::npos || line.back() != '}') continue;
            const auto step_begin = t + 9, step_end = line.find(',', step_begin);
            if (step_end == std::string::npos) continue;
            if (keep(line.substr(k + 8, t - k - 8), line.substr(step_begin, step_end - step_begin)))
              kept.push_back(line);
          }
        }
      }
      std::ofstream out(path, std::ios::trunc);
      if (is_csv) out << kCsvHeader;
      for (const auto& line : kept) out << line << '\n';
    };
    rewrite(dir + "/metrics.jsonl", false);
    rewrite(dir + "/metrics.csv", true);
    jsonl.open(dir + "/metrics.jsonl", std::ios::app);
    csv.open(dir + "/metrics.csv", std::ios::app);
    if (!jsonl || !csv) fail_input("cannot write metrics into '{}'", dir);
  }
  void flush() {
    jsonl.flush();
    csv.flush();
  }
  void train_row(std::int64_t step, std::int64_t epoch, double loss, double accuracy, double lr, double rate,
                 double elapsed, const SyncStats& sync) {
    const std::string consensus = sync.consensus ? fmt::format("{:.6g}", *sync.consensus) : std::string();
    jsonl
        << fmt::format(
               R"({{"kind":"train","step":{},"epoch":{},"loss":{:.9g},"accuracy":{:.6g},"lr":{:.9g},"samples_per_s":{:.6g},"elapsed_s":{:.6g},)"
               R"("syncs":{},"cross_group_bytes":{:.0f},"gain":{:.6g},"consensus":{},"staleness":{},"sync_wait_s":{:.6g},)"
               R"("contributors":{}}})",
               step, epoch, loss, accuracy, lr, rate, elapsed, sync.syncs, sync.bytes, sync.gain,
               consensus.empty() ? std::string("null") : consensus, sync.staleness, sync.wait_seconds,
               sync.contributors)
        << '\n';
    csv << fmt::format("train,{},{},{:.9g},{:.6g},{:.9g},{:.6g},{:.6g},{},{:.0f},{:.6g},{},{},{:.6g},{}\n", step, epoch,
                       loss, accuracy, lr, rate, elapsed, sync.syncs, sync.bytes, sync.gain, consensus, sync.staleness,
                       sync.wait_seconds, sync.contributors);
    flush();  // a row per committed step, readable as training goes (and kept when a rank is killed)
  }
  /// Fault-tolerant replica groups: what the group saw (empty otherwise).
  static std::string replica_fields(const TrainSummary& s) {
    if (!s.replicas) return {};
    const ReplicaStats& r = *s.replicas;
    return fmt::format(
        R"(,"failures":{},"quorums":{},"heals":{},"heal_s":{:.6g},"heal_bytes":{:.0f},"served_bytes":{:.0f},)"
        R"("quorum_s":{:.6g},"committed_s":{:.6g},"effective_time":{:.6g},"finished_elsewhere":{})",
        r.failures, r.quorums, r.heals, r.heal_seconds, r.heal_bytes, r.served_bytes, r.quorum_seconds,
        s.committed_seconds, s.seconds > 0 ? s.committed_seconds / s.seconds : 0.0, s.finished_elsewhere);
  }
  void summary(const TrainSummary& s, int ranks, std::int64_t global_batch) {
    std::ofstream out(dir + "/summary.json");
    const auto opt = [](const std::optional<double>& v) { return v ? fmt::format("{:.9g}", *v) : std::string("null"); };
    const double steps = static_cast<double>(std::max<std::int64_t>(s.steps - s.start_step, 1));
    out << fmt::format(
               R"({{"ranks":{},"steps":{},"global_batch":{},"seconds":{:.6g},"samples_per_s":{:.6g},"step_s":{:.6g},)"
               R"("comm_wait_s":{:.6g},"comm_share":{:.6g},"final_loss":{:.9g},"val_loss":{},"val_accuracy":{},)"
               R"("syncs":{},"cross_group_bytes":{:.0f},"gain":{:.6g},"consensus":{},"staleness_bound":{},)"
               R"("sync_wait_s":{:.6g},"sync_wait_s_per_group":[{:.6g}]{}}})",
               ranks, s.steps, global_batch, s.seconds, s.samples_per_second, s.seconds / steps,
               s.comm_wait_seconds / steps, s.seconds > 0 ? s.comm_wait_seconds / s.seconds : 0.0, s.final_loss,
               opt(s.val_loss), opt(s.val_accuracy), s.sync.syncs, s.sync.bytes, s.sync.gain, opt(s.sync.consensus),
               s.sync.bound, s.sync.wait_seconds, fmt::join(s.group_wait_seconds, ","), replica_fields(s))
        << '\n';
  }
  void eval_row(std::int64_t step, std::int64_t epoch, double loss, std::optional<double> accuracy, double elapsed) {
    const std::string acc = accuracy ? fmt::format("{:.6g}", *accuracy) : std::string("null");
    jsonl << fmt::format(
                 R"({{"kind":"validation","step":{},"epoch":{},"loss":{:.9g},"accuracy":{},"elapsed_s":{:.6g}}})", step,
                 epoch, loss, acc, elapsed)
          << '\n';
    csv << fmt::format("validation,{},{},{:.9g},{},,,{:.6g},,,,,,\n", step, epoch, loss, accuracy ? acc : "", elapsed);
    jsonl.flush();
    csv.flush();
  }
};

Trainer::Trainer(Model& model, Executor& executor, std::shared_ptr<Dataset> train, std::shared_ptr<Dataset> validation,
                 TrainerOptions options)
    : model_(model),
      executor_(executor),
      train_(std::move(train)),
      validation_(std::move(validation)),
      options_(std::move(options)) {
  optimizer_ = create_optimizer(options_.optimizer);
  const int groups = executor_.replica_groups();
  sync_ = std::make_unique<Synchronizer>(options_.sync, groups, executor_.world(), options_.comm_delay);
  check_straggler(options_.straggler, groups);
  if (groups > 1 && sync_->within_groups() != executor_.within_groups())
    fail("trainer: --sync {} needs an executor made with ExecutorOptions::within_groups = {}", options_.sync.mode,
         sync_->within_groups());
  if (options_.checkpoint_every < 0) fail_input("--checkpoint-every must be >= 0, got {}", options_.checkpoint_every);
  if (options_.keep_checkpoints < 0) fail_input("--keep-checkpoints must be >= 0, got {}", options_.keep_checkpoints);
  if (options_.resume == "auto" && options_.checkpoint_dir.empty())
    fail_input("--resume auto needs --checkpoint-dir (the folder to look for checkpoints in)");
  if (!options_.fault_tolerance.store.empty()) {
    if (groups > 1) fail_input("fault-tolerant replica groups run one group per job: this job holds {} groups", groups);
    if (options_.on_shrink != "keep-lr" && options_.on_shrink != "scale-lr")
      fail_input("--on-shrink must be keep-lr or scale-lr, got '{}'", options_.on_shrink);
    FaultToleranceOptions fault_tolerance = options_.fault_tolerance;
    fault_tolerance.stop_request = options_.stop_request;
    replicas_ = std::make_unique<ReplicaSet>(fault_tolerance, executor_.world());
  }
  if (!options_.metrics_dir.empty() && executor_.world().rank() == 0)
    metrics_ = std::make_unique<Metrics>(options_.metrics_dir, !options_.resume.empty() || options_.append_metrics);
}

Trainer::~Trainer() = default;

BatchResult Trainer::evaluate(Dataset& data) {
  executor_.average_buffers();
  const std::int64_t n = data.info().size;
  const Box box = executor_.input_sample_box();
  BatchResult total;
  double loss_sum = 0;
  std::int64_t correct = 0, samples = 0;
  std::vector<std::int64_t> indices;
  Tensor inputs, targets;
  const std::int64_t chunk = options_.eval_batch > 0 ? options_.eval_batch : options_.global_batch;
  // Fault-tolerant replica groups split the chunks among the quorum's groups and sum the results.
  const bool split = replicas_ && replicas_->members() > 1 && !evaluate_alone_;
  const std::int64_t parts = split ? replicas_->members() : 1, part = split ? replicas_->place() : 0;
  for (std::int64_t first = chunk * part; first < n; first += chunk * parts) {
    const std::int64_t size = std::min(chunk, n - first);
    const auto [begin, end] = executor_.local_samples(size);
    indices.clear();
    for (std::int64_t i = begin; i < end; ++i) indices.push_back(first + i);
    {
      const WatchdogScope scope(executor_.watchdog(), "validation (reading data)");
      data.read(indices, box, inputs, targets);
    }
    const BatchResult r = executor_.evaluate(inputs, targets, size);
    if (Watchdog* watch = executor_.watchdog()) watch->heartbeat();  // validation makes progress too
    loss_sum += r.loss_sum;
    correct += r.correct;
    samples += r.samples;
  }
  if (split) {
    std::array<double, 3> sums{loss_sum, static_cast<double>(correct), static_cast<double>(samples)};
    if (!replicas_->sum(sums)) {
      // A group failed meanwhile: this group validates on its own (the next step regroups).
      evaluate_alone_ = true;
      const BatchResult alone = evaluate(data);
      evaluate_alone_ = false;
      return alone;
    }
    loss_sum = sums[0];
    correct = sums[1] < 0 ? -1 : static_cast<std::int64_t>(sums[1]);
    samples = static_cast<std::int64_t>(sums[2]);
  }
  total.loss_sum = loss_sum;
  total.correct = correct;
  total.samples = samples;
  return total;
}

BatchResult Trainer::evaluate_consensus(Dataset& data) {
  if (sync_->groups() == 1 || !sync_->groups_differ()) return evaluate(data);
  const std::vector<Tensor> consensus = sync_->consensus(/*record=*/true);
  std::vector<Tensor> own;
  const auto params = model_.parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    own.push_back(params[i]->value.to(Device::host()).clone());
    params[i]->value.copy_from(consensus[i]);
  }
  const BatchResult r = evaluate(data);
  for (std::size_t i = 0; i < params.size(); ++i) params[i]->value.copy_from(own[i]);
  return r;
}

void Trainer::check() const {
  const DatasetInfo& info = train_->info();
  if (!(info.sample_shape == model_.sample_shape()))
    fail_input("the data in '{}' has samples of shape {}, but model '{}' takes {}", info.path,
               info.sample_shape.to_string(), model_.source(), model_.sample_shape().to_string());
  if (!(info.target_shape == model_.target_shape()))
    fail_input("the targets in '{}' have shape {} per sample, but the model's loss expects {}", info.path,
               info.target_shape.to_string(), model_.target_shape().to_string());
  if (info.size < options_.global_batch)
    fail_input("'{}' holds {} samples, fewer than one batch of {}", info.path, info.size, options_.global_batch);

  if (validation_ && !(validation_->info().sample_shape == model_.sample_shape()))
    fail_input("the data in '{}' has samples of shape {}, but model '{}' takes {}", validation_->info().path,
               validation_->info().sample_shape.to_string(), model_.source(), model_.sample_shape().to_string());
}

/// What the steps of one run() share: its schedule, prefetcher and watchdog, the summary they fill and the progress
/// window.
struct Trainer::Run {
  std::int64_t per_epoch;
  std::int64_t total_steps;
  const LrSchedule& schedule;
  const std::vector<Parameter*>& params;
  int rank;
  std::function<ReadRequest(std::int64_t)> request_for;
  Prefetcher& prefetcher;
  Watchdog* watch;
  Clock::time_point start;
  std::int64_t start_step;
  TrainSummary& summary;
  Clock::time_point window_start;
  std::int64_t window_steps;
  std::int64_t reached;
};

std::vector<SyncTensor> synchronized_tensors(Model& model, Executor& executor, Optimizer& optimizer) {
  optimizer.prepare(model.parameters());
  std::map<std::string, std::vector<Tensor*>> state;
  for (auto& [name, tensor] : optimizer.state()) state[name.substr(0, name.rfind('.'))].push_back(tensor);
  std::vector<SyncTensor> tensors;
  auto& nodes = model.nodes();
  for (std::size_t k = 0; k < nodes.size(); ++k)
    for (Parameter* p : nodes[k].layer->parameters()) {
      // Under bsp a gradient's replica group spans every group, each holding the same share of it.
      const int group_size = executor.replica_group(k, *p).size();
      const int holders = executor.within_groups() ? group_size : group_size / executor.replica_groups();
      tensors.push_back({p->name, &p->value, &p->grad, 1.0 / holders, state[p->name]});
    }
  return tensors;
}

std::int64_t Trainer::resume_from_checkpoint(Clock::time_point start) {
  const int rank = executor_.world().rank();
  std::int64_t start_step = 0;
  // Every rank finds and reads the checkpoint together: watched as a step is.
  Watchdog resume_watchdog(options_.watchdog_seconds, rank, Watchdog::print_and_abort(executor_.world()));
  const WatchdogScope resuming(resume_watchdog.enabled() ? &resume_watchdog : nullptr,
                               "resuming from a checkpoint (finding and reading it, every rank together)");
  collectively(executor_.world(), [&] {
    std::optional<std::string> path;
    if (options_.resume == "auto") {
      path = find_resume_checkpoint(options_.checkpoint_dir, executor_.world());
      if (!path) log_info("no checkpoint in '{}' yet: starting from scratch", options_.checkpoint_dir);
    } else {
      path = options_.resume;
    }
    if (path) {
      const CheckpointMeta expected{0, 0, options_.global_batch, options_.seed, options_.plan_text};
      start_step = restore_checkpoint(*path, model_, executor_, *optimizer_, expected, sync_.get()).step;
      log_info("resumed from {} at step {} ({:.2f} s)", *path, start_step, seconds_since(start));
    }
  });
  if (metrics_) metrics_->resume_from(start_step);
  return start_step;
}

void Trainer::validate(Run& state, std::int64_t step, std::int64_t epoch) {
  if (!validation_) return;
  TrainSummary& summary = state.summary;
  const WatchdogScope scope(state.watch, "validation");
  const BatchResult r = evaluate_consensus(*validation_);
  summary.val_loss = r.mean_loss();
  if (r.correct >= 0) summary.val_accuracy = static_cast<double>(r.correct) / static_cast<double>(r.samples);
  log_info("validation after step {}: loss {:.4f}{}", step, *summary.val_loss,
           summary.val_accuracy ? fmt::format(", accuracy {:.2f}%", 100.0 * *summary.val_accuracy) : "");
  if (metrics_) metrics_->eval_row(step, epoch, *summary.val_loss, summary.val_accuracy, seconds_since(state.start));
}

void Trainer::save(Run& state, std::int64_t next) {
  TrainSummary& summary = state.summary;
  const WatchdogScope scope(state.watch, "writing a checkpoint");
  const auto begin = Clock::now();
  if (metrics_) metrics_->flush();  // the rows up to the checkpoint survive a kill
  const CheckpointMeta meta{next, next / state.per_epoch, options_.global_batch, options_.seed, options_.plan_text};
  summary.last_checkpoint =
      save_checkpoint(options_.checkpoint_dir, model_, executor_, *optimizer_, meta, options_.keep_checkpoints,
                      sync_.get());
  const double seconds = seconds_since(begin);
  summary.checkpoint_seconds += seconds;
  log_info("checkpoint {} (before step {}) written in {:.3f} s", summary.last_checkpoint, next, seconds);
  if (state.watch) state.watch->heartbeat();
}

bool Trainer::train_step(Run& state, std::int64_t step) {
  Watchdog* const watch = state.watch;
  Batch batch;
  {
    const WatchdogScope scope(watch, "reading training data (waiting for the prefetched batch)");
    batch = state.prefetcher.take();
  }
  if (step + 1 < state.total_steps) state.prefetcher.submit(state.request_for(step + 1));
  if (state.rank == options_.fail_rank && step == options_.fail_step)
    fail("injected failure at step {} (--inject-failure)", step);
  if (state.rank == options_.hang_rank && step == options_.hang_step) {
    const WatchdogScope scope(watch, "an injected hang (--inject-hang)");
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }
  const bool kill_here = state.rank == 0 && step == options_.kill_step;
  if (kill_here && !options_.kill_in_sync) std::raise(SIGKILL);
  const auto compute_start = Clock::now();
  const BatchResult r = executor_.train_step(batch.inputs, batch.targets, options_.global_batch, step);
  if (options_.straggler.any()) {
    // Relative delays scale the step's own work, not its waits for other groups (bsp's gradients).
    const double compute = std::max(seconds_since(compute_start) - r.comm_wait_seconds, 0.0);
    const double delay = straggler_delay(options_.straggler, options_.seed, step, executor_.replica_group_index(),
                                         executor_.replica_groups(), compute);
    const WatchdogScope scope(watch, "an injected straggler delay (--inject-straggler)");
    std::this_thread::sleep_for(std::chrono::duration<double>(delay));
  }
  double lr = 0;
  bool regroup = false;
  if (replicas_) {
    if (kill_here && options_.kill_in_sync) std::raise(SIGKILL);
    ReplicaSet::Outcome outcome;
    {
      const WatchdogScope scope(watch, "averaging gradients across fault-tolerant replica groups");
      outcome = replicas_->average(replica_gradients_);
    }
    if (!outcome.committed)
      return !rejoin(state, TrainingPosition{step, optimizer_->steps_taken()}, step + 1);
    regroup = outcome.regroup;
  }
  {
    const WatchdogScope scope(watch, "synchronizing replica groups (before the update)");
    lr = sync_->before_update(step, [&](std::int64_t s) { return state.schedule.lr(s); });
  }
  if (replicas_) {
    SyncStats stats = sync_->stats();
    stats.contributors = replicas_->members();  // the groups whose gradients this update averages
    sync_->set_stats(stats);
  }
  if (replicas_ && options_.on_shrink == "scale-lr")
    lr *= static_cast<double>(replicas_->members()) / options_.fault_tolerance.groups;
  optimizer_->step(state.params, lr);
  {
    const WatchdogScope scope(watch, "synchronizing replica groups (after the update)");
    sync_->after_update(step);
  }
  if (replicas_) state.summary.committed_seconds += seconds_since(compute_start);
  if (watch) watch->heartbeat();
  state.summary.final_loss = r.mean_loss();
  state.summary.comm_wait_seconds += r.comm_wait_seconds;
  ++state.window_steps;
  const std::int64_t epoch = step / state.per_epoch;
  report_step(state, step, r, lr);
  const bool last = step + 1 == state.total_steps;
  const bool epoch_end = (step + 1) % state.per_epoch == 0;
  if ((options_.eval_every > 0 && (step + 1) % options_.eval_every == 0) || (options_.eval_every == 0 && epoch_end) ||
      last)
    validate(state, step + 1, epoch);
  if (step == state.start_step && state.start_step > 0)
    log_info("first step after resuming done {:.2f} s after training began", seconds_since(state.start));
  state.reached = step + 1;
  const bool stop = checkpoint_or_stop(state, last);
  // A group waits to join: every member regroups once this step is validated and saved, so that
  // the quorum's groups run the same exchanges (validation sums over the quorum too).
  if (regroup && !stop) return !rejoin(state, TrainingPosition{step + 1, optimizer_->steps_taken()}, step + 1);
  return stop;
}

bool Trainer::rejoin(Run& state, TrainingPosition position, std::int64_t prefetched) {
  const std::int64_t from = position.step;
  ReplicaSet::Joined joined = ReplicaSet::Joined::Member;
  {
    const WatchdogScope scope(state.watch, "forming a quorum of fault-tolerant replica groups");
    joined = replicas_->join(position, replica_state_);
  }
  if (state.watch) state.watch->heartbeat();
  if (joined == ReplicaSet::Joined::Finished) {
    log_info("the other replica groups finished training while this one was at step {}", from);
    state.summary.finished_elsewhere = true;
    state.reached = from;
    return false;
  }
  if (joined == ReplicaSet::Joined::Stopped) {
    // Asked to stop while waiting for a quorum: the state is this group's own, before step `from`.
    state.reached = from;
    if (!options_.checkpoint_dir.empty()) save(state, from);
    log_info("stop requested: stopping before step {} (while forming a quorum)", from);
    state.summary.stopped = true;
    return false;
  }
  optimizer_->set_steps_taken(position.optimizer_steps);
  // The batch of step `prefetched` is being read (if there is such a step); the next one must be the position's.
  if (position.step != prefetched) {
    if (prefetched < state.total_steps) state.prefetcher.take();
    if (position.step < state.total_steps) state.prefetcher.submit(state.request_for(position.step));
  }
  state.reached = position.step;
  return true;
}

void Trainer::report_step(Run& state, std::int64_t step, const BatchResult& r, double lr) {
  const std::int64_t epoch = step / state.per_epoch;
  if (metrics_) {
    const double accuracy = r.correct >= 0 ? static_cast<double>(r.correct) / static_cast<double>(r.samples) : -1.0;
    const double elapsed = seconds_since(state.start);
    metrics_->train_row(step, epoch, r.mean_loss(), accuracy, lr,
                        static_cast<double>((step + 1 - state.start_step) * options_.global_batch) / elapsed, elapsed,
                        sync_->stats());
  }
  const bool last = step + 1 == state.total_steps;
  if ((step + 1) % options_.progress_every == 0 || last) {
    const double window = seconds_since(state.window_start);
    const double rate = static_cast<double>(state.window_steps * options_.global_batch) / window;
    const double eta =
        static_cast<double>(state.total_steps - step - 1) * window / static_cast<double>(state.window_steps);
    log_info("step {}/{} epoch {} loss {:.4f} lr {:.4g} {:.0f} samples/s ETA {}", step + 1, state.total_steps,
             epoch + 1, r.mean_loss(), lr, rate, format_duration(eta));
    state.window_start = Clock::now();
    state.window_steps = 0;
  }
}

bool Trainer::checkpoint_or_stop(Run& state, bool last) {
  const std::int64_t reached = state.reached;
  // A stop request (a signal) ends the run at this step boundary on every rank alike.
  bool stop = false;
  if (options_.stop_request != nullptr) {
    const int flag = options_.stop_request->load() ? 1 : 0;
    const WatchdogScope scope(state.watch, "stop-request allreduce (the signal check after a step)");
    stop = sync_->agree(reached, flag != 0);
  }
  if (!options_.checkpoint_dir.empty() &&
      ((options_.checkpoint_every > 0 && reached % options_.checkpoint_every == 0) || last || stop))
    save(state, reached);
  if (stop && !last) {
    log_info("stop requested: stopping after step {}{}", reached,
             options_.checkpoint_dir.empty() ? " (no --checkpoint-dir: nothing saved)" : "");
    state.summary.stopped = true;
    return true;
  }
  return false;
}

TrainSummary Trainer::run() {
  check();
  const DatasetInfo& info = train_->info();
  // Fault-tolerant replica groups: the batch of a step is every group's; group g reads block g.
  const int shares = replicas_ ? options_.fault_tolerance.groups : 1;
  const std::int64_t first_sample = replicas_ ? options_.fault_tolerance.group * options_.global_batch : 0;
  EpochSampler sampler(SamplerOptions{info.size, options_.global_batch * shares, options_.seed, options_.shuffle,
                                      /*drop_last=*/true});
  const std::int64_t per_epoch = sampler.batches_per_epoch();
  std::int64_t total_steps = per_epoch * options_.epochs;
  if (options_.max_steps > 0) total_steps = std::min(total_steps, options_.max_steps);
  ScheduleConfig schedule_config = options_.schedule;
  if (schedule_config.total_steps == 0) schedule_config.total_steps = total_steps;
  const LrSchedule schedule(schedule_config, options_.global_batch * shares);
  const Box box = executor_.input_sample_box();
  const auto params = model_.parameters();
  const int rank = executor_.world().rank();

  auto request_for = [&](std::int64_t step) {
    const auto batch = sampler.batch(step / per_epoch, step % per_epoch);
    const auto [begin, end] = executor_.local_samples(options_.global_batch);
    return ReadRequest{
        std::vector<std::int64_t>(batch.begin() + first_sample + begin, batch.begin() + first_sample + end), box};
  };

  const std::string where = executor_.device().is_host() ? std::string()
                            : executor_.uses_nccl()    ? " (GPUs; messages over NCCL)"
                                                       : " (GPUs; messages through host memory over MPI)";
  const int groups = executor_.replica_groups();
  std::string as_groups =
      groups > 1 ? fmt::format(" as {} replica groups of a {}-rank plan", groups, executor_.world().size() / groups) : "";
  if (replicas_)
    as_groups = fmt::format(" as replica group {} of {} (its share of the global batch of {})",
                            options_.fault_tolerance.group, shares, options_.global_batch * shares);
  log_info("training '{}' ({} parameters, {}) on {} ranks{}{}: {} steps ({} per epoch), global batch {}", model_.name(),
           model_.parameter_count(), precision_name(model_.precision()), executor_.world().size(), as_groups, where,
           total_steps, per_epoch, options_.global_batch);
  sync_->attach(synchronized_tensors(model_, executor_, *optimizer_));
  TrainSummary summary;
  const auto start = Clock::now();
  // Resume: the step restores everything else (see train/checkpoint.hpp).
  std::int64_t start_step = 0;
  if (!options_.resume.empty()) start_step = resume_from_checkpoint(start);
  if (start_step == 0 && !options_.init.empty()) {
    collectively(executor_.world(), [&] { load_weights(options_.init, model_, executor_, *optimizer_); });
    log_info("starting from the weights of {}", options_.init);
  }
  if (replicas_) {
    replica_state_ = training_state(model_, executor_, *optimizer_);
    replica_gradients_.clear();
    for (Parameter* p : params) replica_gradients_.push_back(&p->grad);
    if (start_step > 0) replicas_->restored_from_checkpoint();
    TrainingPosition position{start_step, optimizer_->steps_taken()};
    Watchdog joining(options_.watchdog_seconds, rank, Watchdog::print_and_abort(executor_.world()));
    const WatchdogScope scope(joining.enabled() ? &joining : nullptr, "forming the first quorum of replica groups");
    const ReplicaSet::Joined joined = replicas_->join(position, replica_state_);
    if (joined == ReplicaSet::Joined::Member) {
      start_step = position.step;
      optimizer_->set_steps_taken(position.optimizer_steps);
      if (metrics_ && options_.append_metrics && options_.resume.empty()) metrics_->resume_from(start_step);
    } else {
      if (joined == ReplicaSet::Joined::Finished) log_info("the other replica groups have finished training: nothing to do");
      else log_info("stop requested while forming the first quorum: nothing trained");
      summary.finished_elsewhere = joined == ReplicaSet::Joined::Finished;
      summary.stopped = joined == ReplicaSet::Joined::Stopped;
      total_steps = start_step;
    }
  }
  summary.start_step = start_step;
  Prefetcher prefetcher(train_);
  if (start_step < total_steps) prefetcher.submit(request_for(start_step));
  // Declared after the prefetcher: stops watching before the prefetcher's last reads are joined.
  Watchdog watchdog(options_.watchdog_seconds, rank, Watchdog::print_and_abort(executor_.world()));
  Watchdog* const watch = watchdog.enabled() ? &watchdog : nullptr;
  executor_.set_watchdog(watch);
  struct Unwatch {
    Executor& executor;
    ~Unwatch() { executor.set_watchdog(nullptr); }
  } unwatch{executor_};

  Run state{per_epoch, total_steps, schedule, params, rank, request_for, prefetcher, watch, start, start_step, summary,
            /*window_start=*/start, /*window_steps=*/0, /*reached=*/start_step};
  try {
    for (std::int64_t step = start_step; step < total_steps; step = state.reached)
      if (train_step(state, step)) break;
    if (replicas_ && !summary.finished_elsewhere && !summary.stopped) {
      // A group healed at the very end trained no step of its own: it saves the final state too.
      if (!options_.checkpoint_dir.empty() && std::filesystem::path(summary.last_checkpoint).filename() !=
                                                   checkpoint_name(state.reached) + ".h5")
        save(state, state.reached);
      replicas_->finish(state.reached);
    }
  } catch (const AgreedFailure&) {
    throw;  // every rank is throwing it at the same point
  } catch (const std::exception& e) {
    // This rank failed alone while the others may wait for it in a collective; unwinding would run
    // collective destructors (closing the HDF5 file) and hang. End the whole job now.
    std::fprintf(stderr, "tessera: error: %s\n", e.what());
    std::fflush(stderr);
    executor_.world().abort(exit_code_for(e));
  }
  const std::int64_t reached = state.reached;
  summary.steps = reached;
  summary.seconds = seconds_since(start);
  summary.samples_per_second =
      summary.seconds > 0 ? static_cast<double>((reached - start_step) * options_.global_batch) / summary.seconds : 0;
  // The slowest rank's communication wait is what the step pays for.
  summary.comm_wait_seconds = executor_.world().allreduce_value(summary.comm_wait_seconds, ReduceOp::Max);
  summary.sync = sync_->stats();
  const auto waits = executor_.world().allgather_value(summary.sync.wait_seconds);
  summary.group_wait_seconds.assign(static_cast<std::size_t>(sync_->groups()), 0.0);
  for (std::size_t r = 0; r < waits.size(); ++r) {
    const int g = replica_place(static_cast<int>(r), static_cast<int>(waits.size()), sync_->groups()).group;
    auto& wait = summary.group_wait_seconds[static_cast<std::size_t>(g)];
    wait = std::max(wait, waits[r]);
  }
  if (replicas_) summary.replicas = replicas_->stats();
  if (metrics_) metrics_->summary(summary, executor_.world().size(), options_.global_batch);
  return summary;
}

}  // namespace tessera
