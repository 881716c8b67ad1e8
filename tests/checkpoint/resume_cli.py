#!/usr/bin/env python3
"""Checkpoint/restart through the `tessera` command.

--case resume:  a 20-step run checkpointing every 5 steps, then `--resume auto --steps 30`, gives
                at steps 20..29 the same losses (bit for bit) as an uninterrupted 30-step run on
                the same ranks; the metrics files hold every step once.
--case sigkill: a 4-rank run checkpointing every 5 steps has one rank killed with SIGKILL after
                its second checkpoint; mpirun must end non-zero within 30 s, and `--resume auto`
                continues from the newest checkpoint.
--case across-plans: the checkpoint of a 4-rank sample x spatial plan (--plans-dir
                fashion_spatial_np4.yaml), resumed for 6 steps on 1 rank, on 2 ranks by sample only
                and on 3 ranks with filter and channel splits (fashion_model_np3.yaml): every rank
                reads its own blocks of the global tensors, and the losses after the resume equal
                the 1-rank resume's within rounding (1e-4 relative: sums over other splits).
"""
import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--case", choices=["resume", "sigkill", "across-plans"], required=True)
parser.add_argument("--plans-dir", help="across-plans: the folder of fashion_spatial_np4.yaml and fashion_model_np3.yaml")
parser.add_argument("--tessera", required=True)
parser.add_argument("--mpirun", required=True)
parser.add_argument("--model", required=True)
parser.add_argument("--data", required=True)
parser.add_argument("--work", required=True)
args = parser.parse_args()

shutil.rmtree(args.work, ignore_errors=True)
os.makedirs(args.work)
problems = []


def command(ranks, *extra):
    return (shlex.split(args.mpirun) + ["-n", str(ranks), args.tessera, "train", "--model", args.model, "--data",
                                        args.data, "--batch", "64", "--lr", "0.05", "--momentum", "0.9", "--seed", "3",
                                        "--progress-every", "5"] + [str(e) for e in extra])


def run(ranks, *extra, timeout=240):
    cmd = command(ranks, *extra)
    print("$", " ".join(cmd), flush=True)
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    output = result.stdout.decode(errors="replace")
    print(output, flush=True)
    if result.returncode != 0:
        sys.exit(f"FAIL: exit code {result.returncode}")
    return output


def train_rows(metrics_dir):
    rows = [json.loads(line) for line in open(os.path.join(metrics_dir, "metrics.jsonl"))]
    return [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]


def latest_step(ckpt):
    try:
        with open(os.path.join(ckpt, "latest")) as f:
            name = f.read().strip()
        return int(name[len("ckpt-"):-len(".h5")])
    except (OSError, ValueError):
        return -1


ckpt = os.path.join(args.work, "ckpt")
if args.case == "resume":
    full, resumed = os.path.join(args.work, "full"), os.path.join(args.work, "resumed")
    run(2, "--steps", 30, "--metrics-dir", full)
    out = run(2, "--steps", 20, "--checkpoint-dir", ckpt, "--checkpoint-every", 5, "--resume", "auto",
              "--metrics-dir", resumed)
    if "starting from scratch" not in out:
        problems.append("--resume auto without a checkpoint did not say it starts from scratch")
    if sorted(os.listdir(ckpt)) != ["ckpt-00000010.h5", "ckpt-00000015.h5", "ckpt-00000020.h5", "latest"]:
        problems.append(f"checkpoint folder holds {sorted(os.listdir(ckpt))}")
    out = run(2, "--steps", 30, "--checkpoint-dir", ckpt, "--checkpoint-every", 5, "--resume", "auto",
              "--metrics-dir", resumed)
    if "at step 20" not in out:
        problems.append("the second run did not resume at step 20")
    a, b = train_rows(full), train_rows(resumed)
    if [s for s, _ in b] != list(range(30)):
        problems.append(f"resumed metrics hold steps {[s for s, _ in b]}, expected 0..29 once each")
    for (sa, la), (sb, lb) in zip(a, b):
        if sa >= 20 and (sa != sb or la != lb):
            problems.append(f"step {sa}: loss {lb} after resume, {la} uninterrupted")
    print(f"compared the losses of steps 20..29: {sum(1 for s, _ in a if s >= 20)} steps")
