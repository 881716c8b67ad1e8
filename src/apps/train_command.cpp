// `tessera train`: model file + plan file + HDF5 data -> a trained model and its metrics.
#include <fmt/format.h>

#include <charconv>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <csignal>
#include <optional>
#include <sstream>
#include <thread>

#include <mpi.h>
#include <unistd.h>

#include "commands.hpp"
#include "plan_auto.hpp"
#include "signals.hpp"
#include "tessera/core/error.hpp"
#include "tessera/core/log.hpp"
#include "tessera/io/dataset.hpp"
#include "tessera/parallel/collective_guard.hpp"
#include "tessera/parallel/fault_tolerance.hpp"
#include "tessera/parallel/machine.hpp"
#include "tessera/parallel/straggler.hpp"
#include "tessera/parallel/sync.hpp"
#include "tessera/parallel/watchdog.hpp"
#include "tessera/train/checkpoint.hpp"
#include "tessera/train/trainer.hpp"

namespace tessera {
namespace {

struct TrainArgs {
  std::string model, plan, machine, data, val_data, inputs, targets, inject_failure, inject_hang;
  std::string halo_overlap = "auto";
  std::string device = "host";
  std::string gpu_comm = "auto";
  std::string bf16_convolutions;  ///< empty: native
  std::string precision;  ///< empty: the model file's
  std::string sync_mode;  ///< empty: the plan file's (bsp by default)
  std::string comm_delay;  ///< --inject-comm-delay
  std::string straggler;   ///< --inject-straggler
  std::string staleness_range;  ///< --staleness-range
  double memory_per_rank = 0;   ///< --memory-per-rank (0: the machine file's, else the node's share)
  std::vector<std::string> inject_kill;  ///< --inject-kill GROUP:STEP or GROUP:STEP:sync
  SyncOptions sync;       ///< the --sync options given (over the plan file's sync: section)
  TrainerOptions trainer;
  ExecutorOptions executor;
};

/// RANK:STEP of the testing aids --inject-failure and --inject-hang; with `setup`, RANK:setup
/// sets *setup (and leaves step) instead.
void parse_rank_step(const std::string& text, const char* flag, int& rank, std::int64_t& step, bool* setup = nullptr) {
  if (text.empty()) return;
  const auto colon = text.find(':');
  const auto whole = [](const std::string& part, auto& value) {
    const auto [end, error] = std::from_chars(part.data(), part.data() + part.size(), value);
    return error == std::errc() && end == part.data() + part.size() && !part.empty();
  };
  const std::string after = colon == std::string::npos ? std::string() : text.substr(colon + 1);
  int parsed_rank = -1;
  std::int64_t parsed_step = -1;
  const bool in_setup = setup != nullptr && after == "setup";
  if (colon == std::string::npos || !whole(text.substr(0, colon), parsed_rank) ||
      !(in_setup || whole(after, parsed_step)))
    fail_input("{} expects RANK:STEP{}, got '{}'", flag, setup ? " or RANK:setup" : "", text);
  rank = parsed_rank;
  if (in_setup) *setup = true;
  else step = parsed_step;
}

/// Refuses a plan whose estimated peak per rank exceeds the rank's memory, before any weight is
/// allocated: --memory-per-rank, else the --machine file's memory_per_rank, else (on the host) the
/// node's physical memory over the job's ranks on the node. Returns false where it fits only with
/// no output written into a halo window (check_plan_memory).
bool check_memory(const TrainArgs& args, const Model& model, const Plan& plan, Communicator& world) {
  double limit = args.memory_per_rank;
  std::string source = "--memory-per-rank";
  if (limit <= 0 && !args.machine.empty()) {
    limit = Machine::load(args.machine).memory_per_rank;
    source = fmt::format("memory_per_rank of {}", args.machine);
  }
  if (limit <= 0 && args.device != "cuda" && world.mpi_handle() >= 0) {
    MPI_Comm node = MPI_COMM_NULL;
    MPI_Comm_split_type(MPI_Comm_f2c(world.mpi_handle()), MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int local = 1;
    MPI_Comm_size(node, &local);
    MPI_Comm_free(&node);
    const double physical = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
    limit = physical / local;
    source = fmt::format("the node's {:.1f} GiB over its {} ranks of this job; --memory-per-rank sets it",
                         physical / (1 << 30), local);
  }
  // One limit for every rank (nodes may differ), so that every rank gives the same verdict.
  limit = world.allreduce_value(limit, ReduceOp::Min);
  if (limit <= 0) return true;  // a GPU's memory is known from a machine file or --memory-per-rank only
  PlannerOptions options = planner_options(world.size(), args.trainer.optimizer.type);
  options.exact_bf16_convolutions = args.bf16_convolutions == "exact";
  options.halo_overlap = args.executor.halo_overlap;
  options.outputs_into_windows = args.executor.into_windows;
  return check_plan_memory(model, plan.for_job(world.size()), options, args.trainer.global_batch, limit, source,
                           args.trainer.sync, world.size() % plan.ranks() == 0 ? world.size() / plan.ranks() : 1,
                           args.device == "cuda");
}

/// Fault-tolerant replica groups (--replica-store): this job is one group; --batch is every
/// group's together; checkpoints and metrics go to a folder per group; what every group must agree
/// on is named for the rendezvous.
void join_replica_groups(TrainArgs& args, const Model& model, const Plan& plan, Communicator& world) {
  FaultToleranceOptions& ft = args.trainer.fault_tolerance;
  check_fault_tolerance(ft);
  if (world.size() != plan.ranks())
    fail_input("with --replica-store each replica group is its own job of the plan's {} ranks; this job has {}",
               plan.ranks(), world.size());
  if (args.trainer.sync.mode != "bsp")
    fail_input("fault-tolerant replica groups average gradients every step (bsp); --sync {} is not built for them",
               args.trainer.sync.mode);
  const std::int64_t batch = args.trainer.global_batch;
  if (batch % ft.groups != 0)
    fail_input("--batch {} does not split evenly over the {} replica groups", batch, ft.groups);
  args.trainer.global_batch = batch / ft.groups;
  const auto digest = [](const std::string& text) { return fmt::format("{:016x}", std::hash<std::string>{}(text)); };
  const OptimizerConfig& o = args.trainer.optimizer;
  const ScheduleConfig& sc = args.trainer.schedule;
  ft.identity = {{"model", fmt::format("{} (layers {})", args.model, digest(model_fingerprint(model)))},
                 {"plan", fmt::format("{} (text {})", args.plan.empty() ? "sample-parallel" : args.plan,
                                      digest(plan.to_yaml()))},
                 {"seed", std::to_string(args.trainer.seed)},
                 {"batch", std::to_string(batch)},
                 {"groups", std::to_string(ft.groups)},
                 {"optimizer", fmt::format("{} momentum {} nesterov {} weight decay {} betas {} {}", o.type,
                                           o.momentum, o.nesterov, o.weight_decay, o.beta1, o.beta2)},
                 {"schedule", fmt::format("{} lr {} warm-up {} step size {} gamma {} min lr {} reference batch {}",
                                          sc.type, sc.base_lr, sc.warmup_steps, sc.step_size, sc.gamma, sc.min_lr,
                                          sc.reference_batch)},
                 {"length", fmt::format("epochs {} steps {}", args.trainer.epochs, args.trainer.max_steps)},
                 {"precision", args.precision.empty() ? std::string("the model file's") : args.precision},
                 {"on-shrink", args.trainer.on_shrink},
                 {"data", args.data}};
  for (std::string* dir : {&args.trainer.checkpoint_dir, &args.trainer.metrics_dir})
    if (!dir->empty()) *dir += fmt::format("/group{}", ft.group);
  // --inject-kill acts in a group's first incarnation only (`tessera launch` numbers restarts).
  const char* incarnation = std::getenv("TESSERA_INCARNATION");
  args.trainer.append_metrics = incarnation != nullptr && std::string(incarnation) != "0";
  for (const std::string& kill : args.inject_kill) {
    // GROUP:STEP or GROUP:STEP:sync
    std::vector<std::string> parts;
    std::stringstream in(kill);
    for (std::string part; std::getline(in, part, ':');) parts.push_back(part);
    std::int64_t group = -1, step = -1;
    const auto whole = [](const std::string& text, std::int64_t& value) {
      const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
      return error == std::errc() && end == text.data() + text.size() && !text.empty() && value >= 0;
    };
    if (parts.size() < 2 || parts.size() > 3 || !whole(parts[0], group) || !whole(parts[1], step) ||
        (parts.size() == 3 && parts[2] != "sync"))
      fail_input("--inject-kill expects GROUP:STEP or GROUP:STEP:sync, got '{}'", kill);
    if (group == ft.group && (incarnation == nullptr || std::string(incarnation) == "0")) {
      args.trainer.kill_step = step;
      args.trainer.kill_in_sync = parts.size() == 3;
    }
  }
}

void run_train(Communicator& world_ref, const TrainArgs& args_in) {
  TrainArgs args = args_in;
  // From here on SIGUSR1 and SIGTERM (Slurm's warning before the time limit, passed on by the batch
  // script of `tessera job`; mpirun passes SIGUSR1 on) ask for a checkpoint and a stop at the next
  // step boundary, on every rank alike; then every rank exits with kExitStopped.
  install_stop_signal_handlers();
  args.trainer.stop_request = stop_requested_flag();
  std::shared_ptr<Communicator> world(std::shared_ptr<Communicator>{}, &world_ref);  // non-owning
  // Setup blocks on the other ranks too (the data files are opened collectively, the executor's
  // communicators are made together: NCCL's setup waits inside for every rank), so a watchdog
  // with the training's timeout bounds it; the trainer's own takes over at the first step.
  std::optional<Watchdog> setup_watchdog;
  setup_watchdog.emplace(args.trainer.watchdog_seconds, world->rank(), Watchdog::print_and_abort(*world));
  std::optional<WatchdogScope> setup_scope;
  // Each phase is named, and finishing one counts as progress (a phase's own length is bounded).
  const auto phase = [&](const char* label) {
    setup_scope.reset();
    setup_watchdog->heartbeat();
    setup_scope.emplace(setup_watchdog->enabled() ? &*setup_watchdog : nullptr, label);
  };
  phase("setup: reading the model, planning, opening the data files");
  bool hang_in_setup = false;
  std::unique_ptr<Model> model;
  std::unique_ptr<Plan> plan;
  std::shared_ptr<Dataset> train, validation;
  collectively(*world, [&] {
    parse_rank_step(args.inject_failure, "--inject-failure", args.trainer.fail_rank, args.trainer.fail_step);
    parse_rank_step(args.inject_hang, "--inject-hang", args.trainer.hang_rank, args.trainer.hang_step, &hang_in_setup);
    if (hang_in_setup) {
      hang_in_setup = args.trainer.hang_rank == world->rank();
      args.trainer.hang_rank = -1;
    }
    if (args.gpu_comm != "auto" && args.device != "cuda")
      fail_input("--gpu-comm {} is for training on GPUs: add --device cuda (on the host every message goes over "
                 "MPI)", args.gpu_comm);
    if (!args.bf16_convolutions.empty() && args.device != "cuda")
      fail_input("--bf16-convolutions {} is for training on GPUs: add --device cuda (on the host bf16 convolutions "
                 "always give fp32 results)", args.bf16_convolutions);
    args.executor.halo_overlap = parse_halo_overlap(args.halo_overlap);  // the planner prices it too
    ModelOptions model_options;
    model_options.allocate_parameters = false;  // the executor allocates each rank's blocks
    if (!args.precision.empty()) model_options.precision = parse_precision(args.precision, "--precision");
    model = std::make_unique<Model>(Model::load(args.model, model_options));
    if (args.plan.empty()) plan = std::make_unique<Plan>(Plan::sample_parallel(world->size()));
    else if (args.plan == "auto") {
      std::string report;
      PlannerOptions options = planner_options(world->size(), args.trainer.optimizer.type);
      options.exact_bf16_convolutions = args.bf16_convolutions == "exact";
      options.halo_overlap = args.executor.halo_overlap;
      plan = std::make_unique<Plan>(auto_plan(*model, args.machine, options, args.trainer.global_batch, report));
      if (world->rank() == 0) {
        fmt::print("{}", report);
        std::fflush(stdout);
      }
    }
    else plan = std::make_unique<Plan>(Plan::load(args.plan));
    if (!args.staleness_range.empty()) parse_staleness_range(args.staleness_range, args.sync);
    SyncOptions sync = args.sync.over(plan->sync());
    sync.mode = args.sync_mode.empty() ? plan->sync().mode : args.sync_mode;
    check_sync(sync, world->size() % plan->ranks() == 0 ? world->size() / plan->ranks() : 1);
    args.trainer.sync = sync;
    args.executor.within_groups = sums_within_groups(sync);
    args.trainer.comm_delay = args.executor.cross_group_delay = parse_comm_delay(args.comm_delay);
    args.trainer.straggler = parse_straggler(args.straggler);
    check_straggler(args.trainer.straggler, world->size() % plan->ranks() == 0 ? world->size() / plan->ranks() : 1);
    args.trainer.plan_text = plan->to_yaml();
    if (!args.trainer.fault_tolerance.store.empty()) join_replica_groups(args, *model, *plan, *world);
    if (!check_memory(args, *model, *plan, *world)) {
      args.executor.into_windows = false;
      if (world->rank() == 0)
        fmt::print(
            "the plan fits a rank's memory only with every output in a tensor of its own: no layer "
            "writes into its reader's halo window\n");
    }
    Hdf5DatasetOptions data_options{args.inputs, args.targets};
    train = open_hdf5_dataset(args.data, *world, data_options);
    if (!args.val_data.empty()) validation = open_hdf5_dataset(args.val_data, *world, data_options);
  });
  args.executor.global_batch = args.trainer.global_batch;
  args.executor.seed = args.trainer.seed;
  // One GPU per rank: the node-local rank's among those the rank sees (with Slurm's
  // --gpus-per-task 1 each rank sees its own).
  args.executor.device = args.device == "cuda" ? Device::cuda(ExecutorOptions::kNodeLocalGpu) : Device::host();
  args.executor.gpu_comm = parse_gpu_comm(args.gpu_comm);
  if (!args.bf16_convolutions.empty())
    args.executor.cuda.bf16_convolutions = parse_bf16_convolutions(args.bf16_convolutions);
  args.executor.init_seed = args.trainer.seed;  // each rank draws its blocks after the split
  phase("setup: making the executor (its communicators: NCCL's setup waits for every rank)");
  Executor executor(*model, *plan, world, args.executor);
  while (hang_in_setup) std::this_thread::sleep_for(std::chrono::hours(1));  // --inject-hang RANK:setup
  phase("setup: making the trainer (every rank checks it together)");
  std::unique_ptr<Trainer> trainer;
  collectively(*world, [&] {
    trainer = std::make_unique<Trainer>(*model, executor, train, validation, args.trainer);
    trainer->check();
  });
  setup_scope.reset();
  setup_watchdog.reset();
  const TrainSummary summary = trainer->run();
  if (summary.stopped) {
    if (world->rank() == 0) {
      const int signal = stop_signal();  // this rank's; another rank may have been the one signalled
      const std::string what = signal == SIGUSR1 ? " (SIGUSR1)" : signal == SIGTERM ? " (SIGTERM)" : "";
      if (summary.last_checkpoint.empty())
        fmt::print("stopped at step {} on a signal{}; no --checkpoint-dir, so no checkpoint was written\n",
                   summary.steps, what);
      else
        fmt::print("stopped at step {} on a signal{}; checkpoint written to {}; resume with --resume auto\n",
                   summary.steps, what, summary.last_checkpoint);
      std::fflush(stdout);
    }
    command_exit_code() = kExitStopped;
    return;
  }
  if (world->rank() == 0 && summary.finished_elsewhere) {
    fmt::print("the other replica groups had finished training: nothing left for this group\n");
  } else if (world->rank() == 0 && summary.steps == summary.start_step) {
    fmt::print("nothing to train: the checkpoint is at step {}, which is where this run ends\n", summary.steps);
  } else if (world->rank() == 0) {
    fmt::print("trained {} steps{} in {:.1f} s ({:.0f} samples/s); final training loss {:.4f}\n",
               summary.steps - summary.start_step,
               summary.start_step > 0 ? fmt::format(" (steps {}..{}, resumed)", summary.start_step, summary.steps - 1)
                                      : std::string(),
               summary.seconds, summary.samples_per_second, summary.final_loss);
    if (!summary.last_checkpoint.empty()) fmt::print("checkpoint: {}\n", summary.last_checkpoint);
    if (summary.val_loss) fmt::print("validation loss: {:.4f}\n", *summary.val_loss);
    if (summary.val_accuracy) fmt::print("test accuracy: {:.2f}%\n", 100.0 * *summary.val_accuracy);
    if (summary.replicas)
      fmt::print("replica group {}: {} failed exchanges, {} quorums, healed {} times ({:.1f} MB, {:.2f} s); "
                 "effective training time {:.3f}\n",
                 args.trainer.fault_tolerance.group, summary.replicas->failures, summary.replicas->quorums,
                 summary.replicas->heals, summary.replicas->heal_bytes * world->size() / 1e6,
                 summary.replicas->heal_seconds, summary.seconds > 0 ? summary.committed_seconds / summary.seconds : 0.0);
    std::fflush(stdout);
  }
}

}  // namespace

std::function<void(Communicator&)> add_train_command(CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  auto* cmd = app.add_subcommand("train", "Train a model under a plan on HDF5 data (run under mpirun or srun)");
  cmd->add_option("--model", args->model, "Model file (YAML)")->required()->check(CLI::ExistingFile);
  cmd->add_option("--plan", args->plan, "Plan file (YAML), or auto: the planner's plan for this job on --machine; default: every layer split by sample over all ranks");
  cmd->add_option("--memory-per-rank", args->memory_per_rank,
                  "Bytes a rank may use: a plan whose estimated peak per rank is larger is refused before anything "
                  "is allocated (default: the --machine file's memory_per_rank, else the node's memory over its ranks)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--machine", args->machine,
                  "Machine file for --plan auto (written by 'tessera calibrate', or one of machines/)");
  cmd->add_option("--data", args->data, "Training data (HDF5)")->required();
  cmd->add_option("--val-data", args->val_data, "Validation / test data (HDF5)");
  cmd->add_option("--inputs", args->inputs, "Name of the inputs dataset in the file (default: images, else data)");
  cmd->add_option("--targets", args->targets, "Name of the targets dataset (default: labels, else targets)");
  cmd->add_option("--sync", args->sync_mode,
                  "How replica groups synchronize (a job of a multiple of the plan's ranks runs it as replica "
                  "groups): bsp (every gradient over all groups every step; the default, and the plan file's "
                  "sync: mode otherwise), local_sgd, diloco, easgd, gossip, adascale, ssp, dssp or eager (README: Synchronization)");
  SyncOptions& sync = args->sync;
  cmd->add_option_function<int>("--sync-period", [&sync](const int& v) { sync.period = v; },
                                "Steps between syncs (local_sgd, diloco, easgd, gossip)");
  cmd->add_option_function<int>("--sync-start", [&sync](const int& v) { sync.start = v; },
                                "Bulk-synchronous until this step (local_sgd: post-local SGD)");
  cmd->add_flag_function("--sync-optimizer-state", [&sync](std::int64_t) { sync.optimizer_state = true; },
                         "local_sgd: average the optimizer's state with the parameters");
  cmd->add_option_function<std::string>("--outer-optimizer", [&sync](const std::string& v) { sync.outer_optimizer = v; },
                                        "diloco's outer optimizer: sgd or nesterov");
  cmd->add_option_function<double>("--outer-lr", [&sync](const double& v) { sync.outer_lr = v; },
                                   "diloco's outer learning rate");
  cmd->add_option_function<double>("--outer-momentum", [&sync](const double& v) { sync.outer_momentum = v; },
                                   "diloco's outer momentum");
  cmd->add_option_function<double>("--easgd-alpha", [&sync](const double& v) { sync.easgd_alpha = v; },
                                   "easgd's elastic pull, in [0, 1]");
  cmd->add_option_function<std::string>("--gossip-topology", [&sync](const std::string& v) { sync.topology = v; },
                                        "gossip's graph: ring or exponential");
  cmd->add_option_function<int>("--staleness", [&sync](const int& v) { sync.staleness = v; },
                                "ssp, eager: steps a group may run ahead of the slowest (ssp default 2, eager 4; 0 is bsp)");
  cmd->add_option_function<std::string>("--quorum", [&sync](const std::string& v) { sync.quorum = v; },
                                        "eager: the groups a round waits for: solo (the first) or majority "
                                        "(more than half; the default)");
  cmd->add_option("--staleness-range", args->staleness_range,
                  "dssp: LOW:HIGH, the range it chooses its staleness bound in (default 1:8)");
  auto& t = args->trainer;
  cmd->add_option("--epochs", t.epochs, "Epochs")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--steps", t.max_steps, "Stop after this many steps (0: all epochs)")->capture_default_str();
  cmd->add_option("--batch", t.global_batch, "Global batch size (over all ranks)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--eval-every", t.eval_every, "Validate every N steps (0: each epoch)")->capture_default_str();
  cmd->add_option("--eval-batch", t.eval_batch,
                  "Validation batch size (default: the global batch, so that validation needs no more memory than "
                  "a training step; a larger one keeps the executor's buffers that large)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--seed", t.seed, "Seed of weights, data order and dropout")->capture_default_str();
  cmd->add_flag("!--no-shuffle", t.shuffle, "Read the training data in order");
  cmd->add_option("--progress-every", t.progress_every, "Progress line every N steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--metrics-dir", t.metrics_dir, "Write metrics.jsonl and metrics.csv here");
  cmd->add_option("--checkpoint-dir", t.checkpoint_dir, "Write checkpoints (ckpt-STEP.h5) into this folder");
  cmd->add_option("--checkpoint-every", t.checkpoint_every,
                  "Checkpoint every N steps (0: only at the end and when stopped)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--keep-checkpoints", t.keep_checkpoints, "Keep the newest N checkpoints (0: all)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--resume", t.resume,
                  "auto: continue from the newest valid checkpoint in --checkpoint-dir (from scratch if none); "
                  "or the path of a checkpoint file");
  cmd->add_option("--init", t.init,
                  "Start from these weights (a weights file of 'tessera import onnx', or a checkpoint of the same "
                  "model: parameters and batch-norm statistics; the optimizer and the step start afresh); a run "
                  "that --resume restores ignores it")
      ->check(CLI::ExistingFile);
  auto& o = t.optimizer;
  cmd->add_option("--optimizer", o.type, "sgd, adam or adamw")->capture_default_str();
  cmd->add_option("--momentum", o.momentum, "SGD momentum")->capture_default_str();
  cmd->add_flag("--nesterov", o.nesterov, "Nesterov momentum");
  cmd->add_option("--weight-decay", o.weight_decay, "Weight decay")->capture_default_str();
  cmd->add_option("--beta1", o.beta1, "Adam beta1")->capture_default_str();
  cmd->add_option("--beta2", o.beta2, "Adam beta2")->capture_default_str();
  auto& s = t.schedule;
  cmd->add_option("--lr", s.base_lr, "Learning rate")->capture_default_str();
  cmd->add_option("--schedule", s.type, "constant, step or cosine")->capture_default_str();
  cmd->add_option("--warmup-steps", s.warmup_steps, "Linear warm-up steps")->capture_default_str();
  cmd->add_option("--step-size", s.step_size, "Step schedule: steps between decays")->capture_default_str();
  cmd->add_option("--gamma", s.gamma, "Step schedule: decay factor")->capture_default_str();
  cmd->add_option("--min-lr", s.min_lr, "Cosine schedule: final learning rate")->capture_default_str();
  cmd->add_option("--scale-lr-from-batch", s.reference_batch,
                  "Linear scaling: --lr is for this batch size and is scaled by batch / this (0: off)")
      ->capture_default_str();
  cmd->add_option("--bucket-bytes", args->executor.reducer.bucket_bytes, "Gradient allreduce bucket size in bytes")
      ->capture_default_str();
  cmd->add_option("--halo-overlap", args->halo_overlap,
                  "Spatially split convolutions compute their interior while halos travel and recompute the "
                  "outputs that read halos afterwards: auto (halos from other nodes, where those outputs are at most "
                  "1/8 of the tile), always, never")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "always", "never"}));
  cmd->add_option("--device", args->device,
                  "Where the layers run: host (oneDNN), or cuda: one GPU per rank, by node-local rank (cuDNN, "
                  "cuBLAS; messages between GPUs as --gpu-comm says)")
      ->capture_default_str()
      ->check(CLI::IsMember({"host", "cuda"}));
  cmd->add_option("--gpu-comm", args->gpu_comm,
                  "With --device cuda, how messages between GPUs travel: nccl (straight between GPUs, overlapping "
                  "compute; needs a GPU per rank), mpi (through host memory), or auto (nccl when each rank has a GPU "
                  "of its own, else mpi)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "nccl", "mpi"}));
  cmd->add_option("--bf16-convolutions", args->bf16_convolutions,
                  "With --device cuda, how bf16 convolutions run: native (bf16 tensors on bf16 tensor cores, fp32 "
                  "sums, results rounded to bf16; the default) or exact (the host's fp32 results, on TF32 tensor "
                  "cores at half the rate)")
      ->check(CLI::IsMember({"native", "exact"}));
  cmd->add_option("--precision", args->precision,
                  "Arithmetic of the conv and linear layers, for the layers that do not name their own: fp32, or bf16 "
                  "(operands rounded to bf16, fp32 sums and results; on GPUs convolutions' results are rounded to "
                  "bf16 too, see --bf16-convolutions; fp32 master weights and gradient reductions; the activations "
                  "that backward reads kept in bf16 unless the model file says 'activations: fp32'). Default: the "
                  "model file's 'precision' (fp32 without one)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  FaultToleranceOptions& ft = t.fault_tolerance;
  cmd->add_option("--replica-store", ft.store,
                  "Fault-tolerant replica groups: the folder every group reaches (a shared file system); this job is "
                  "one group (normally started by 'tessera launch' or the Slurm script of 'tessera job'; "
                  "docs/fault_tolerance.md)");
  cmd->add_option("--replica-group", ft.group, "Fault-tolerant replica groups: this job's group (0-based)");
  cmd->add_option("--replica-groups", ft.groups, "Fault-tolerant replica groups: how many the job has")
      ->capture_default_str();
  cmd->add_option("--min-groups", ft.min_groups, "Fault-tolerant replica groups: no step commits with fewer live groups")
      ->capture_default_str();
  cmd->add_option("--join-window", ft.join_window,
                  "Fault-tolerant replica groups: seconds a quorum forming after a failure waits for the last "
                  "quorum's groups")
      ->capture_default_str();
  cmd->add_option("--start-window", ft.start_window,
                  "Fault-tolerant replica groups: seconds the first quorum waits for every group")
      ->capture_default_str();
  cmd->add_option("--peer-timeout", ft.peer_timeout,
                  "Fault-tolerant replica groups: seconds an exchange waits for a silent peer group before it counts "
                  "as failed")
      ->capture_default_str();
  cmd->add_option("--quorum-timeout", ft.quorum_timeout,
                  "Fault-tolerant replica groups: seconds a group waits for a quorum of --min-groups before it gives up")
      ->capture_default_str();
  cmd->add_option("--on-shrink", t.on_shrink,
                  "Fault-tolerant replica groups, with fewer live groups than started: keep-lr (each group keeps its "
                  "batch and the learning rate stays) or scale-lr (the learning rate scales by live / started groups)")
      ->capture_default_str();
  cmd->add_option("--inject-kill", args->inject_kill,
                  "Testing aid (fault-tolerant replica groups): GROUP:STEP makes rank 0 of that group send itself "
                  "SIGKILL at that step, GROUP:STEP:sync as its exchange across groups begins (first incarnation only; "
                  "repeatable)");
  cmd->add_option("--inject-failure", args->inject_failure, "Testing aid: RANK:STEP makes that rank throw then");
  cmd->add_option("--inject-comm-delay", args->comm_delay,
                  "Testing aid: every collective across replica groups takes this much longer: LATENCY or "
                  "LATENCY,BANDWIDTH, e.g. 20ms or 20ms,1GB/s");
  cmd->add_option("--inject-straggler", args->straggler,
                  "Testing aid: replica groups that sleep after a step's compute, the same schedule on every rank "
                  "and run: slow:GROUPS:FACTORx (e.g. slow:1:2x), random:K:DELAY (e.g. random:1:50ms or "
                  "random:1:2x), tail:MEAN (e.g. tail:10ms)");
  cmd->add_option("--watchdog-seconds", t.watchdog_seconds,
                  "A rank with no finished step (or setup) for this long prints what it is stuck in and ends the "
                  "job, exit code 4 (0: off)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--inject-hang", args->inject_hang,
                  "Testing aid: RANK:STEP makes that rank sleep forever then (RANK:setup: after making the executor)");
  return [args, cmd](Communicator& world) {
    if (!cmd->parsed()) return;
    run_train(world, *args);
  };
}

}  // namespace tessera
