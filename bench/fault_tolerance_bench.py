#!/usr/bin/env python3
"""Kill loop: fault-tolerant replica groups against checkpoint-restart, on Fashion-MNIST.

    python3 bench/fault_tolerance_bench.py [--minutes 10] [--periods 60,20] [--groups 4]
        [--target 0.9] [--work runs/fault_tolerance_bench] [--output FILE.md]

For each kill period T, two runs of --minutes wall-clock minutes each, one after the other, with
the same model, data, global batch (64), optimizer (SGD, lr 0.05, momentum 0.9) and validation
(every 200 steps, the 10 000 test images):

  replica groups   `tessera launch --groups G` (G groups of 1 rank, Gloo between them); every T
                   seconds one group, drawn at random (seeded), gets SIGKILL; the launcher restarts
                   it and it is healed from a live group.
  checkpoint-restart  one `mpirun -n G tessera train` job (sample-parallel, bsp) checkpointing
                   every K steps and resumed with --resume auto by this driver as soon as it dies;
                   every T seconds one of its ranks, drawn at random, gets SIGKILL. K follows
                   Young's rule, sqrt(2 C T) over the step time, with the checkpoint's cost C and
                   the step time measured by a short run first.

Measured, from the metrics rows as they are written (each row is flushed; this driver reads them
every 50 ms and stamps them with its own clock):

  effective time   samples of the final history's committed steps (replica groups: contributors x
                   the per-group batch per step) / (wall time x the run's own failure-free rate,
                   taken before its first kill): the share of the wall time that was useful work.
  stall per failure  the longest pause in the job's progress (the highest step committed so far,
                   as this driver sees it, every 20 ms) from 0.1 s before a kill until 60 s after it
                   (or the next kill): for replica groups, the time the survivors went without a
                   committed step; for checkpoint-restart, until the relaunched job passed the step
                   reached before the kill. A validation (every 200 steps) also pauses progress,
                   for about 0.1 s. The median and the largest.
  time to target   from the start to the first validation at --target test accuracy or above.

Targets (issue 27): with T = 60 s, effective time >= 0.8 and >= 1.5x checkpoint-restart's; stall per
failure <= 5 s. Prints a Markdown table and writes it to --output.
"""
import argparse
import glob
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--minutes", type=float, default=10)
p.add_argument("--periods", default="60,20", help="comma-separated kill periods T in seconds")
p.add_argument("--groups", type=int, default=4)
p.add_argument("--target", type=float, default=0.9)
p.add_argument("--tessera", default=os.path.join(ROOT, "build", "bin", "tessera"))
p.add_argument("--data-dir", default=os.path.join(ROOT, "data", "fashion-mnist"),
               help="train.h5 and test.h5 (made with `tessera convert fashion-mnist` when missing)")
p.add_argument("--work", default=os.path.join(ROOT, "runs", "fault_tolerance_bench"))
p.add_argument("--output", help="also write the table here")
p.add_argument("--seed", type=int, default=7, help="seed of the victims' draw")
p.add_argument("--only", choices=["replicas", "restart"], help="run one side only (for trying the driver)")
args = p.parse_args()

BATCH = 64
if not os.path.exists(f"{args.data_dir}/train.h5"):
    subprocess.run([args.tessera, "convert", "fashion-mnist", "--output", args.data_dir], check=True)
MPI_FLAGS = ["--bind-to", "none", "--oversubscribe", "--mca", "mpi_yield_when_idle", "1", "-x", "OMP_NUM_THREADS=1"]
if os.geteuid() == 0:
    MPI_FLAGS.append("--allow-run-as-root")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def train_options(work):
    return ["--model", os.path.join(ROOT, "models", "fashion_cnn.yaml"), "--data", f"{args.data_dir}/train.h5",
            "--val-data", f"{args.data_dir}/test.h5", "--epochs", "1000", "--batch", str(BATCH),
            "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--eval-every", "200", "--eval-batch", "1000",
            "--progress-every", "1000", "--threads", "1", "--metrics-dir", f"{work}/metrics",
            "--checkpoint-dir", f"{work}/ckpt"]