elif args.case == "across-plans":
    run(4, "--plan", os.path.join(args.plans_dir, "fashion_spatial_np4.yaml"), "--steps", 10, "--checkpoint-dir", ckpt,
        "--checkpoint-every", 10, "--metrics-dir", os.path.join(args.work, "first"))
    saved = os.path.join(ckpt, "ckpt-00000010.h5")
    resumed = {}
    for name, ranks, plan in (("1 rank", 1, None), ("2 ranks by sample", 2, None),
                              ("3 ranks by filter and channel", 3, "fashion_model_np3.yaml")):
        folder = os.path.join(args.work, name.replace(" ", "_"))
        extra = ["--plan", os.path.join(args.plans_dir, plan)] if plan else []
        out = run(ranks, *extra, "--steps", 16, "--resume", saved, "--checkpoint-dir", os.path.join(folder, "ckpt"),
                  "--metrics-dir", folder)
        if "at step 10" not in out:
            problems.append(f"{name}: did not resume at step 10")
        resumed[name] = train_rows(folder)
    reference = resumed.pop("1 rank")
    if [s for s, _ in reference] != list(range(10, 16)):
        problems.append(f"1 rank: metrics hold steps {[s for s, _ in reference]}, expected 10..15")
    for name, rows in resumed.items():
        if [s for s, _ in rows] != [s for s, _ in reference]:
            problems.append(f"{name}: metrics hold steps {[s for s, _ in rows]}")
        for (step, a), (_, b) in zip(reference, rows):
            if abs(a - b) > 1e-4 * max(abs(a), 1e-30):
                problems.append(f"{name}: step {step}: loss {b}, 1 rank {a}")
    print(f"compared steps 10..15 of {', '.join(resumed)} with the 1-rank resume")
else:
    metrics = os.path.join(args.work, "metrics")
    cmd = command(4, "--epochs", 100, "--checkpoint-dir", ckpt, "--checkpoint-every", 5, "--metrics-dir", metrics)
    print("$", " ".join(cmd), flush=True)
    log = open(os.path.join(args.work, "killed.log"), "wb")
    job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 180
    while latest_step(ckpt) < 10 and time.time() < deadline and job.poll() is None:
        time.sleep(0.05)
    if latest_step(ckpt) < 10:
        job.kill()
        sys.exit(f"FAIL: no second checkpoint within 180 s (exit {job.poll()}); see {log.name}")
    ranks = subprocess.run(["pgrep", "-P", str(job.pid)], stdout=subprocess.PIPE).stdout.split()
    if len(ranks) != 4:
        job.kill()
        sys.exit(f"FAIL: expected 4 rank processes under mpirun, found {ranks}")
    victim = int(ranks[-1])
    killed_after = latest_step(ckpt)
    print(f"checkpoint at step {killed_after} exists; kill -9 {victim}", flush=True)
    os.kill(victim, signal.SIGKILL)
    start = time.time()
    try:
        code = job.wait(timeout=30)
    except subprocess.TimeoutExpired:
        job.kill()
        sys.exit("FAIL: mpirun did not end within 30 s of a rank's SIGKILL")
    print(f"mpirun ended with exit code {code} {time.time() - start:.1f} s after the kill")
    if code == 0:
        problems.append("mpirun exited 0 after a rank was killed")
    newest = latest_step(ckpt)
    if newest < killed_after:
        problems.append(f"latest went back from {killed_after} to {newest}")
    rows_before = train_rows(metrics)
    out = run(4, "--steps", newest + 3, "--checkpoint-dir", ckpt, "--checkpoint-every", 5, "--resume", "auto",
              "--metrics-dir", metrics)
    if f"at step {newest}" not in out:
        problems.append(f"the resumed run did not continue from step {newest}")
    reached = max(s for s, _ in rows_before) if rows_before else -1
    print(f"killed run had logged up to step {reached}; resumed from {newest}")
    rows = train_rows(metrics)
    if [s for s, _ in rows] != list(range(newest + 3)):
        problems.append(f"metrics after the resume hold steps {[s for s, _ in rows]}")

if problems:
    sys.exit("FAIL: " + "; ".join(problems))
print("OK")
