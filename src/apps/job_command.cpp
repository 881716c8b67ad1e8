// `tessera job`: writes a Slurm batch script for `tessera train` and, with --submit, submits it.
// Runs as one process (MPI starts as a singleton; nothing here is collective).
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "commands.hpp"
#include "job_script.hpp"
#include "tessera/core/cuda.hpp"
#include "tessera/core/error.hpp"
#include "tessera/parallel/collective_guard.hpp"

extern char** environ;

namespace tessera {
namespace {

namespace fs = std::filesystem;

/// Whether `tessera train` can run models on GPUs (`--device cuda`): in a build with CUDA.

// The process as it was started, before MPI_Init: a singleton MPI start adds OMPI_MCA_ess=singleton,
// PMIX_SERVER_URI* (a server that is gone once we exit) and more to this process's environment, and
// sbatch exports the environment it is given into the job. srun's PMIx happens to override them
// today; the job should not depend on that, so sbatch gets the environment from before MPI_Init.
std::vector<std::string>& launch_environment() {
  static std::vector<std::string> env;
  return env;
}
std::vector<std::string>& launch_arguments() {
  static std::vector<std::string> args;
  return args;
}

struct JobArgs {
  JobSpec spec;
  bool submit = false;
};

std::string find_on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  std::size_t start = 0;
  while (start <= dirs.size()) {
    auto end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    const std::string dir = dirs.substr(start, end - start);
    const fs::path candidate = fs::path(dir.empty() ? "." : dir) / program;
    std::error_code ec;
    if (fs::is_regular_file(candidate, ec) && ::access(candidate.c_str(), X_OK) == 0) return candidate.string();
    start = end + 1;
  }
  return {};
}

/// Runs `argv` with the launch environment; returns its exit status and its standard output.
std::pair<int, std::string> run_capturing(const std::vector<std::string>& argv) {
  int fds[2];
  if (::pipe(fds) != 0) fail("pipe: {}", std::strerror(errno));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  posix_spawn_file_actions_addclose(&actions, fds[1]);
  std::vector<char*> args, env;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const auto& saved = launch_environment();
  for (const auto& e : saved) env.push_back(const_cast<char*>(e.c_str()));
  env.push_back(nullptr);
  pid_t pid = 0;
  const int rc =
      ::posix_spawn(&pid, argv[0].c_str(), &actions, nullptr, args.data(), saved.empty() ? environ : env.data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    fail("cannot run {}: {}", argv[0], std::strerror(rc));
  }
  std::string output;
  char buffer[4096];
  for (;;) {
    const ssize_t n = ::read(fds[0], buffer, sizeof buffer);
    if (n > 0)
      output.append(buffer, static_cast<std::size_t>(n));
    else if (n == 0 || errno != EINTR)
      break;
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  return {code, output};
}

std::string command_line() {
  std::vector<std::string> quoted;
  for (const auto& a : launch_arguments()) quoted.push_back(shell_quote(a));
  return fmt::format("{}", fmt::join(quoted, " "));
}

void run_job(Communicator& world, const JobArgs& args) {
  ResolvedJob job;
  std::string sbatch, binary;
  collectively(world, [&] {
    if (world.size() > 1)
      fail_input(
          "'tessera job' writes and submits a batch script from one process; run it without mpirun/srun "
          "(this is {} processes)",
          world.size());
    const auto& argv = launch_arguments();
    if (!args.spec.train_args.empty() && std::find(argv.begin(), argv.end(), "--") == argv.end())
      fail_input("unexpected argument '{}': arguments for 'tessera train' go after '--'", args.spec.train_args[0]);
    check_job_request(args.spec, cuda::built());
    job = resolve_job(args.spec, fs::current_path().string());
    if (args.submit) {
      sbatch = find_on_path("sbatch");
      if (sbatch.empty())
        fail_input(
            "--submit needs 'sbatch', which is not on PATH; run this on a Slurm login node, or leave out "
            "--submit and submit the script there");
    }
    std::error_code ec;
    binary = fs::read_symlink("/proc/self/exe", ec).string();
    if (ec) fail("cannot find this tessera binary (/proc/self/exe): {}", ec.message());
  });

  const std::string script = render_job_script(job, binary, command_line());
  {
    std::ofstream out(job.script, std::ios::trunc);
    out << script;
    out.close();
    if (!out) fail_input("cannot write the job script '{}'", job.script);
  }
  fmt::print("{}\n", job.script);
  std::fflush(stdout);
  if (!args.submit) return;

  const auto [code, output] = run_capturing({sbatch, "--parsable", job.script});
  std::string id = output.substr(0, output.find_first_of(";\r\n"));
  while (!id.empty() && std::isspace(static_cast<unsigned char>(id.back()))) id.pop_back();
  if (code != 0) fail("sbatch refused the job script '{}' (exit status {}); its message is above", job.script, code);
  if (id.empty() || id.find_first_not_of("0123456789") != std::string::npos)
    fail("sbatch --parsable printed '{}', not a job id", output);
  fmt::print("submitted job {}\njob_id={}\n", id, id);
  std::fflush(stdout);
}

}  // namespace

void record_launch(int argc, char** argv) {
  auto& args = launch_arguments();
  args.assign(argv, argv + argc);
  auto& env = launch_environment();
  env.clear();
  for (char** e = environ; e && *e; ++e) env.emplace_back(*e);
}

std::function<void(Communicator&)> add_job_command(CLI::App& app) {
  auto args = std::make_shared<JobArgs>();
  auto& s = args->spec;
  auto* cmd =
      app.add_subcommand("job", "Write a Slurm batch script that runs 'tessera train' (and submit it with --submit)");
  cmd->footer(
      "Everything after '--' is passed to 'tessera train' (e.g. -- --epochs 10 --batch 64 --lr 0.05). Relative "
      "paths are taken from the current folder. Prints the script's path; with --submit also 'submitted job ID' and "
      "a last line 'job_id=ID'.");
  cmd->add_option("--model", s.model, "Model file (YAML)")->required();
  cmd->add_option("--data", s.data, "Training data (HDF5)")->required();
  cmd->add_option("--val-data", s.val_data, "Validation / test data (HDF5)");
  cmd->add_option("--plan", s.plan,
                  "Plan file (YAML) for nodes x tasks-per-node ranks, or auto (the planner's, on --machine); default: "
                  "sample-parallel");
  cmd->add_option("--machine", s.machine, "Machine file for --plan auto (tessera calibrate writes one; see machines/)");
  cmd->add_option("--nodes", s.nodes, "Nodes")->required();
  cmd->add_option("--tasks-per-node", s.tasks_per_node, "MPI ranks per node")->required();
  cmd->add_option("--cpus-per-task", s.cpus_per_task, "Cores per rank (also its threads)")->capture_default_str();
  cmd->add_option("--gpus-per-task", s.gpus_per_task, "1: a GPU per rank, which trains there (tessera train --device cuda; needs the GPU build)")->capture_default_str();
  cmd->add_option("--time", s.time, "Time limit (HH:MM:SS, or any Slurm form)")->capture_default_str();
  cmd->add_option("--partition", s.partition, "Slurm partition");
  cmd->add_option("--account", s.account, "Slurm account");
  cmd->add_option("--job-name", s.job_name, "Job name (names the .sbatch, .out and metrics folder)")
      ->capture_default_str();
  cmd->add_option("--sbatch-line", s.sbatch_lines, "An extra '#SBATCH ...' line, verbatim (repeatable)")
      ->allow_extra_args(false);  // one line per --sbatch-line
  cmd->add_option("--workdir", s.workdir, "Folder the job runs in and writes <job-name>-<id>.out to (default: here)");
  cmd->add_option("--metrics-dir", s.metrics_dir,
                  "Metrics folder; %j is the job id (default: <workdir>/runs/<job-name>-<job id>)");
  cmd->add_option("--checkpoint-dir", s.checkpoint_dir,
                  "Checkpoints of the run, resumed from automatically (--resume auto); %j is the job id "
                  "(default: <workdir>/checkpoints/<job-name>)");
  cmd->add_flag("!--no-checkpoints", s.checkpoints,
                "No checkpoints, no resume, no SIGUSR1 before the time limit, no requeue (e.g. for timing runs)");
  cmd->add_option("--checkpoint-every", s.checkpoint_every, "Checkpoint every N steps (default: tessera train's)");
  cmd->add_option("--signal-seconds", s.signal_seconds,
                  "Slurm sends SIGUSR1 this many seconds before the time limit: the ranks checkpoint and stop "
                  "(0: no signal)")
      ->capture_default_str();
  cmd->add_flag("--requeue,!--no-requeue", s.requeue,
                "Requeue the job when the ranks stopped on a signal; it resumes from the checkpoint (default: on)");
  cmd->add_option("--output", s.output, "The batch script to write (default: <job-name>.sbatch)");
  cmd->add_option("--mpi", s.mpi, "srun's MPI plugin (Debian's Open MPI needs pmix)")->capture_default_str();
  cmd->add_option("--replica-groups", s.replica_groups,
                  "Fault-tolerant replica groups: the job's ranks run as this many groups, each its own job step "
                  "under 'tessera launch', which restarts a failed step (0: off)")
      ->capture_default_str();
  cmd->add_option("--min-groups", s.min_groups, "With --replica-groups: no step commits with fewer live groups")
      ->capture_default_str();
  cmd->add_flag("--submit", args->submit, "Submit the script with sbatch and print its job id");
  cmd->add_option("train-args", s.train_args, "Arguments for 'tessera train' (after --)");
  return [args, cmd](Communicator& world) {
    if (!cmd->parsed()) return;
    run_job(world, *args);
  };
}

}  // namespace tessera
