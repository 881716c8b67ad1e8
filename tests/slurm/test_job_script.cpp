// `tessera job`'s script writer without Slurm: quoting, time limits, what is refused, what the
// script says. (The same script against a real Slurm: job_test.py.)
#include <gtest/gtest.h>
#include <unistd.h>

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
  EXPECT_NE(with([](JobSpec& j) { j.plan = "auto"; }).find("planner"), std::string::npos);
  const std::string mismatch = with([](JobSpec& j) {
    j.tasks_per_node = 2;
    j.plan = kSource + "/plans/fashion_4ranks.yaml";
  });
  EXPECT_NE(mismatch.find("is for 4 ranks, but the job has 2 ranks"), std::string::npos) << mismatch;
  EXPECT_NE(with([&](JobSpec& j) { j.workdir = (s.dir / "nope").string(); }).find("is not an existing folder"),
            std::string::npos);
  // The GPU request is fine where the GPU path is built.
  JobSpec gpu = spec;
  gpu.gpus_per_task = 1;
  EXPECT_NO_THROW(check_job_request(gpu, true));
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
        std::string("--threads 3"), std::string("--steps 20 --lr 0.05 --note 'it'\\''s'\n")})
    EXPECT_NE(text.find(line), std::string::npos) << "missing: " << line << "\nin:\n" << text;
  EXPECT_EQ(text.find("--gpus-per-task"), std::string::npos);
  // Every #SBATCH line comes before the first command.
  EXPECT_LT(text.rfind("#SBATCH"), text.find("set -euo pipefail"));
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
  EXPECT_NE(text.find("--threads 1\n"), std::string::npos) << text;
}

}  // namespace
}  // namespace tessera
