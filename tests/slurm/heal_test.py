#!/usr/bin/python3
"""Fault-tolerant replica groups under a real (local) Slurm: a killed job step is restarted and healed.

  heal_test.py --env E --tessera BIN --workdir W --model M --data D [--within S]

Submits `tessera job --replica-groups 2` (2 groups x 1 rank, each its own job step under `tessera
launch --launcher srun`), waits until group 0 has trained some steps, kills group 1's job step with
`scancel --signal=KILL JOBID.STEP`, and checks: the job ends COMPLETED with ExitCode 0:0 within S
seconds; its output says that group 1 failed and was restarted, and that group 1 was healed from
group 0; both groups' final checkpoints hold the same parameters and optimizer state bit for bit;
the store folder is gone.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from job_test import fail, run, slurm_env, wait_for  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--env", required=True)
parser.add_argument("--tessera", required=True)
parser.add_argument("--workdir", required=True)
parser.add_argument("--model", required=True)
parser.add_argument("--data", required=True)
parser.add_argument("--within", type=float, default=240)
parser.add_argument("--steps", type=int, default=1200)
args = parser.parse_args()

env = slurm_env(args.env)
# A fresh folder: an earlier run's final checkpoints would make the job resume with nothing to train.
shutil.rmtree(args.workdir, ignore_errors=True)
os.makedirs(args.workdir)
name = "tessera-heal"


def queue():
    """Every job and job step the instance holds, one per line."""
    return run(["squeue", "-h", "-a", "-s", "-o", "%i %j %T %M"], env).stdout.strip() + "\n" + \
        run(["squeue", "-h", "-a", "-t", "all", "-o", "%i %j %T %R"], env).stdout.strip()


# The two groups' job steps must run at once: wait until other tests' jobs have left the node.
waited = time.monotonic()
while run(["squeue", "-h", "-a", "-o", "%i"], env).stdout.strip():
    if time.monotonic() - waited > 120:
        fail(f"other jobs still hold the instance after 120 s:\n{queue()}")
    time.sleep(0.5)
submit = run([args.tessera, "job", "--submit", "--workdir", args.workdir, "--job-name", name, "--nodes", "1",
              "--tasks-per-node", "2", "--replica-groups", "2", "--time", "00:05:00", "--output",
              f"{args.workdir}/{name}.sbatch", "--model", args.model, "--data", args.data, "--",
              "--steps", str(args.steps), "--batch", "48", "--optimizer", "adam", "--lr", "0.001",
              "--progress-every", "100", "--join-window", "1"], env, timeout=120)
if submit.returncode != 0:
    fail(f"tessera job --submit exited {submit.returncode}: {submit.stdout}{submit.stderr}")
found = re.search(r"\b(\d+)\b\s*$", submit.stdout.strip())
if not found:
    fail(f"no job id in: {submit.stdout}")
job = found.group(1)
print(f"submitted job {job}", flush=True)
metrics = f"{args.workdir}/runs/{name}-{job}/group0/metrics.jsonl"

start = time.monotonic()
step_id = None
while time.monotonic() - start < args.within and step_id is None:
    trained = 0
    if os.path.exists(metrics):
        with open(metrics) as f:
            trained = sum(1 for line in f if '"kind":"train"' in line)
    if trained >= 200:
        steps = run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], env).stdout.split("\n")
        step_id = next((line.split()[0] for line in steps if line.endswith(" group1")), None)
    time.sleep(0.2)
if step_id is None:
    fail(f"job {job}: group 0 did not train 200 steps with group 1's step running within {args.within} s; "
         f"the instance holds:\n{queue()}")
print(f"scancel --signal=KILL {step_id} (group 1's job step)", flush=True)
killed = run(["scancel", "--signal=KILL", step_id], env)
if killed.returncode != 0:
    fail(f"scancel exited {killed.returncode}: {killed.stderr}")

fields, text, _ = wait_for(job, env, args.within)
output_path = fields.get("StdOut", f"{args.workdir}/{name}-{job}.out")
output = open(output_path).read() if os.path.exists(output_path) else ""
problems = []
if fields.get("JobState") != "COMPLETED" or fields.get("ExitCode") != "0:0":
    problems.append(f"job {job} ended {fields.get('JobState')} with ExitCode {fields.get('ExitCode')}")
if not re.search(r"group 1 failed .* restarting it", output):
    problems.append("the output does not say that group 1 failed and was restarted")
if "group 1: healed from group 0" not in output:
    problems.append("the output does not say that group 1 was healed from group 0")
finals = [f"{args.workdir}/checkpoints/{name}/group{g}/ckpt-{args.steps:08d}.h5" for g in (0, 1)]
if all(os.path.exists(p) for p in finals):
    states = []
    for path in finals:
        with h5py.File(path, "r") as f:
            entries = {}
            f.visititems(lambda n, item: entries.__setitem__(n, item[()])
                         if isinstance(item, h5py.Dataset) and n.split("/")[0] in ("param", "optimizer") else None)
            states.append(entries)
    differ = [k for k in states[0] if not np.array_equal(states[0][k], states[1].get(k))]
    if differ or len(states[0]) < 4:
        problems.append(f"the groups' final states differ in {differ[:4]}")
    else:
        print(f"both groups' final parameters and optimizer state are equal bit for bit ({len(states[0])} entries)")
else:
    problems.append(f"missing final checkpoints: {[p for p in finals if not os.path.exists(p)]}")
if os.path.exists(f"{args.workdir}/tessera-store-{job}"):
    problems.append("the store folder was left behind")
if problems:
    print(output[-4000:])
    for p in problems:
        print(f"FAIL: {p}")
    sys.exit(1)
print(f"job {job}: COMPLETED 0:0; group 1's killed step was restarted and healed")
