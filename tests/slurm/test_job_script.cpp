// `tessera job`'s script writer without Slurm: quoting, time limits, what is refused, what the
// script says. (The same script against a real Slurm: job_test.py.)
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "job_script.hpp"
#include "tessera/core/error.hpp"

namespace tessera {
namespace {

namespace fs = std::filesystem;

const std::string kSource = TESSERA_SOURCE_DIR;

std::string refusal(const JobSpec& spec, bool cuda = false) {
  try {
    check_job_request(spec, cuda);
    resolve_job(spec, fs::current_path().string());
  } catch (const InputError& e) {
    return e.message();
  }
  return "";
}

/// A folder of its own with a data file in it.
struct Scratch {
  fs::path dir;
  Scratch() {
    dir = fs::temp_directory_path() / ("tessera_job_script_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    std::ofstream(dir / "train.h5") << "not really HDF5: tessera job only checks that it is there";
  }
  ~Scratch() { fs::remove_all(dir); }
};

JobSpec good_spec(const Scratch& s) {
  JobSpec spec;
  spec.model = kSource + "/models/fashion_cnn.yaml";
  spec.data = (s.dir / "train.h5").string();
  spec.nodes = 1;
  spec.tasks_per_node = 4;
  spec.workdir = s.dir.string();
  return spec;
}

TEST(JobScript, ShellQuote) {
  EXPECT_EQ(shell_quote("/a/b-c_d.yaml"), "/a/b-c_d.yaml");
  EXPECT_EQ(shell_quote("--lr=0.05"), "--lr=0.05");
  EXPECT_EQ(shell_quote("a b"), "'a b'");
  EXPECT_EQ(shell_quote("it's"), "'it'\\''s'");
  EXPECT_EQ(shell_quote("$HOME"), "'$HOME'");
  EXPECT_EQ(shell_quote(""), "''");
}

TEST(JobScript, SlurmTimeLimits) {
  EXPECT_EQ(parse_slurm_time("00:30:00"), 1800);
  EXPECT_EQ(parse_slurm_time("1:00:00"), 3600);
  EXPECT_EQ(parse_slurm_time("90"), 5400);         // minutes
  EXPECT_EQ(parse_slurm_time("10:30"), 630);       // minutes:seconds
  EXPECT_EQ(parse_slurm_time("2-00"), 2 * 86400);  // days-hours
  EXPECT_EQ(parse_slurm_time("1-02:03:04"), 93784);
  for (const char* bad : {"", "abc", "00:60:00", "1:2:3:4", "00:00:00", "0", "-1", "1-25", "1h", "00:30:0x"})
    EXPECT_FALSE(parse_slurm_time(bad)) << bad;
}

TEST(JobScript, RefusesImpossibleRequests) {
  Scratch s;
  JobSpec spec = good_spec(s);
  EXPECT_EQ(refusal(spec), "");

  auto with = [&](auto change) {
    JobSpec changed = spec;
    change(changed);
    return refusal(changed);
  };
  EXPECT_NE(with([](JobSpec& j) { j.nodes = 0; }).find("--nodes must be at least 1"), std::string::npos);
  EXPECT_NE(with([](JobSpec& j) { j.tasks_per_node = 0; }).find("--tasks-per-node must be at least 1"),
            std::string::npos);
  EXPECT_NE(with([](JobSpec& j) { j.cpus_per_task = 0; }).find("--cpus-per-task"), std::string::npos);
  EXPECT_NE(with([](JobSpec& j) { j.gpus_per_task = 1; }).find("GPU path is not built"), std::string::npos);
  EXPECT_NE(with([](JobSpec& j) { j.time = "30 min"; }).find("is not a Slurm time limit"), std::string::npos);
  EXPECT_NE(with([](JobSpec& j) { j.job_name = "a/b"; }).find("--job-name"), std::string::npos);
  EXPECT_NE(with([](JobSpec& j) { j.sbatch_lines = {"--mem=1G"}; }).find("starting with '#SBATCH '"),
            std::string::npos);
  EXPECT_NE(with([](JobSpec& j) {
              j.train_args = {"--steps", "5", "--metrics-dir", "x"};
            }).find("give --metrics-dir to 'tessera job' itself"),
            std::string::npos);
  EXPECT_NE(with([&](JobSpec& j) { j.data = (s.dir / "missing.h5").string(); }).find("missing.h5' does not exist"),
            std::string::npos);
  EXPECT_NE(with([](JobSpec& j) { j.val_data = "nowhere/test.h5"; }).find("--val-data"), std::string::npos);
  EXPECT_NE(with([](JobSpec& j) { j.model = kSource + "/tests/cli/bad/malformed.yaml"; }).find("malformed.yaml"),
            std::string::npos);
  EXPECT_NE(with([](JobSpec& j) { j.plan = "auto"; }).find("--plan auto needs --machine"), std::string::npos);
  EXPECT_NE(with([](JobSpec& j) { j.machine = kSource + "/machines/summit_class.yaml"; }).find("--machine is for --plan auto"),
            std::string::npos);
  // A job no plan fits is refused at submission: 1 KiB per rank.
  EXPECT_NE(with([&](JobSpec& j) {
              j.plan = "auto";
              j.machine = (s.dir / "tiny.yaml").string();
              std::ofstream(j.machine) << "name: tiny\nranks_per_node: 64\nmemory_per_rank: 1024\nintra: {p2p: {alpha: 1e-6, beta: 1e-9}}\n";
            }).find("fits machine 'tiny'"),
            std::string::npos)
      << with([&](JobSpec& j) {
           j.plan = "auto";
           j.machine = (s.dir / "tiny.yaml").string();
         });
  const std::string mismatch = with([](JobSpec& j) {
    j.tasks_per_node = 2;
    j.plan = kSource + "/plans/fashion_4ranks.yaml";
  });
  EXPECT_NE(mismatch.find("is for 4 ranks, but the job has 2 ranks"), std::string::npos) << mismatch;
  EXPECT_NE(with([&](JobSpec& j) { j.workdir = (s.dir / "nope").string(); }).find("is not an existing folder"),
            std::string::npos);
  // The GPU request is fine where the GPU path is built, one GPU per task; the script asks Slurm for
  // it and trains on it.
  JobSpec gpu = spec;
  gpu.gpus_per_task = 1;
  EXPECT_NO_THROW(check_job_request(gpu, true));
  EXPECT_NE(refusal(gpu).find("the GPU path is not built in this tessera"), std::string::npos) << refusal(gpu);
  const std::string gpu_script = render_job_script(resolve_job(gpu, s.dir.string()), "/x/tessera", "");
  EXPECT_NE(gpu_script.find("#SBATCH --gpus-per-task=1\n"), std::string::npos) << gpu_script;
  EXPECT_NE(gpu_script.find("--device cuda"), std::string::npos) << gpu_script;
  gpu.gpus_per_task = 2;
  EXPECT_NE(refusal(gpu, true).find("Tessera runs one rank per GPU"), std::string::npos) << refusal(gpu, true);
}

TEST(JobScript, WritesTheScript) {
  Scratch s;
  JobSpec spec = good_spec(s);
  spec.nodes = 2;
  spec.tasks_per_node = 2;
  spec.cpus_per_task = 3;
  spec.plan = kSource + "/plans/fashion_4ranks.yaml";
  spec.partition = "batch";
  spec.account = "proj1";
  spec.job_name = "fm";
  spec.sbatch_lines = {"#SBATCH --mem=8G"};
  spec.metrics_dir = (s.dir / "my runs" / "%j").string();
  spec.train_args = {"--steps", "20", "--lr", "0.05", "--note", "it's"};
  const ResolvedJob job = resolve_job(spec, s.dir.string());
  EXPECT_EQ(job.script, (s.dir / "fm.sbatch").string());
  const std::string text = render_job_script(job, "/opt/tessera/bin/tessera", "tessera job ...");
  EXPECT_EQ(text.rfind("#!/bin/bash\n", 0), 0u);
  const std::string dir = s.dir.string();
  for (const std::string& line :
       {std::string("#SBATCH --job-name=fm\n"), std::string("#SBATCH --nodes=2\n"),
        std::string("#SBATCH --ntasks-per-node=2\n"), std::string("#SBATCH --cpus-per-task=3\n"),
        std::string("#SBATCH --time=00:30:00\n"), "#SBATCH --output=" + dir + "/fm-%j.out\n",
        std::string("#SBATCH --partition=batch\n"), std::string("#SBATCH --account=proj1\n"),
        std::string("#SBATCH --mem=8G\n"), std::string("export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-3}\n"),
        std::string("srun --mpi=pmix --cpus-per-task=3 --kill-on-bad-exit=1 /opt/tessera/bin/tessera train"),
        "--plan " + kSource + "/plans/fashion_4ranks.yaml", "--metrics-dir '" + dir + "/my runs/'\"${SLURM_JOB_ID}\"",
        std::string("--threads 3"), std::string("--steps 20 --lr 0.05 --note 'it'\\''s' &\n")})
    EXPECT_NE(text.find(line), std::string::npos) << "missing: " << line << "\nin:\n" << text;
  EXPECT_EQ(text.find("--gpus-per-task"), std::string::npos);
  EXPECT_EQ(text.find("--machine"), std::string::npos);
  // --plan auto: the job plans at start-up on the machine file.
  spec.plan = "auto";
  spec.machine = kSource + "/machines/summit_class.yaml";
  const std::string planned = render_job_script(resolve_job(spec, s.dir.string()), "/opt/tessera/bin/tessera", "tessera job ...");
  EXPECT_NE(planned.find("--plan auto"), std::string::npos) << planned;
  EXPECT_NE(planned.find("--machine " + kSource + "/machines/summit_class.yaml"), std::string::npos) << planned;
  // Every #SBATCH line comes before the first command.
  EXPECT_LT(text.rfind("#SBATCH"), text.find("set -euo pipefail"));
}

TEST(JobScript, ReplicaGroupsRunUnderTheLauncher) {
  Scratch s;
  JobSpec spec = good_spec(s);
  spec.nodes = 2;
  spec.tasks_per_node = 2;
  spec.replica_groups = 2;
  spec.min_groups = 1;
  spec.plan = kSource + "/plans/fashion_2ranks.yaml";
  EXPECT_EQ(refusal(spec), "");
  const std::string text = render_job_script(resolve_job(spec, s.dir.string()), "/opt/tessera/bin/tessera", "");
  for (const std::string& line :
       {std::string("/opt/tessera/bin/tessera launch --launcher srun --launcher-args '--mpi=pmix --cpus-per-task=1' "
                    "--groups 2 --ranks-per-group 2 --min-groups 1 --store ") + s.dir.string() +
            "/tessera-store-\"${SLURM_JOB_ID}\" -- \\\n",
        std::string("--resume auto")})
    EXPECT_NE(text.find(line), std::string::npos) << "missing: " << line << "\nin:\n" << text;
  EXPECT_EQ(text.find("srun --mpi"), std::string::npos) << text;

  auto with = [&](auto change) {
    JobSpec changed = spec;
    change(changed);
    return refusal(changed);
  };
  EXPECT_NE(with([](JobSpec& j) { j.replica_groups = 3; }).find("--replica-groups 3 does not divide the job's 4 ranks"),
            std::string::npos);
  EXPECT_NE(with([](JobSpec& j) { j.min_groups = 3; }).find("--min-groups 3 must be between 1 and the 2 groups"),
            std::string::npos);
  EXPECT_NE(with([](JobSpec& j) { j.plan = kSource + "/plans/fashion_4ranks.yaml"; })
                .find("each of the 2 replica groups has 2 ranks"),
            std::string::npos);
  EXPECT_NE(with([](JobSpec& j) { j.plan = "auto"; }).find("--plan auto is not built for it"), std::string::npos);
}

TEST(JobScript, DefaultMetricsFolderIsInTheWorkdir) {
  Scratch s;
  JobSpec spec = good_spec(s);
  spec.train_args = {"--threads", "1"};
  const ResolvedJob job = resolve_job(spec, "/");
  const std::string text = render_job_script(job, "/x/tessera", "");
  EXPECT_NE(text.find("--metrics-dir " + s.dir.string() + "/runs/tessera-\"${SLURM_JOB_ID}\""), std::string::npos)
      << text;
  // --threads given after `--` replaces the job's own.
  EXPECT_EQ(text.find("--threads 1 \\"), std::string::npos) << text;
  EXPECT_NE(text.find("--threads 1 &\n"), std::string::npos) << text;
}

/// The lines of `text` (without their line breaks).
std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::size_t start = 0;
  while (start < text.size()) {
    const auto end = text.find('\n', start);
    lines.push_back(text.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return lines;
}

std::size_t line_index(const std::vector<std::string>& lines, const std::string& line) {
  for (std::size_t i = 0; i < lines.size(); ++i)
    if (lines[i] == line) return i;
  ADD_FAILURE() << "no line '" << line << "'";
  return lines.size();
}

TEST(JobScript, SignalsCheckpointsAndRequeue) {
  Scratch s;
  JobSpec spec = good_spec(s);
  spec.job_name = "fm";
  const std::string dir = s.dir.string();
  {
    // Defaults: SIGUSR1 120 s before the time limit, requeue, checkpoints per job name.
    const std::string text = render_job_script(resolve_job(spec, "/"), "/x/tessera", "");
    const auto lines = lines_of(text);
    for (const std::string& line :
         std::vector<std::string>{"#SBATCH --signal=B:USR1@120", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                                  "  --resume auto \\", "  --checkpoint-dir " + dir + "/checkpoints/fm \\",
                                  "srun_pid=$!", "  scontrol requeue \"$SLURM_JOB_ID\" || exit 75", "exit \"$status\""})
      EXPECT_LT(line_index(lines, line), lines.size()) << text;
    // srun runs in the background, after the trap that passes SIGUSR1 on to it is set.
    const auto trap = std::find_if(lines.begin(), lines.end(), [](auto& l) { return l.rfind("trap '", 0) == 0; });
    ASSERT_NE(trap, lines.end()) << text;
    EXPECT_NE(trap->find("kill -USR1 \"$srun_pid\""), std::string::npos) << *trap;
    EXPECT_EQ(trap->substr(trap->size() - 5), " USR1");
    const auto srun = std::find_if(lines.begin(), lines.end(), [](auto& l) { return l.rfind("srun ", 0) == 0; });
    ASSERT_NE(srun, lines.end());
    EXPECT_LT(trap, srun);
    EXPECT_LT(line_index(lines, "  --threads 1 &"), line_index(lines, "srun_pid=$!"));
    // wait is repeated while srun lives (a trapped signal ends `wait` early), then 75 requeues.
    const auto wait = line_index(lines, "  wait \"$srun_pid\" || status=$?");
    EXPECT_EQ(lines.at(wait + 1), "  kill -0 \"$srun_pid\" 2>/dev/null || break");
    const auto check = line_index(lines, "if [ \"$status\" -eq 75 ]; then");
    EXPECT_LT(wait, check);
    EXPECT_EQ(lines.at(check + 3), "  exit 0");
    EXPECT_LT(text.rfind("#SBATCH"), text.find("set -euo pipefail"));
    EXPECT_EQ(text.find("--checkpoint-every"), std::string::npos) << text;
  }
  {
    // Explicit checkpoint folder (relative to the current folder, %j allowed), no signal, no requeue.
    JobSpec changed = spec;
    changed.checkpoint_dir = "ckpt/%j";
    changed.checkpoint_every = 100;
    changed.signal_seconds = 0;
    changed.requeue = false;
    const std::string text = render_job_script(resolve_job(changed, dir), "/x/tessera", "");
    const auto lines = lines_of(text);
    EXPECT_LT(line_index(lines, "  --checkpoint-dir " + dir + "/ckpt/\"${SLURM_JOB_ID}\" \\"), lines.size());
    EXPECT_LT(line_index(lines, "  --checkpoint-every 100 \\"), lines.size());
    EXPECT_LT(line_index(lines, "  --resume auto \\"), lines.size());
    for (const char* absent : {"--signal=", "--requeue", "--open-mode", "scontrol"})
      EXPECT_EQ(text.find(absent), std::string::npos) << absent << " in\n" << text;
    // Stopped on a signal (e.g. scancel --signal=USR1 --batch) without requeue: the job ends with 75.
    EXPECT_NE(text.find("trap '"), std::string::npos);
    EXPECT_LT(line_index(lines, "exit \"$status\""), lines.size());
  }
  {
    // --no-checkpoints: no checkpoint folder, no resume, no signal line, no requeue.
    JobSpec changed = spec;
    changed.checkpoints = false;
    const std::string text = render_job_script(resolve_job(changed, dir), "/x/tessera", "");
    for (const char* absent : {"--checkpoint-dir", "--resume", "--signal=", "--requeue", "--open-mode", "scontrol"})
      EXPECT_EQ(text.find(absent), std::string::npos) << absent << " in\n" << text;
    changed.checkpoint_every = 10;
    EXPECT_NE(refusal(changed).find("--no-checkpoints conflicts"), std::string::npos);
  }
  auto refusal_of = [&](auto change) {
    JobSpec changed = spec;
    change(changed);
    return refusal(changed);
  };
  EXPECT_NE(refusal_of([](JobSpec& j) { j.signal_seconds = -1; }).find("--signal-seconds must be 0"),
            std::string::npos);
  EXPECT_NE(refusal_of([](JobSpec& j) {
              j.time = "00:02:00";
              j.signal_seconds = 120;
            }).find("is not less than the time limit"),
            std::string::npos);
  EXPECT_EQ(refusal_of([](JobSpec& j) {
              j.time = "00:02:01";
              j.signal_seconds = 120;
            }),
            "");
  EXPECT_NE(refusal_of([](JobSpec& j) { j.checkpoint_every = -5; }).find("--checkpoint-every must be"),
            std::string::npos);
  for (const char* own : {"--checkpoint-dir", "--checkpoint-every", "--resume"})
    EXPECT_NE(refusal_of([&](JobSpec& j) {
                j.train_args = {own, "x"};
              }).find("give " + std::string(own)),
              std::string::npos)
        << own;
}

}  // namespace
}  // namespace tessera
