#pragma once
// `tessera job`: a Slurm batch script for a training run. Pure code (no MPI, no Slurm): what the
// script says, and which requests are refused before anything is written or submitted.
#include <optional>
#include <string>
#include <vector>

namespace tessera {

/// One batch job, as the user asked for it. Paths may be relative (to `cwd`).
struct JobSpec {
  std::string model, data, val_data, plan;
  /// Machine file for --plan auto (the planner plans when the job starts, and once at submission to check).
  std::string machine;
  int nodes = 0;
  int tasks_per_node = 0;
  int cpus_per_task = 1;
  int gpus_per_task = 0;
  std::string time = "00:30:00";
  std::string partition, account;
  std::string job_name = "tessera";
  std::vector<std::string> sbatch_lines;  ///< verbatim, each starting with "#SBATCH"
  std::string workdir;                    ///< empty: the current directory
  std::string metrics_dir;                ///< empty: <workdir>/runs/<job-name>-%j; "%j" is the job id
  std::string output;                     ///< empty: <job-name>.sbatch in the current directory
  std::string mpi = "pmix";               ///< srun --mpi=
  std::vector<std::string> train_args;    ///< passed to `tessera train` after the generated options
  /// Checkpoints of the run (`tessera train --checkpoint-dir`); empty: <workdir>/checkpoints/<job-name>.
  /// Not per job id by default, so a job submitted again under the same name continues from it too
  /// (a requeued job keeps its id; "%j" is the job id here as well).
  std::string checkpoint_dir;
  /// false (--no-checkpoints): no --checkpoint-dir/--resume, no --signal line, no requeue (e.g.
  /// timing runs, where the checkpoint at the end would count in the time).
  bool checkpoints = true;
  std::optional<long long> checkpoint_every;  ///< `tessera train --checkpoint-every`, when given
  /// Slurm sends SIGUSR1 this many seconds before the time limit (#SBATCH --signal=B:USR1@N); 0: no
  /// such line. The ranks then checkpoint and stop with kExitStopped.
  int signal_seconds = 120;
  /// On kExitStopped the script requeues the job (scontrol requeue; #SBATCH --requeue), which
  /// resumes from the checkpoint; otherwise the job ends with exit code kExitStopped.
  bool requeue = true;
  /// Fault-tolerant replica groups (0: off): the job's ranks run as this many groups, each its own
  /// job step under `tessera launch`, which restarts a failed step (docs/fault_tolerance.md).
  int replica_groups = 0;
  int min_groups = 1;

  int ranks() const { return nodes * tasks_per_node; }
};

/// The job with every path absolute (relative ones taken from `cwd`) and defaults filled in.
struct ResolvedJob {
  JobSpec spec;             ///< model, data, val_data, plan, workdir absolute (plan may be empty)
  std::string script;       ///< absolute path of the .sbatch file
  std::string metrics_dir;  ///< absolute; may contain "%j"
  std::string checkpoint_dir;  ///< absolute; may contain "%j"
};

/// Shell-quotes one word for bash (unchanged when it needs no quoting).
std::string shell_quote(const std::string& word);

/// Seconds in a Slurm time limit: M, M:S, H:M:S, D-H, D-H:M or D-H:M:S; nullopt if malformed.
std::optional<long> parse_slurm_time(const std::string& text);

/// Checks what needs no files: the task layout (`gpu_training_built`: whether this build trains
/// on GPUs), the time limit, the job name, extra #SBATCH lines and the arguments for `tessera
/// train`. Throws InputError with one clear message.
void check_job_request(const JobSpec& spec, bool gpu_training_built);

/// Makes the paths absolute, fills in the defaults and checks the files: the model parses, the
/// data files exist, the plan loads, fits nodes x tasks-per-node and the model, the working folder
/// exists. Throws InputError.
ResolvedJob resolve_job(const JobSpec& spec, const std::string& cwd);

/// The batch script: #SBATCH header, environment, and one `srun` of `tessera_binary train` (with
/// replica_groups: `tessera_binary launch`, one job step per group), run in
/// the background so that the shell can pass SIGUSR1 on to it (srun passes it to every rank);
/// when the ranks stop with kExitStopped (signals.hpp) the script requeues the job (spec.requeue).
/// `command_line` (may be empty) is recorded in a comment.
std::string render_job_script(const ResolvedJob& job, const std::string& tessera_binary,
                              const std::string& command_line);

}  // namespace tessera
