#!/usr/bin/python3
"""`tessera job` against a real (local) Slurm: the instance tests/slurm/local_slurm.sh started.

  job_test.py train   --env E --tessera BIN --workdir W --name N --ranks R -- job options...
  job_test.py refused --env E --tessera BIN --workdir W --name N --message M -- job options...
  job_test.py failure --env E --tessera BIN --workdir W --name N --message M --within S -- job options...

`train`: submits with `tessera job --submit`, waits (squeue, then scontrol), and checks that the job
COMPLETED with ExitCode=0:0 within --within seconds, that its output file has the training lines and that the metrics
folder has one train row per step (--steps after `--` in the job options) and "ranks": R.
`refused`: `tessera job --submit` must exit 2 with the message, write no script and create no job.
`failure`: the job must end FAILED with a non-zero exit code and the message in its output, having run
at most S s (StartTime to EndTime; queueing behind other tests' jobs is not counted).
`--path-without-sbatch` (refused): runs `tessera job` with a PATH on which there is no sbatch.
Each prints what it checked; any failed check exits 1.
"""
import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"}


def fail(message):
    print(f"FAIL: {message}", flush=True)
    sys.exit(1)


def slurm_env(path):
    """The environment with the instance's SLURM_CONF (lines `export NAME=VALUE`)."""
    if not os.path.exists(path):
        fail(f"{path} does not exist: the slurm.start fixture did not run or failed")
    env = dict(os.environ)
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("export "):
                line = line[len("export "):]
            if "=" in line:
                name, value = line.split("=", 1)
                env[name] = value
    env["PATH"] = env.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"
    return env


def run(cmd, env, timeout=60):
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def job_fields(job_id, env):
    out = run(["scontrol", "show", "job", job_id], env).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out)), out


