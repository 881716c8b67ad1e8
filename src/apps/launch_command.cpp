// `tessera launch`: the supervisor of fault-tolerant replica groups. It starts each group as its
// own MPI job (mpirun, or an srun job step inside a Slurm allocation), restarts a group that
// fails, and removes the store when every group has finished. Runs before MPI starts: a plain
// front-end process (docs/fault_tolerance.md).
#include <fmt/format.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "commands.hpp"
#include "signals.hpp"

namespace {

namespace fs = std::filesystem;
using SteadyClock = std::chrono::steady_clock;

volatile std::sig_atomic_t stop_signal_received = 0;
void on_stop_signal(int signal) { stop_signal_received = signal; }

std::vector<std::string> split_words(const std::string& text) {
  std::istringstream in(text);
  std::vector<std::string> out;
  for (std::string word; in >> word;) out.push_back(word);
  return out;
}

std::string describe(int status) {
  if (WIFSIGNALED(status)) return fmt::format("killed by signal {}", WTERMSIG(status));
  return fmt::format("exit code {}", WEXITSTATUS(status));
}

void say(const std::string& text) {
  std::fprintf(stderr, "tessera launch: %s\n", text.c_str());
  std::fflush(stderr);
}

struct Group {
  pid_t pid = -1;
  int incarnation = 0;
  bool done = false;
  SteadyClock::time_point started;
};

}  // namespace

