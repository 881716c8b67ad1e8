// `tessera job`: checks and writes a Slurm batch script (see job_script.hpp).
#include "job_script.hpp"

#include "plan_auto.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <filesystem>

#include "signals.hpp"
#include "tessera/core/error.hpp"
#include "tessera/parallel/plan.hpp"
#include "tessera/train/model.hpp"
#include "tessera/train/trainer.hpp"

namespace tessera {
namespace {

namespace fs = std::filesystem;

bool all_digits(const std::string& s) {
  return !s.empty() && s.size() <= 9 &&
         std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c); });
}

std::vector<std::string> split(const std::string& s, char separator) {
  std::vector<std::string> parts;
  std::size_t start = 0;
  for (;;) {
    const auto at = s.find(separator, start);
    parts.push_back(s.substr(start, at == std::string::npos ? std::string::npos : at - start));
    if (at == std::string::npos) return parts;
    start = at + 1;
  }
}

std::string absolute(const std::string& path, const std::string& cwd) {
  const fs::path p(path);
  return (p.is_absolute() ? p : fs::path(cwd) / p).lexically_normal().string();
}

/// `tessera train` options the job sets itself; giving them after `--` would conflict.
constexpr const char* kOwnTrainOptions[] = {"--model",       "--data",           "--val-data",         "--plan",
                                            "--metrics-dir", "--checkpoint-dir", "--checkpoint-every", "--resume"};

/// The value of `--name V` or `--name=V` among the train arguments, if any (the last one wins).
std::optional<std::string> train_option(const std::vector<std::string>& args, const std::string& name) {
  std::optional<std::string> value;
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == name && i + 1 < args.size())
      value = args[i + 1];
    else if (args[i].rfind(name + "=", 0) == 0)
      value = args[i].substr(name.size() + 1);
  }
  return value;
}

bool has_train_option(const std::vector<std::string>& args, const std::string& name) {
  return std::any_of(args.begin(), args.end(),
                     [&](const std::string& a) { return a == name || a.rfind(name + "=", 0) == 0; });
}

/// Characters a path may not have when it goes into an #SBATCH line (sbatch splits those lines
/// itself, and expands %-patterns in --output).
void check_sbatch_path(const std::string& what, const std::string& path) {
  for (const char c : path)
    if (std::isspace(static_cast<unsigned char>(c)) || c == '"' || c == '\'' || c == '%' || c == '\\')
      fail_input(
          "{} '{}' contains '{}', which an #SBATCH line cannot carry; use a path without spaces, quotes, "
          "backslashes or '%'",
          what, path, c == '\n' ? std::string("\\n") : std::string(1, c));
}

/// Quotes a path in which "%j" stands for the job id: "${SLURM_JOB_ID}" is left to the shell.
std::string quote_with_job_id(const std::string& path) {
  std::string out;
  const auto parts = split(path, '%');
  out += parts[0].empty() ? "" : shell_quote(parts[0]);
  for (std::size_t i = 1; i < parts.size(); ++i) {
    if (!parts[i].empty() && parts[i][0] == 'j') {
      out += "\"${SLURM_JOB_ID}\"";
      if (parts[i].size() > 1) out += shell_quote(parts[i].substr(1));
    } else {
      out += shell_quote("%" + parts[i]);
    }
  }
  return out.empty() ? "''" : out;
}

}  // namespace

std::string shell_quote(const std::string& word) {
  const bool safe = !word.empty() && std::all_of(word.begin(), word.end(), [](unsigned char c) {
    return std::isalnum(c) || std::string_view("_@%+=:,./-").find(static_cast<char>(c)) != std::string_view::npos;
  });
  if (safe) return word;
  std::string out = "'";
  for (const char c : word) {
    if (c == '\'')
      out += "'\\''";
    else
      out += c;
  }
  return out + "'";
}