def wait_for(job_id, env, timeout):
    """Polls squeue until the job is gone from the queue, then scontrol until its state is final."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        listed = run(["squeue", "-h", "-j", job_id, "-o", "%T"], env)
        state = listed.stdout.strip()
        if listed.returncode == 0 and (not state or state in TERMINAL):
            break
        time.sleep(0.5)
    else:
        fail(f"job {job_id} still in the queue after {timeout} s")
    while time.monotonic() - start < timeout:
        fields, text = job_fields(job_id, env)
        if fields.get("JobState") in TERMINAL:
            return fields, text, time.monotonic() - start
        time.sleep(0.5)
    fail(f"job {job_id} has no final state after {timeout} s")


def submit(args, env, extra):
    os.makedirs(args.workdir, exist_ok=True)
    script = os.path.join(args.workdir, f"{args.name}.sbatch")
    cmd = [args.tessera, "job", "--job-name", args.name, "--workdir", args.workdir, "--output", script,
           "--submit"] + extra
    print("$", " ".join(cmd), flush=True)
    done = run(cmd, env, timeout=120)
    print(done.stdout + done.stderr, flush=True)
    return done, script


def job_options(extra):
    """Splits `job options -- train options`."""
    if "--" in extra:
        i = extra.index("--")
        return extra[:i], extra[i + 1:]
    return extra, []


def train_steps(train_args):
    for i, a in enumerate(train_args):
        if a == "--steps" and i + 1 < len(train_args):
            return int(train_args[i + 1])
    fail("the train test needs --steps N after '--'")


def submitted_id(done, script):
    if done.returncode != 0:
        fail(f"tessera job --submit exited {done.returncode}")
    lines = done.stdout.strip().splitlines()
    if not lines or not re.fullmatch(r"job_id=\d+", lines[-1]):
        fail(f"the last line of the output is not job_id=<id>: {lines[-1:]}")
    job_id = lines[-1].split("=", 1)[1]
    if f"submitted job {job_id}" not in done.stdout:
        fail("no 'submitted job <id>' line")
    if not os.path.isfile(script) or os.path.abspath(script) not in done.stdout:
        fail(f"the script {script} was not written or its path not printed")
    return job_id


def check_train(args, env, extra):
    _, train_args = job_options(extra)
    steps = train_steps(train_args)
    done, script = submit(args, env, extra)
    job_id = submitted_id(done, script)
    fields, text, seconds = wait_for(job_id, env, args.within)
    print(f"job {job_id}: JobState={fields.get('JobState')} ExitCode={fields.get('ExitCode')} ({seconds:.1f} s)")
    output = os.path.join(args.workdir, f"{args.name}-{job_id}.out")
    log = open(output).read() if os.path.exists(output) else ""
    if fields.get("JobState") != "COMPLETED" or fields.get("ExitCode") != "0:0":
        print(text, "\n--- job output ---\n", log)
        fail(f"job {job_id} did not complete cleanly")
    if fields.get("NumTasks") not in (None, str(args.ranks)):
        fail(f"scontrol says NumTasks={fields.get('NumTasks')}, expected {args.ranks}")
    for needed in [f"on {args.ranks} ranks", f"step {steps}/{steps}", f"trained {steps} steps"]:
        if needed not in log:
            print(log)
            fail(f"the job output {output} lacks '{needed}'")
    metrics = os.path.join(args.workdir, "runs", f"{args.name}-{job_id}")
    rows = [json.loads(line) for line in open(os.path.join(metrics, "metrics.jsonl")) if line.strip()]
    train_rows = [r for r in rows if r.get("kind") == "train"]
    if len(train_rows) != steps:
        fail(f"{metrics}/metrics.jsonl has {len(train_rows)} train rows, expected {steps}")
    if "--sync" in train_args and not train_rows[-1].get("syncs"):
        fail(f"{metrics}/metrics.jsonl: --sync was passed on, but the last row counts no syncs across groups")
    summary = json.load(open(os.path.join(metrics, "summary.json")))
    if summary.get("ranks") != args.ranks or summary.get("steps") != steps:
        fail(f"summary.json says ranks {summary.get('ranks')}, steps {summary.get('steps')}; "
             f"expected {args.ranks}, {steps}")
    print(f"OK: job {job_id} completed on {args.ranks} ranks, {steps} train rows, summary.json ranks {args.ranks}")


def path_without_sbatch(env):
    """A PATH with nothing but ssh on it (Open MPI's singleton start looks for its launch agent)."""
    folder = tempfile.mkdtemp(prefix="tessera-nosbatch-")
    for tool in ("ssh", "rsh"):
        found = shutil.which(tool, path=env.get("PATH"))
        if found:
            os.symlink(found, os.path.join(folder, tool))
    return folder


def check_refused(args, env, extra):
    if args.path_without_sbatch:
        env = dict(env, PATH=path_without_sbatch(env))
    slurm = slurm_env(args.env)
    before = run(["squeue", "-h", "-t", "all", "-o", "%i"], slurm).stdout.split()
    done, script = submit(args, env, extra)
    if done.returncode != 2:
        fail(f"expected exit status 2, got {done.returncode}")
    if args.message not in done.stderr:
        fail(f"the message does not contain '{args.message}'")
    if done.stderr.count(args.message) != 1:
        fail("the message is printed more than once")
    if os.path.exists(script):
        fail(f"a script was written: {script}")
    if "job_id=" in done.stdout:
        fail("a job id was printed")
    named = run(["squeue", "-h", "-t", "all", "-n", args.name, "-o", "%i"], slurm).stdout.split()
    if named:
        fail(f"a job named {args.name} exists: {named}")
    after = run(["squeue", "-h", "-t", "all", "-o", "%i"], slurm).stdout.split()
    mine = [j for j in after if j not in before and job_fields(j, slurm)[0].get("JobName") == args.name]
    if mine:
        fail(f"jobs were created: {mine}")
    print(f"OK: refused with exit 2 and '{args.message}'; no script, no job")


def run_seconds(fields):
    """StartTime to EndTime of a finished job."""
    try:
        start, end = (datetime.datetime.fromisoformat(fields[k]) for k in ("StartTime", "EndTime"))
    except (KeyError, ValueError):
        fail(f"no StartTime/EndTime in scontrol's answer: {fields}")
    return (end - start).total_seconds()


def check_failure(args, env, extra):
    done, script = submit(args, env, extra)
    job_id = submitted_id(done, script)
    fields, text, seconds = wait_for(job_id, env, args.within + 240)
    ran = run_seconds(fields)
    print(f"job {job_id}: JobState={fields.get('JobState')} ExitCode={fields.get('ExitCode')} "
          f"(ran {ran:.0f} s; {seconds:.1f} s from submission)")
    if ran > args.within:
        fail(f"the failing job ran {ran:.0f} s, more than {args.within:.0f} s: did the other ranks hang?")
    output = os.path.join(args.workdir, f"{args.name}-{job_id}.out")
    log = open(output).read() if os.path.exists(output) else ""
    if fields.get("JobState") != "FAILED":
        print(text, "\n--- job output ---\n", log)
        fail(f"expected JobState=FAILED, got {fields.get('JobState')}")
    if fields.get("ExitCode", "0:0") == "0:0":
        fail("expected a non-zero ExitCode")
    if args.message not in log:
        print(log)
        fail(f"the job output {output} lacks '{args.message}'")
    print(f"OK: job {job_id} FAILED with ExitCode={fields['ExitCode']} after {ran:.0f} s; output has the message")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "refused", "failure"])
    parser.add_argument("--env", required=True)
    parser.add_argument("--tessera", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--ranks", type=int, default=0)
    parser.add_argument("--message", default="")
    parser.add_argument("--path-without-sbatch", action="store_true")
    parser.add_argument("--within", type=float, default=240, help="seconds the job may take, queueing included")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    extra = argv[split + 1:]
    env = slurm_env(args.env)
    # A clean working folder per test: old outputs must not satisfy the checks.
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    {"train": check_train, "refused": check_refused, "failure": check_failure}[args.mode](args, env, extra)


if __name__ == "__main__":
    main()