class Rows:
    """Reads metrics.jsonl files under a folder as they grow; stamps each new row with the driver's clock."""

    def __init__(self, folder, start):
        self.folder, self.start = folder, start
        self.offsets, self.rows, self.stop = {}, [], False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()

    def loop(self):
        while not self.stop:
            self.poll()
            time.sleep(0.02)

    def poll(self):
        now = time.monotonic() - self.start
        for path in glob.glob(f"{self.folder}/**/metrics.jsonl", recursive=True):
            group = re.search(r"group(\d+)", path)
            group = int(group.group(1)) if group else 0
            try:
                size = os.path.getsize(path)
                offset = self.offsets.get(path, 0)
                if size < offset:
                    offset = 0  # rewritten by a resume: rows seen before keep their stamps
                with open(path) as f:
                    f.seek(offset)
                    text = f.read()
            except OSError:
                continue
            end = text.rfind("\n") + 1
            self.offsets[path] = offset + len(text[:end].encode())
            for line in text[:end].splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                row["t"], row["group"] = now, group
                with self.lock:
                    self.rows.append(row)

    def close(self):
        self.stop = True
        self.thread.join()
        self.poll()
        return self.rows


def kill_tree(process):
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def tessera_ranks(marker):
    """pids of tessera train processes whose command line holds `marker`."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0")]
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == "tessera" and "train" in argv and marker in argv:
            out.append((argv, int(pid)))
    return out


def failure_free_rate(rows, first_kill, per_step_samples):
    """Samples per second before the first kill, skipping the first 10 % of that span (start-up)."""
    train = sorted((r for r in rows if r.get("kind") == "train" and r["t"] < first_kill), key=lambda r: r["t"])
    if len(train) < 10:
        return None
    begin = train[len(train) // 10]
    steps = {r["step"] for r in train if r["t"] >= begin["t"]}
    span = train[-1]["t"] - begin["t"]
    return sum(per_step_samples(s) for s in steps) / span if span > 0 else None


def summarize(name, rows, kills, wall, per_step_samples, committed_steps):
    rate = failure_free_rate(rows, kills[0][0] if kills else wall, per_step_samples)
    useful = sum(per_step_samples(s) for s in committed_steps)
    effective = useful / (wall * rate) if rate else float("nan")
    # Progress: the times at which the highest committed step grew.
    progress, highest = [], -1
    for r in sorted((r for r in rows if r.get("kind") == "train"), key=lambda r: r["t"]):
        if r["step"] > highest:
            highest = r["step"]
            progress.append(r["t"])
    stalls = []
    for k, (t_kill, _) in enumerate(kills):
        end = min(kills[k + 1][0] if k + 1 < len(kills) else wall, t_kill + 60)
        window = [t for t in progress if t_kill - 0.1 <= t <= end]
        marks = [t_kill - 0.1] + window
        if len(marks) > 1:
            stalls.append(max(b - a for a, b in zip(marks, marks[1:])))
    reached = [r["t"] for r in rows if r.get("kind") == "validation" and r.get("accuracy") is not None
               and r["accuracy"] >= args.target]
    best = max((r["accuracy"] for r in rows if r.get("kind") == "validation" and r.get("accuracy") is not None),
               default=float("nan"))
    with open(os.path.join(args.work, f"{name.split()[0]}_{len(kills)}_{int(wall)}_rows.json"), "w") as f:
        json.dump(dict(kills=kills, wall=wall, rows=rows), f)
    return dict(name=name, effective=effective, stalls=stalls, kills=len(kills), steps=len(committed_steps),
                to_target=min(reached) if reached else None, best=best, rate=rate)


def run_replicas(period, work):
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    command = [args.tessera, "launch", "--groups", str(args.groups), "--store", f"{work}/store", "--log-dir",
               f"{work}/logs", "--launcher-args", " ".join(MPI_FLAGS), "--max-restarts", "1000", "--",
               *train_options(work)]
    start = time.monotonic()
    launcher = subprocess.Popen(command, stdout=open(f"{work}/launch.log", "w"), stderr=subprocess.STDOUT,
                                start_new_session=True, env=ENV)
    rows = Rows(f"{work}/metrics", start)
    draw = random.Random(args.seed)
    kills = []
    next_kill = period
    while time.monotonic() - start < args.minutes * 60:
        if time.monotonic() - start >= next_kill:
            victim = draw.randrange(args.groups)
            pids = [pid for argv, pid in tessera_ranks(f"{work}/store")
                    if argv[argv.index("--replica-group") + 1] == str(victim)]
            with rows.lock:
                before = max((r["step"] for r in rows.rows if r.get("kind") == "train"), default=-1)
            if pids:
                os.kill(pids[0], signal.SIGKILL)
                kills.append((time.monotonic() - start, before))
            next_kill += period
        time.sleep(0.05)
    wall = time.monotonic() - start
    kill_tree(launcher)
    for _, pid in tessera_ranks(f"{work}/store"):
        os.kill(pid, signal.SIGKILL)
    all_rows = rows.close()
    per_step = {}
    for r in all_rows:
        if r.get("kind") == "train":
            per_step[r["step"]] = r["contributors"] * (BATCH // args.groups)
    return summarize("replica groups", all_rows, kills, wall, lambda s: per_step.get(s, BATCH), sorted(per_step))


def checkpoint_interval(period, work):
    """Young's rule from a short measured run: (steps between checkpoints, checkpoint seconds, step seconds)."""
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    command = ["mpirun", "-n", str(args.groups), *MPI_FLAGS, args.tessera, "train", *train_options(work),
               "--steps", "300", "--checkpoint-every", "100"]
    out = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV).stdout
    costs = [float(c) for c in re.findall(r"written in ([\d.]+) s", out)]
    with open(f"{work}/metrics/summary.json") as f:
        step_s = json.load(f)["step_s"]
    cost = statistics.median(costs)
    steps = max(1, round(math.sqrt(2 * cost * period) / step_s))
    return steps, cost, step_s