std::optional<long> parse_slurm_time(const std::string& text) {
  std::string days_part, rest = text;
  const auto dash = text.find('-');
  if (dash != std::string::npos) {
    days_part = text.substr(0, dash);
    rest = text.substr(dash + 1);
    if (!all_digits(days_part)) return std::nullopt;
  }
  const auto fields = split(rest, ':');
  if (fields.size() > 3) return std::nullopt;
  for (const auto& f : fields)
    if (!all_digits(f)) return std::nullopt;
  std::vector<long> v;
  for (const auto& f : fields) v.push_back(std::stol(f));
  long days = days_part.empty() ? 0 : std::stol(days_part), hours = 0, minutes = 0, seconds = 0;
  if (days_part.empty()) {
    // M, M:S, H:M:S
    if (v.size() == 1)
      minutes = v[0];
    else if (v.size() == 2)
      minutes = v[0], seconds = v[1];
    else
      hours = v[0], minutes = v[1], seconds = v[2];
    if (v.size() >= 2 && seconds >= 60) return std::nullopt;
    if (v.size() == 3 && minutes >= 60) return std::nullopt;
  } else {
    // D-H, D-H:M, D-H:M:S
    hours = v[0];
    if (v.size() >= 2) minutes = v[1];
    if (v.size() == 3) seconds = v[2];
    if (hours >= 24 || minutes >= 60 || seconds >= 60) return std::nullopt;
  }
  const long total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds;
  if (total <= 0) return std::nullopt;
  return total;
}

void check_job_request(const JobSpec& spec, bool gpu_training_built) {
  if (spec.nodes < 1) fail_input("--nodes must be at least 1 (got {})", spec.nodes);
  if (spec.replica_groups < 0) fail_input("--replica-groups must be 0 (off) or more (got {})", spec.replica_groups);
  if (spec.replica_groups > 0) {
    if (spec.nodes * spec.tasks_per_node % spec.replica_groups != 0)
      fail_input("--replica-groups {} does not divide the job's {} ranks", spec.replica_groups,
                 spec.nodes * spec.tasks_per_node);
    if (spec.min_groups < 1 || spec.min_groups > spec.replica_groups)
      fail_input("--min-groups {} must be between 1 and the {} groups", spec.min_groups, spec.replica_groups);
    if (spec.plan == "auto") fail_input("--replica-groups takes a plan file (or none): --plan auto is not built for it");
  }
  if (spec.tasks_per_node < 1) fail_input("--tasks-per-node must be at least 1 (got {})", spec.tasks_per_node);
  if (spec.cpus_per_task < 1) fail_input("--cpus-per-task must be at least 1 (got {})", spec.cpus_per_task);
  if (spec.gpus_per_task < 0) fail_input("--gpus-per-task must be 0 or more (got {})", spec.gpus_per_task);
  if (spec.gpus_per_task > 0 && !gpu_training_built)
    fail_input(
        "--gpus-per-task {}: the GPU path is not built in this tessera (TESSERA_ENABLE_CUDA=OFF): rebuild with "
        "-DTESSERA_ENABLE_CUDA=ON, or ask for CPU tasks only (--gpus-per-task 0)",
        spec.gpus_per_task);
  if (spec.gpus_per_task > 1)
    fail_input("--gpus-per-task {}: Tessera runs one rank per GPU; ask for --gpus-per-task 1 and one task per GPU "
               "(--tasks-per-node)",
               spec.gpus_per_task);
  if (!parse_slurm_time(spec.time))
    fail_input(
        "--time '{}' is not a Slurm time limit greater than zero: use HH:MM:SS (e.g. 00:30:00), MM, MM:SS, "
        "D-HH, D-HH:MM or D-HH:MM:SS",
        spec.time);
  if (spec.job_name.empty() || spec.job_name.size() > 128 ||
      !std::all_of(spec.job_name.begin(), spec.job_name.end(),
                   [](unsigned char c) { return std::isalnum(c) || c == '_' || c == '-' || c == '.'; }))
    fail_input("--job-name '{}' must be 1-128 letters, digits, '_', '-' or '.' (it names the output files)",
               spec.job_name);
  for (const auto& [what, value] : {std::pair{"--partition", spec.partition}, std::pair{"--account", spec.account}})
    if (std::any_of(value.begin(), value.end(), [](unsigned char c) { return std::isspace(c) || c == '"'; }))
      fail_input("{} '{}' may not contain spaces or quotes", what, value);
  if (spec.mpi.empty() ||
      !std::all_of(spec.mpi.begin(), spec.mpi.end(), [](unsigned char c) { return std::isalnum(c) || c == '_'; }))
    fail_input("--mpi '{}' is not an srun MPI plugin name (e.g. pmix)", spec.mpi);
  for (const auto& line : spec.sbatch_lines) {
    if (line.rfind("#SBATCH ", 0) != 0 || line.find('\n') != std::string::npos)
      fail_input("--sbatch-line '{}' must be one line starting with '#SBATCH ' (e.g. \"#SBATCH --mem=8G\")", line);
  }
  if (spec.signal_seconds < 0 || spec.signal_seconds > 65535)
    fail_input("--signal-seconds must be 0 (no signal) to 65535 (got {})", spec.signal_seconds);
  if (const auto limit = parse_slurm_time(spec.time); limit && spec.signal_seconds >= *limit)
    fail_input(
        "--signal-seconds {} is not less than the time limit --time {} ({} s): the job would be told to stop "
        "as it starts; give a smaller --signal-seconds (0: none) or a longer --time",
        spec.signal_seconds, spec.time, *limit);
  if (!spec.checkpoints && (!spec.checkpoint_dir.empty() || spec.checkpoint_every))
    fail_input("--no-checkpoints conflicts with --checkpoint-dir and --checkpoint-every");
  if (spec.checkpoint_every && *spec.checkpoint_every < 0)
    fail_input("--checkpoint-every must be 0 or more (got {})", *spec.checkpoint_every);
  for (const char* own : kOwnTrainOptions)
    if (has_train_option(spec.train_args, own))
      fail_input("'{}' after '--' conflicts with the job's own option: give {} to 'tessera job' itself", own, own);
  for (const auto& arg : spec.train_args)
    if (arg.find('\n') != std::string::npos)
      fail_input("the argument '{}' for tessera train contains a line break", arg);
}

