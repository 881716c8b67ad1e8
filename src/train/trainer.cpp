#include "tessera/train/trainer.hpp"

#include <chrono>
#include <cstdio>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "tessera/core/error.hpp"
#include "tessera/core/log.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/io/dataset.hpp"
#include "tessera/io/prefetch.hpp"
#include "tessera/io/sampler.hpp"

namespace tessera {
namespace {
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

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
  explicit Metrics(const std::string& folder) : dir(folder) {
    std::filesystem::create_directories(dir);
    jsonl.open(dir + "/metrics.jsonl");
    csv.open(dir + "/metrics.csv");
    if (!jsonl || !csv) fail_input("cannot write metrics into '{}'", dir);
    csv << "kind,step,epoch,loss,accuracy,lr,samples_per_s,elapsed_s\n";
  }
  void train_row(std::int64_t step, std::int64_t epoch, double loss, double accuracy, double lr, double rate,
                 double elapsed) {
    jsonl << fmt::format(
        R"({{"kind":"train","step":{},"epoch":{},"loss":{:.9g},"accuracy":{:.6g},"lr":{:.9g},"samples_per_s":{:.6g},"elapsed_s":{:.6g}}})",
        step, epoch, loss, accuracy, lr, rate, elapsed)
          << '\n';
    csv << fmt::format("train,{},{},{:.9g},{:.6g},{:.9g},{:.6g},{:.6g}\n", step, epoch, loss, accuracy, lr, rate,
                       elapsed);
  }
  void summary(const TrainSummary& s, int ranks, std::int64_t global_batch) {
    std::ofstream out(dir + "/summary.json");
    const auto opt = [](const std::optional<double>& v) { return v ? fmt::format("{:.9g}", *v) : std::string("null"); };
    const double steps = static_cast<double>(std::max<std::int64_t>(s.steps, 1));
    out << fmt::format(
        R"({{"ranks":{},"steps":{},"global_batch":{},"seconds":{:.6g},"samples_per_s":{:.6g},"step_s":{:.6g},)"
        R"("comm_wait_s":{:.6g},"comm_share":{:.6g},"final_loss":{:.9g},"val_loss":{},"val_accuracy":{}}})",
        ranks, s.steps, global_batch, s.seconds, s.samples_per_second, s.seconds / steps, s.comm_wait_seconds / steps,
        s.seconds > 0 ? s.comm_wait_seconds / s.seconds : 0.0, s.final_loss, opt(s.val_loss), opt(s.val_accuracy))
        << '\n';
  }
  void eval_row(std::int64_t step, std::int64_t epoch, double loss, std::optional<double> accuracy, double elapsed) {
    const std::string acc = accuracy ? fmt::format("{:.6g}", *accuracy) : std::string("null");
    jsonl << fmt::format(R"({{"kind":"validation","step":{},"epoch":{},"loss":{:.9g},"accuracy":{},"elapsed_s":{:.6g}}})",
                         step, epoch, loss, acc, elapsed)
          << '\n';
    csv << fmt::format("validation,{},{},{:.9g},{},,,{:.6g}\n", step, epoch, loss, accuracy ? acc : "", elapsed);
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
  if (!options_.metrics_dir.empty() && executor_.world().rank() == 0)
    metrics_ = std::make_unique<Metrics>(options_.metrics_dir);
}

Trainer::~Trainer() = default;

BatchResult Trainer::evaluate(Dataset& data) {
  executor_.average_buffers();
  const std::int64_t n = data.info().size;
  const Box box = whole_sample_box(data.info().sample_shape);
  BatchResult total;
  double loss_sum = 0;
  std::int64_t correct = 0, samples = 0;
  std::vector<std::int64_t> indices;
  Tensor inputs, targets;
  for (std::int64_t first = 0; first < n; first += options_.eval_batch) {
    const std::int64_t size = std::min(options_.eval_batch, n - first);
    const auto [begin, end] = executor_.local_samples(size);
    indices.clear();
    for (std::int64_t i = begin; i < end; ++i) indices.push_back(first + i);
    data.read(indices, box, inputs, targets);
    const BatchResult r = executor_.evaluate(inputs, targets, size);
    loss_sum += r.loss_sum;
    correct += r.correct;
    samples += r.samples;
  }
  total.loss_sum = loss_sum;
  total.correct = correct;
  total.samples = samples;
  return total;
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

TrainSummary Trainer::run() {
  check();
  const DatasetInfo& info = train_->info();
  EpochSampler sampler(SamplerOptions{info.size, options_.global_batch, options_.seed, options_.shuffle, /*drop_last=*/true});
  const std::int64_t per_epoch = sampler.batches_per_epoch();
  std::int64_t total_steps = per_epoch * options_.epochs;
  if (options_.max_steps > 0) total_steps = std::min(total_steps, options_.max_steps);
  ScheduleConfig schedule_config = options_.schedule;
  if (schedule_config.total_steps == 0) schedule_config.total_steps = total_steps;
  const LrSchedule schedule(schedule_config, options_.global_batch);
  const Box box = whole_sample_box(info.sample_shape);
  const auto params = model_.parameters();
  const int rank = executor_.world().rank();

  auto request_for = [&](std::int64_t step) {
    const auto batch = sampler.batch(step / per_epoch, step % per_epoch);
    const auto [begin, end] = executor_.local_samples(options_.global_batch);
    return ReadRequest{std::vector<std::int64_t>(batch.begin() + begin, batch.begin() + end), box};
  };

  log_info("training '{}' ({} parameters) on {} ranks: {} steps ({} per epoch), global batch {}", model_.name(),
           model_.parameter_count(), executor_.world().size(), total_steps, per_epoch, options_.global_batch);
  TrainSummary summary;
  const auto start = Clock::now();
  auto window_start = start;
  std::int64_t window_steps = 0;
  Prefetcher prefetcher(train_);
  if (total_steps > 0) prefetcher.submit(request_for(0));

  auto validate = [&](std::int64_t step, std::int64_t epoch) {
    if (!validation_) return;
    const BatchResult r = evaluate(*validation_);
    summary.val_loss = r.mean_loss();
    if (r.correct >= 0) summary.val_accuracy = static_cast<double>(r.correct) / static_cast<double>(r.samples);
    log_info("validation after step {}: loss {:.4f}{}", step, *summary.val_loss,
             summary.val_accuracy ? fmt::format(", accuracy {:.2f}%", 100.0 * *summary.val_accuracy) : "");
    if (metrics_) metrics_->eval_row(step, epoch, *summary.val_loss, summary.val_accuracy, seconds_since(start));
  };

  try {
  for (std::int64_t step = 0; step < total_steps; ++step) {
    Batch batch = prefetcher.take();
    if (step + 1 < total_steps) prefetcher.submit(request_for(step + 1));
    if (rank == options_.fail_rank && step == options_.fail_step)
      fail("injected failure at step {} (--inject-failure)", step);
    const BatchResult r = executor_.train_step(batch.inputs, batch.targets, options_.global_batch, step);
    const double lr = schedule.lr(step);
    optimizer_->step(params, lr);
    summary.final_loss = r.mean_loss();
    summary.comm_wait_seconds += r.comm_wait_seconds;
    ++window_steps;
    const std::int64_t epoch = step / per_epoch;
    if (metrics_) {
      const double accuracy = r.correct >= 0 ? static_cast<double>(r.correct) / static_cast<double>(r.samples) : -1.0;
      const double elapsed = seconds_since(start);
      metrics_->train_row(step, epoch, r.mean_loss(), accuracy, lr,
                          static_cast<double>((step + 1) * options_.global_batch) / elapsed, elapsed);
    }
    const bool last = step + 1 == total_steps;
    if ((step + 1) % options_.progress_every == 0 || last) {
      const double window = seconds_since(window_start);
      const double rate = static_cast<double>(window_steps * options_.global_batch) / window;
      const double eta = static_cast<double>(total_steps - step - 1) * window / static_cast<double>(window_steps);
      log_info("step {}/{} epoch {} loss {:.4f} lr {:.4g} {:.0f} samples/s ETA {}", step + 1, total_steps, epoch + 1,
               r.mean_loss(), lr, rate, format_duration(eta));
      window_start = Clock::now();
      window_steps = 0;
    }
    const bool epoch_end = (step + 1) % per_epoch == 0;
    if ((options_.eval_every > 0 && (step + 1) % options_.eval_every == 0) || (options_.eval_every == 0 && epoch_end) ||
        last)
      validate(step + 1, epoch);
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
  summary.steps = total_steps;
  summary.seconds = seconds_since(start);
  summary.samples_per_second =
      summary.seconds > 0 ? static_cast<double>(total_steps * options_.global_batch) / summary.seconds : 0;
  // The slowest rank's communication wait is what the step pays for.
  summary.comm_wait_seconds = executor_.world().allreduce_value(summary.comm_wait_seconds, ReduceOp::Max);
  if (metrics_) metrics_->summary(summary, executor_.world().size(), options_.global_batch);
  return summary;
}

}  // namespace tessera
