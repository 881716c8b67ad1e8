#!/usr/bin/python3
"""Signal, checkpoint, requeue and resume under a real (local) Slurm.

  requeue_test.py --env E --tessera BIN --workdir W --name N --signal-after K --within S \\
      -- job options... -- train options (with --steps)

Submits two identical jobs with `tessera job --submit` (job names N-ref and N, so each has its
own checkpoint folder <W>/checkpoints/<name>):

- N-ref runs uninterrupted: COMPLETED, ExitCode 0:0, Restarts 0.
- N is sent `scancel --signal=USR1 --batch ID` (what `#SBATCH --signal=B:USR1@...` does before the
  time limit) once its output shows step K. Its batch script passes the signal to srun, srun to
  the ranks; they must write a checkpoint at one step and exit 75; the script must requeue the
  job (`scontrol requeue`); the requeued run must resume from the checkpoint (`--resume auto`) and
  finish: COMPLETED, ExitCode 0:0, Restarts 1. Its output file (#SBATCH --open-mode=append) holds
  both runs. Its metrics hold every step once, and every step's loss and the final loss equal
  N-ref's within 1e-6 relative (bit-identical is expected, and reported).

A requeued job may start only after the credential lifetime (cred_expire, 20 s on the test
instance: tests/slurm/local_slurm.sh) and the scheduler's next pass; nothing here shortens that.
Prints what it checked; any failed check exits 1.
"""
import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from job_test import TERMINAL, fail, job_fields, job_options, run, slurm_env, submitted_id  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from checks import check, exit_if_failed  # noqa: E402

TOLERANCE = 1e-6


def submit(args, env, name, extra):
    script = os.path.join(args.workdir, f"{name}.sbatch")
    cmd = [args.tessera, "job", "--job-name", name, "--workdir", args.workdir, "--output", script, "--submit"] + extra
    print("$", " ".join(cmd), flush=True)
    done = run(cmd, env, timeout=120)
    print(done.stdout + done.stderr, flush=True)
    return submitted_id(done, script), script


def read(path):
    return open(path).read() if os.path.exists(path) else ""


def wait_final(job_id, env, timeout, restarts):
    """Polls scontrol until the job is in a final state with at least `restarts` restarts (a requeued
    job goes back to PENDING with Restarts=1: that is not the end)."""
    start = time.monotonic()
    last = None
    while time.monotonic() - start < timeout:
        fields, text = job_fields(job_id, env)
        state = (fields.get("JobState"), fields.get("Restarts"), fields.get("Reason"))
        if state != last:
            print(f"  {time.monotonic() - start:6.1f} s: job {job_id} JobState={state[0]} Restarts={state[1]} "
                  f"Reason={state[2]} EligibleTime={fields.get('EligibleTime')}", flush=True)
            last = state
        if fields.get("JobState") in TERMINAL and int(fields.get("Restarts", "0")) >= restarts:
            return fields, text
        if fields.get("JobState") in TERMINAL and fields.get("JobState") != "COMPLETED":
            return fields, text  # failed or cancelled: no point waiting for a requeue
        time.sleep(0.5)
    fail(f"job {job_id} not finished (with {restarts} restart(s)) after {timeout} s")