ResolvedJob resolve_job(const JobSpec& spec, const std::string& cwd) {
  ResolvedJob job{spec, {}, {}, {}};
  JobSpec& s = job.spec;
  if (s.model.empty()) fail_input("--model is required");
  if (s.data.empty()) fail_input("--data is required");
  s.workdir = absolute(s.workdir.empty() ? cwd : s.workdir, cwd);
  check_sbatch_path("--workdir", s.workdir);
  std::error_code ec;
  if (!fs::is_directory(s.workdir, ec))
    fail_input("--workdir '{}' is not an existing folder (the job runs there and writes its output there)", s.workdir);

  s.model = absolute(s.model, cwd);
  ModelOptions shapes_only;  // the planner reads shapes: nothing of the weights is allocated here
  shapes_only.allocate_parameters = false;
  const Model model = Model::load(s.model, shapes_only);  // InputError naming the file when it does not parse
  s.data = absolute(s.data, cwd);
  if (!s.val_data.empty()) s.val_data = absolute(s.val_data, cwd);
  for (const auto& [what, path] : {std::pair{"--data", s.data}, std::pair{"--val-data", s.val_data}}) {
    if (path.empty()) continue;
    if (!fs::exists(path, ec)) fail_input("{}: data file '{}' does not exist", what, path);
    if (!fs::is_regular_file(path, ec)) fail_input("{}: data file '{}' is not a regular file", what, path);
  }

  std::int64_t batch = TrainerOptions{}.global_batch;
  if (const auto b = train_option(s.train_args, "--batch")) {
    try {
      batch = std::stoll(*b);
    } catch (const std::exception&) {
      fail_input("--batch '{}' (after '--') is not a number", *b);
    }
  }
  if (s.plan == "auto") {
    // Planned when the job starts (tessera train --plan auto); planned here too, so that a job
    // no plan fits is refused before it waits in the queue.
    if (s.machine.empty())
      fail_input("--plan auto needs --machine FILE: a machine file written by 'tessera calibrate', or one of machines/");
    s.machine = absolute(s.machine, cwd);
    std::string report;
    auto_plan(model, s.machine,
              job_planner_options(s.ranks(), [&](const char* name) { return train_option(s.train_args, name); }),
              batch, report);
  } else if (!s.machine.empty()) {
    fail_input("--machine is for --plan auto; this job has {}", s.plan.empty() ? "no --plan" : "a plan file");
  }
  if (!s.plan.empty() && s.plan != "auto") {
    s.plan = absolute(s.plan, cwd);
    const Plan plan = Plan::load(s.plan);
    if (s.replica_groups > 0 && plan.ranks() * s.replica_groups != s.ranks())
      fail_input("plan '{}' is for {} ranks, but each of the {} replica groups has {} ranks", s.plan, plan.ranks(),
                 s.replica_groups, s.ranks() / s.replica_groups);
    if (s.ranks() < plan.ranks() || s.ranks() % plan.ranks() != 0)
      fail_input("plan '{}' is for {} ranks, but the job has {} ranks (--nodes {} x --tasks-per-node {}; a multiple "
                 "of the plan's ranks runs it as replica groups)", s.plan, plan.ranks(), s.ranks(), s.nodes,
                 s.tasks_per_node);
    plan.for_job(s.ranks()).validate(s.ranks(), model.plan_info(batch));
  }

  const std::string metrics = s.metrics_dir.empty() ? "runs/" + s.job_name + "-%j" : s.metrics_dir;
  job.metrics_dir = absolute(metrics, s.metrics_dir.empty() ? s.workdir : cwd);

  const std::string checkpoints = s.checkpoint_dir.empty() ? "checkpoints/" + s.job_name : s.checkpoint_dir;
  job.checkpoint_dir = absolute(checkpoints, s.checkpoint_dir.empty() ? s.workdir : cwd);
  if (!s.checkpoints) {
    job.checkpoint_dir.clear();
    s.requeue = false;
    s.signal_seconds = 0;
  }
  if (std::count(job.checkpoint_dir.begin(), job.checkpoint_dir.end(), '\n') > 0)
    fail_input("--checkpoint-dir '{}' contains a line break", job.checkpoint_dir);

  job.script = absolute(s.output.empty() ? s.job_name + ".sbatch" : s.output, cwd);
  const fs::path parent = fs::path(job.script).parent_path();
  if (!fs::is_directory(parent, ec))
    fail_input("--output '{}': the folder '{}' does not exist", job.script, parent.string());
  if (fs::is_directory(job.script, ec)) fail_input("--output '{}' is a folder; give a file name", job.script);
  return job;
}