int tessera::run_launch(int argc, char** argv) {
  CLI::App app{"tessera launch: run fault-tolerant replica groups, each its own MPI job, restarting any that fails"};
  int groups = 2, ranks = 1, min_groups = 1, max_restarts = 10;
  double restart_delay = 0.5;
  std::string store, launcher, launcher_args, log_dir;
  app.add_option("--groups", groups, "Replica groups")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--ranks-per-group", ranks, "Ranks of each group (the plan's)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--min-groups", min_groups, "No step commits with fewer live groups")->capture_default_str();
  app.add_option("--max-restarts", max_restarts, "Restarts of one group before the launcher stops restarting it")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--restart-delay", restart_delay, "Seconds between a group's failure and its restart")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--store", store,
                 "The folder every group meets in, on a file system every node reaches (default: "
                 "tessera-store-<job or pid> in the working folder); removed when training ends")
      ->capture_default_str();
  app.add_option("--launcher", launcher,
                 "How a group starts: mpirun, or srun (one job step per group; the default inside a Slurm job)");
  app.add_option("--launcher-args", launcher_args, "More arguments for mpirun or srun, as one string");
  app.add_option("--log-dir", log_dir, "Write each group's output to group<G>.log here (default: this terminal)");
  std::vector<std::string> train_args;
  app.add_option("train", train_args, "After --: the arguments of 'tessera train'")->required();
  app.positionals_at_end();
  try {
    app.parse(argc - 1, argv + 1);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  if (min_groups < 1 || min_groups > groups) {
    say(fmt::format("error: --min-groups {} must be between 1 and the {} groups", min_groups, groups));
    return 2;
  }
  const char* job = std::getenv("SLURM_JOB_ID");
  if (launcher.empty()) launcher = job ? "srun" : "mpirun";
  if (launcher != "mpirun" && launcher != "srun") {
    say(fmt::format("error: --launcher must be mpirun or srun, got '{}'", launcher));
    return 2;
  }
  if (store.empty()) store = fmt::format("tessera-store-{}", job ? std::string(job) : std::to_string(getpid()));
  std::error_code ec;
  if (fs::exists(store, ec)) {
    // A store left by an earlier attempt of this job (a requeue) is ours to clear; anything else is not.
    if (!fs::is_directory(store, ec) || (!fs::is_empty(store, ec) && !fs::exists(fs::path(store) / "identity", ec))) {
      say(fmt::format("error: --store '{}' exists and is not a replica store: name a new folder", store));
      return 2;
    }
    fs::remove_all(store, ec);
  }
  fs::create_directories(store, ec);
  if (ec) {
    say(fmt::format("error: cannot make the store folder '{}': {}", store, ec.message()));
    return 2;
  }
  if (!log_dir.empty()) fs::create_directories(log_dir, ec);

  char self[4096];
  const ssize_t length = readlink("/proc/self/exe", self, sizeof(self) - 1);
  const std::string tessera = length > 0 ? std::string(self, static_cast<std::size_t>(length)) : std::string(argv[0]);

  std::vector<Group> state(static_cast<std::size_t>(groups));
  const auto start_group = [&](int g) {
    Group& group = state[static_cast<std::size_t>(g)];
    std::vector<std::string> command;
    if (launcher == "mpirun") command = {"mpirun", "-n", std::to_string(ranks)};
    else command = {"srun", fmt::format("--ntasks={}", ranks), "--exclusive", "--kill-on-bad-exit=1",
                    fmt::format("--job-name=group{}", g)};
    for (auto& word : split_words(launcher_args)) command.push_back(word);
    command.push_back(tessera);
    command.emplace_back("train");
    for (auto& a : train_args) command.push_back(a);
    for (auto& a : std::vector<std::string>{"--replica-store", store, "--replica-group", std::to_string(g),
                                            "--replica-groups", std::to_string(groups), "--min-groups",
                                            std::to_string(min_groups)})
      command.push_back(a);
    const pid_t launcher_pid = getpid();
    const pid_t pid = fork();
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGTERM);  // a launcher that dies takes its groups with it
      if (getppid() != launcher_pid) _exit(1);  // it died before prctl
      setpgid(0, 0);
      setenv("TESSERA_INCARNATION", std::to_string(group.incarnation).c_str(), 1);
      if (!log_dir.empty()) {
        const std::string path = fmt::format("{}/group{}.log", log_dir, g);
        if (!std::freopen(path.c_str(), "a", stdout) || !std::freopen(path.c_str(), "a", stderr)) _exit(127);
        setvbuf(stdout, nullptr, _IOLBF, 0);
      }
      std::vector<char*> raw;
      for (auto& word : command) raw.push_back(word.data());
      raw.push_back(nullptr);
      execvp(raw[0], raw.data());
      std::fprintf(stderr, "tessera launch: cannot run %s: %s\n", raw[0], std::strerror(errno));
      _exit(127);
    }
    setpgid(pid, pid);  // also here: the group exists whichever runs first
    group.pid = pid;
    group.started = SteadyClock::now();
    say(fmt::format("group {} started (incarnation {}, pid {})", g, group.incarnation, pid));
  };

  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGUSR1, &action, nullptr);
  for (int g = 0; g < groups; ++g) start_group(g);

  int code = 0;
  bool forwarded = false;
  const auto alive = [&] {
    return std::any_of(state.begin(), state.end(), [](const Group& group) { return group.pid > 0; });
  };
  // Ends every group still running: SIGTERM (mpirun and srun end their ranks), SIGKILL after 10 s.
  const auto end_all = [&] {
    for (const Group& group : state)
      if (group.pid > 0) kill(-group.pid, SIGTERM);
    const auto deadline = SteadyClock::now() + std::chrono::seconds(10);
    while (alive() && SteadyClock::now() < deadline) {
      int status = 0;
      const pid_t pid = waitpid(-1, &status, WNOHANG);
      for (Group& group : state)
        if (pid > 0 && group.pid == pid) group.pid = -1;
      if (pid <= 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    for (Group& group : state)
      if (group.pid > 0) {
        kill(-group.pid, SIGKILL);
        waitpid(group.pid, nullptr, 0);
        group.pid = -1;
      }
  };
  while (alive()) {
    if (stop_signal_received && !forwarded) {
      // Every group stops at its next step boundary and checkpoints (signals.hpp); none restarts.
      say(fmt::format("signal {}: asking every group to stop", static_cast<int>(stop_signal_received)));
      for (const Group& group : state)
        if (group.pid > 0) kill(group.pid, SIGUSR1);  // mpirun and srun pass it on to every rank
      forwarded = true;
    }
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid == 0 || (pid < 0 && errno == EINTR)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    if (pid < 0) break;
    int g = 0;
    while (g < groups && state[static_cast<std::size_t>(g)].pid != pid) ++g;
    if (g == groups) continue;
    Group& group = state[static_cast<std::size_t>(g)];
    group.pid = -1;
    const double ran = std::chrono::duration<double>(SteadyClock::now() - group.started).count();
    const int exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (exit_code == 0) {
      group.done = true;
      say(fmt::format("group {} finished after {:.1f} s", g, ran));
      continue;
    }
    if (exit_code == 2) {
      // Bad input fails every group alike: end them all.
      say(fmt::format("group {} refused its input (exit code 2): stopping every group", g));
      code = 2;
      end_all();
      break;
    }
    if (forwarded || exit_code == tessera::kExitStopped) {
      // Stopped on a signal (from here, or sent to the group itself): checkpointed, not restarted.
      say(fmt::format("group {} stopped ({})", g, describe(status)));
      if (code == 0) code = exit_code;
      continue;
    }
    if (group.incarnation >= max_restarts) {
      say(fmt::format("group {} failed ({}) after {:.1f} s and was restarted {} times (--max-restarts): not again",
                      g, describe(status), ran, group.incarnation));
      code = 1;
      continue;
    }
    ++group.incarnation;
    say(fmt::format("group {} failed ({}) after {:.1f} s: restarting it (incarnation {})", g, describe(status), ran,
                    group.incarnation));
    std::this_thread::sleep_for(std::chrono::duration<double>(restart_delay));
    if (stop_signal_received) continue;  // asked to stop meanwhile: it stays down
    start_group(g);
  }
  const bool all_done = std::all_of(state.begin(), state.end(), [](const Group& group) { return group.done; });
  if (all_done) {
    fs::remove_all(store, ec);
    say(fmt::format("every group finished; store {} removed", store));
    return 0;
  }
  if (forwarded && code == 0) code = tessera::kExitStopped;
  say(fmt::format("ended with exit code {}; the store {} is kept", code == 0 ? 1 : code, store));
  return code == 0 ? 1 : code;
}