def run_restart(period, work, every):
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    command = ["mpirun", "-n", str(args.groups), *MPI_FLAGS, args.tessera, "train", *train_options(work),
               "--checkpoint-every", str(every), "--keep-checkpoints", "2", "--resume", "auto"]
    start = time.monotonic()
    rows = Rows(f"{work}/metrics", start)
    draw = random.Random(args.seed)
    kills, launches = [], 0
    next_kill = period
    job = None
    while time.monotonic() - start < args.minutes * 60:
        if job is None or job.poll() is not None:
            if job is not None:
                job.wait()
            job = subprocess.Popen(command, stdout=open(f"{work}/job{launches}.log", "w"), stderr=subprocess.STDOUT,
                                   start_new_session=True, env=ENV)
            launches += 1
        if time.monotonic() - start >= next_kill:
            pids = [pid for argv, pid in tessera_ranks(f"{work}/metrics")]
            with rows.lock:
                before = max((r["step"] for r in rows.rows if r.get("kind") == "train"), default=-1)
            if pids:
                os.kill(draw.choice(sorted(pids)), signal.SIGKILL)
                kills.append((time.monotonic() - start, before))
            next_kill += period
        time.sleep(0.05)
    wall = time.monotonic() - start
    kill_tree(job)
    all_rows = rows.close()
    # The final history: the metrics file after the last resume holds each committed step once.
    final = set()
    with open(f"{work}/metrics/metrics.jsonl") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("kind") == "train":
                final.add(row["step"])
    # Steps redone after a resume were lost work: count each step of the final history once.
    result = summarize("checkpoint-restart", all_rows, kills, wall, lambda s: BATCH, sorted(final))
    result["launches"] = launches
    return result


def fmt_stalls(stalls):
    if not stalls:
        return "-"
    return f"{statistics.median(stalls):.2f} / {max(stalls):.2f}"


lines = [f"Kill loop, {args.minutes:g} min per run, {args.groups} groups of 1 rank (replica groups) or one "
         f"{args.groups}-rank job (checkpoint-restart), Fashion-MNIST CNN, batch {BATCH}, target {args.target:.0%}.",
         "",
         "| T (s) | run | kills | steps committed | effective time | vs checkpoint-restart | stall per failure, "
         "median / max (s) | time to target (s) | best accuracy |",
         "|---|---|---|---|---|---|---|---|---|"]
for period in [float(x) for x in args.periods.split(",")]:
    results = []
    if args.only != "restart":
        results.append(run_replicas(period, f"{args.work}/replicas_T{period:g}"))
    if args.only != "replicas":
        every, cost, step_s = checkpoint_interval(period, f"{args.work}/calibrate_T{period:g}")
        restart = run_restart(period, f"{args.work}/restart_T{period:g}", every)
        restart["name"] = f"checkpoint-restart (every {every} steps: C {cost * 1000:.0f} ms, step {step_s * 1000:.1f} ms)"
        results.append(restart)
    base = results[-1]["effective"] if args.only is None else float("nan")
    for r in results:
        ratio = r["effective"] / base if base and not math.isnan(base) else float("nan")
        target = f"{r['to_target']:.0f}" if r["to_target"] is not None else "not reached"
        lines.append(f"| {period:g} | {r['name']} | {r['kills']} | {r['steps']} | {r['effective']:.3f} | "
                     f"{ratio:.2f}x | {fmt_stalls(r['stalls'])} | {target} | {r['best']:.2%} |")
        print(lines[-1], flush=True)
table = "\n".join(lines)
print(table)
if args.output:
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        f.write(table + "\n")