def train_losses(metrics):
    rows = [json.loads(line) for line in open(os.path.join(metrics, "metrics.jsonl")) if line.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    summary = json.load(open(os.path.join(metrics, "summary.json")))
    return [r["step"] for r in train], [r["loss"] for r in train], summary


def close(a, b):
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b), 1e-30)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--env", required=True)
    parser.add_argument("--tessera", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--signal-after", type=int, default=10)
    parser.add_argument("--within", type=float, default=420, help="seconds for everything, queueing included")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    extra = argv[split + 1:]
    env = slurm_env(args.env)
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    _, train_args = job_options(extra)
    steps = int(train_args[train_args.index("--steps") + 1])
    start = time.monotonic()

    ref_name, name = f"{args.name}-ref", args.name
    ref_id, _ = submit(args, env, ref_name, extra)
    job_id, script = submit(args, env, name, extra)
    text = read(script)
    for line in ["#SBATCH --requeue", "#SBATCH --open-mode=append", "--resume auto",
                 f"--checkpoint-dir {args.workdir}/checkpoints/{name}"]:
        check(line in text, f"the script {script} lacks '{line}'")

    # Signal the batch shell once the output shows some steps done.
    output = os.path.join(args.workdir, f"{name}-{job_id}.out")
    marker = f"step {args.signal_after}/{steps} "
    while marker not in read(output):
        fields, _ = job_fields(job_id, env)
        if fields.get("JobState") in TERMINAL:
            print(read(output))
            fail(f"job {job_id} ended ({fields.get('JobState')}) before it showed '{marker}'")
        if time.monotonic() - start > args.within:
            fail(f"job {job_id} did not show '{marker}' within {args.within} s")
        time.sleep(0.2)
    signalled = datetime.datetime.now()
    done = run(["scancel", "--signal=USR1", "--batch", job_id], env)
    print(f"$ scancel --signal=USR1 --batch {job_id}: exit {done.returncode} {done.stderr.strip()}", flush=True)
    check(done.returncode == 0, "scancel --signal=USR1 --batch failed")

    remaining = args.within - (time.monotonic() - start)
    fields, text = wait_final(job_id, env, remaining, restarts=1)
    log = read(output)
    print("--- job output ---\n" + log + "--- end of job output ---", flush=True)
    print(text, flush=True)
    check(fields.get("JobState") == "COMPLETED" and fields.get("ExitCode") == "0:0",
          f"job {job_id}: JobState={fields.get('JobState')} ExitCode={fields.get('ExitCode')}, expected COMPLETED 0:0")
    check(fields.get("Restarts") == "1", f"job {job_id}: Restarts={fields.get('Restarts')}, expected 1")

    # Both runs in the one output file, in order.
    runs = [int(r) for r in re.findall(rf"tessera job: job {job_id}, run (\d+),", log)]
    check(runs == [1, 2], f"the output {output} shows runs {runs}, expected [1, 2] (appended, not overwritten)")
    stops = re.findall(r"stopped at step (\d+) on a signal \(SIGUSR1\); checkpoint written to (\S+); "
                       r"resume with --resume auto", log)
    stopped_at = int(stops[0][0]) if len(stops) == 1 else -1
    if check(len(stops) == 1, f"{len(stops)} 'stopped at step K on a signal (SIGUSR1)' lines, expected 1"):
        checkpoint = stops[0][1]
        check(args.signal_after <= stopped_at < steps, f"stopped at step {stopped_at}, not in [{args.signal_after}, "
                                                       f"{steps})")
        check(os.path.dirname(checkpoint) == os.path.join(args.workdir, "checkpoints", name),
              f"the checkpoint {checkpoint} is not in {args.workdir}/checkpoints/{name}")
        check(os.path.isfile(checkpoint), f"the checkpoint {checkpoint} is gone")
    for needed in ["tessera job: SIGUSR1: the ranks checkpoint and stop",
                   f"tessera job: stopped on a signal with a checkpoint; requeueing job {job_id}",
                   f"at step {stopped_at}", f"step {steps}/{steps}"]:
        check(needed in log, f"the output lacks '{needed}'")
    resumed = re.search(r"resumed from (\S+) at step (\d+)", log)
    check(resumed is not None and int(resumed.group(2)) == stopped_at,
          f"the second run did not resume at step {stopped_at}: {resumed.group(0) if resumed else 'no resume line'}")
    check(log.find("stopped at step") < log.find("run 2,") < (resumed.start() if resumed else -1),
          "the output is not in the order: stop, second run, resume")
    print(f"job {job_id}: signalled {signalled:%H:%M:%S}, stopped at step {stopped_at} (exit 75), requeued, "
          f"eligible again {fields.get('EligibleTime')}, second run {fields.get('StartTime')} - {fields.get('EndTime')}",
          flush=True)

    # The uninterrupted job, and the comparison.
    ref_fields, ref_text = wait_final(ref_id, env, max(30, args.within - (time.monotonic() - start)), restarts=0)
    if not check(ref_fields.get("JobState") == "COMPLETED" and ref_fields.get("Restarts") == "0",
                 f"the reference job {ref_id}: JobState={ref_fields.get('JobState')} "
                 f"Restarts={ref_fields.get('Restarts')}"):
        print(ref_text, read(os.path.join(args.workdir, f"{ref_name}-{ref_id}.out")))
    else:
        ref_steps, ref_losses, ref_summary = train_losses(os.path.join(args.workdir, "runs", f"{ref_name}-{ref_id}"))
        got_steps, got_losses, summary = train_losses(os.path.join(args.workdir, "runs", f"{name}-{job_id}"))
        check(len(ref_steps) == steps, f"the reference has {len(ref_steps)} train rows, expected {steps}")
        check(got_steps == ref_steps, f"the requeued job's metrics have train rows {got_steps[:3]}...{got_steps[-3:]} "
                                      f"({len(got_steps)}), expected each of the {steps} steps once")
        differ = [(s, a, b) for s, a, b in zip(got_steps, got_losses, ref_losses) if not close(a, b)]
        check(not differ, f"losses differ from the uninterrupted job at steps {differ[:5]}")
        final, ref_final = summary.get("final_loss"), ref_summary.get("final_loss")
        check(final is not None and close(final, ref_final),
              f"final loss {final!r}, the uninterrupted job's {ref_final!r}")
        identical = final == ref_final and got_losses == ref_losses
        print(f"final loss {final!r} vs uninterrupted {ref_final!r}: "
              f"{'bit-identical' if identical else 'within 1e-6'}", flush=True)
    exit_if_failed()
    print(f"OK: job {job_id} stopped on SIGUSR1 at step {stopped_at}, was requeued, resumed and completed with the "
          f"uninterrupted job's losses ({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