std::string render_job_script(const ResolvedJob& job, const std::string& tessera_binary,
                              const std::string& command_line) {
  const JobSpec& s = job.spec;
  std::string out = "#!/bin/bash\n";
  out += fmt::format("# Tessera training job: {} on {} node(s) x {} task(s), {} CPU(s) per task.\n", s.job_name,
                     s.nodes, s.tasks_per_node, s.cpus_per_task);
  if (!command_line.empty()) out += fmt::format("# Written by: {}\n", command_line);
  out += fmt::format("#SBATCH --job-name={}\n", s.job_name);
  out += fmt::format("#SBATCH --nodes={}\n", s.nodes);
  out += fmt::format("#SBATCH --ntasks-per-node={}\n", s.tasks_per_node);
  out += fmt::format("#SBATCH --cpus-per-task={}\n", s.cpus_per_task);
  out += fmt::format("#SBATCH --time={}\n", s.time);
  out += fmt::format("#SBATCH --chdir={}\n", s.workdir);
  out += fmt::format("#SBATCH --output={}/{}-%j.out\n", s.workdir, s.job_name);
  // SIGUSR1 to the batch shell (B:) N seconds before the time limit: it passes the signal on to
  // the ranks, which checkpoint and stop (below).
  if (s.signal_seconds > 0) out += fmt::format("#SBATCH --signal=B:USR1@{}\n", s.signal_seconds);
  // Requeued: the output of every run goes to the same file (Slurm would truncate it otherwise).
  if (s.requeue) out += "#SBATCH --requeue\n#SBATCH --open-mode=append\n";
  if (!s.partition.empty()) out += fmt::format("#SBATCH --partition={}\n", s.partition);
  if (!s.account.empty()) out += fmt::format("#SBATCH --account={}\n", s.account);
  if (s.gpus_per_task > 0) out += fmt::format("#SBATCH --gpus-per-task={}\n", s.gpus_per_task);
  for (const auto& line : s.sbatch_lines) out += fmt::format("{}\n", line);
  out += "set -euo pipefail\n";
  out += fmt::format("export OMP_NUM_THREADS=${{SLURM_CPUS_PER_TASK:-{}}}\n", s.cpus_per_task);
  // Since Slurm 22.05 srun does not take --cpus-per-task from the allocation: say it again, so
  // each task gets its cores (and its threads are not bound to one). A task that fails ends the
  // whole step instead of leaving the others waiting.
  out +=
      "echo \"tessera job: job ${SLURM_JOB_ID}, run $(( ${SLURM_RESTART_COUNT:-0} + 1 )), started $(date "
      "'+%Y-%m-%dT%H:%M:%S') on $(hostname)\"\n";
  // SIGUSR1 (from --signal above, or `scancel --signal=USR1 --batch`) reaches this shell only:
  // srun runs in the background so that the trap can pass it on, and srun passes it to every rank.
  out += "srun_pid=\n";
  out +=
      "trap 'echo \"tessera job: SIGUSR1: the ranks checkpoint and stop\"; "
      "if [ -n \"$srun_pid\" ]; then kill -USR1 \"$srun_pid\" || true; fi' USR1\n";
  if (s.replica_groups > 0)
    // One job step per group; the launcher restarts a failed one, and passes SIGUSR1 on to every group.
    out += fmt::format("{} launch --launcher srun --launcher-args {} --groups {} --ranks-per-group {} --min-groups {} "
                       "--store {} -- \\\n",
                       shell_quote(tessera_binary),
                       shell_quote(fmt::format("--mpi={} --cpus-per-task={}", s.mpi, s.cpus_per_task)),
                       s.replica_groups, s.ranks() / s.replica_groups, s.min_groups,
                       quote_with_job_id(s.workdir + "/tessera-store-%j"));
  else
    out += fmt::format("srun --mpi={} --cpus-per-task={} --kill-on-bad-exit=1 {} train \\\n", s.mpi,
                       s.cpus_per_task, shell_quote(tessera_binary));
  std::vector<std::string> lines;
  lines.push_back(fmt::format("--model {}", shell_quote(s.model)));
  lines.push_back(fmt::format("--data {}", shell_quote(s.data)));
  if (!s.val_data.empty()) lines.push_back(fmt::format("--val-data {}", shell_quote(s.val_data)));
  if (!s.plan.empty()) lines.push_back(fmt::format("--plan {}", shell_quote(s.plan)));
  if (!s.machine.empty()) lines.push_back(fmt::format("--machine {}", shell_quote(s.machine)));
  lines.push_back(fmt::format("--metrics-dir {}", quote_with_job_id(job.metrics_dir)));
  if (s.checkpoints) {
    lines.push_back(fmt::format("--checkpoint-dir {}", quote_with_job_id(job.checkpoint_dir)));
    if (s.checkpoint_every) lines.push_back(fmt::format("--checkpoint-every {}", *s.checkpoint_every));
    lines.push_back("--resume auto");
  }
  if (!has_train_option(s.train_args, "--threads")) lines.push_back(fmt::format("--threads {}", s.cpus_per_task));
  // A GPU per task: the layers run there (each rank sees its own GPU under --gpus-per-task).
  if (s.gpus_per_task > 0 && !has_train_option(s.train_args, "--device")) lines.push_back("--device cuda");
  if (!s.train_args.empty()) {
    std::vector<std::string> quoted;
    for (const auto& a : s.train_args) quoted.push_back(shell_quote(a));
    lines.push_back(fmt::format("{}", fmt::join(quoted, " ")));
  }
  for (std::size_t i = 0; i < lines.size(); ++i)
    out += fmt::format("  {}{}", lines[i], i + 1 < lines.size() ? " \\\n" : " &\n");
  out += "srun_pid=$!\n";
  // `wait` returns early (status > 128) when the trap runs: wait again until srun has ended.
  out +=
      "while :; do\n  status=0\n  wait \"$srun_pid\" || status=$?\n  kill -0 \"$srun_pid\" 2>/dev/null || "
      "break\ndone\n";
  out += fmt::format("if [ \"$status\" -eq {} ]; then\n", kExitStopped);
  if (s.requeue) {
    out +=
        "  echo \"tessera job: stopped on a signal with a checkpoint; requeueing job ${SLURM_JOB_ID}, which "
        "resumes from it\"\n";
    out += fmt::format("  scontrol requeue \"$SLURM_JOB_ID\" || exit {}\n", kExitStopped);
    out += "  exit 0\nfi\n";
  } else {
    out += s.checkpoints
               ? "  echo \"tessera job: stopped on a signal with a checkpoint; submit the job again to resume\"\n"
               : "  echo \"tessera job: stopped on a signal (no checkpoints: --no-checkpoints)\"\n";
    out += "fi\n";
  }
  out += "exit \"$status\"\n";
  return out;
}

}  // namespace tessera
