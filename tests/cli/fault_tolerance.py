#!/usr/bin/env python3
"""Fault-tolerant replica groups through `tessera launch`: real MPI jobs, real SIGKILLs.

Cases (each under a hard timeout; every check prints FAIL and the test exits 1 at the end):

  invariant     without failures, 3 groups x 1 rank and 2 groups x 2 ranks (spatial plan) compute
                what the 1-rank run computes: each step's loss (the mean of the groups' losses) and
                the final parameters within 1e-5 relative.

  three-groups  3 groups x 1 rank, Adam. Group 1 is killed (kill -9 from here) once it has done
                some steps; group 2 sends itself SIGKILL as the exchange of a later step begins
                (--inject-kill 2:STEP:sync, while the others wait in it).
  spatial       2 groups x 2 ranks under a spatial plan. Group 1 sends itself SIGKILL at the first
                step (--inject-kill 1:0); later rank 1 of group 0 is killed from here (its mpirun
                then ends the rest of group 0).
  min-groups    2 groups x 1 rank with --min-groups 2: group 1 is killed; group 0 commits no step
                without it.
  stop-resume   SIGTERM to `tessera launch`: every group checkpoints and stops, the launcher exits
                75 and leaves no process; the same command with --resume auto finishes (the groups
                may have stopped at different steps: the one behind is healed).
  bad-input     an unusable store, groups started with different seeds, --min-groups above the
                groups, a batch that does not split: exit 2 with one clear message.

For every run with failures: the launcher exits 0; every killed group was restarted and healed
from a peer ("healed from group"); the final checkpoints of all groups hold the same parameters
and optimizer state bit for bit; the survivors never went longer than the documented bound
between committed steps (--join-window plus the time to reconnect: BOUND_S here); no process of
the run is left; the store folder is gone. What is reproducible of a run with failures: every
step before the first failure equals the failure-free run bit for bit (checked against one).
"""
import argparse
import glob
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("--tessera", required=True)
parser.add_argument("--mpi-flags", required=True, help="extra mpirun arguments, one string")
parser.add_argument("--model", required=True)
parser.add_argument("--data", required=True)
parser.add_argument("--plans", required=True, help="the tests' plan folder")
parser.add_argument("--work", required=True)
CASES = ["invariant", "three-groups", "spatial", "min-groups", "stop-resume", "bad-input"]
parser.add_argument("--case", action="append", choices=CASES)
args = parser.parse_args()
cases = args.case or CASES

JOIN_WINDOW_S = 1.0
BOUND_S = JOIN_WINDOW_S + 4.0  # documented: the join window plus reconnecting (seconds on this machine)
RUN_TIMEOUT_S = 240

shutil.rmtree(args.work, ignore_errors=True)
os.makedirs(args.work)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from checks import check, exit_if_failed  # noqa: E402


def train_args(work, steps, extra=()):
    return ["--model", args.model, "--data", args.data, "--steps", str(steps), "--batch", "48",
            "--optimizer", "adam", "--lr", "0.001", "--progress-every", "100", "--threads", "1",
            "--checkpoint-dir", f"{work}/ckpt", "--metrics-dir", f"{work}/metrics",
            "--join-window", str(JOIN_WINDOW_S), "--peer-timeout", "20", *extra]


def launch(work, groups, ranks, steps, extra=(), launch_extra=()):
    os.makedirs(work, exist_ok=True)
    command = [args.tessera, "launch", "--groups", str(groups), "--ranks-per-group", str(ranks),
               "--store", f"{work}/store", "--log-dir", f"{work}/logs", "--launcher-args", args.mpi_flags,
               *launch_extra, "--", *train_args(work, steps, extra)]
    print("$", shlex.join(command), flush=True)
    log = open(f"{work}/launch.log", "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def rows(work, group):
    path = f"{work}/metrics/group{group}/metrics.jsonl"
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if row.get("kind") == "train":
                out.append(row)
    return out


def rank_processes(work, group):
    """{MPI rank: pid} of the group's tessera processes (not its mpirun)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        except OSError:
            continue
        text = [a.decode(errors="replace") for a in argv]
        if not text or os.path.basename(text[0]) != "tessera" or "train" not in text:
            continue
        if f"{work}/store" in text and "--replica-group" in text and text[text.index("--replica-group") + 1] == str(group):
            out[int(env.get(b"OMPI_COMM_WORLD_RANK", b"0"))] = int(pid)
    return out


def wait_for_step(work, group, step, deadline):
    while time.time() < deadline:
        r = rows(work, group)
        if r and r[-1]["step"] >= step and rank_processes(work, group):
            return True
        time.sleep(0.05)
    return False


def kill_rank(work, group, rank, step, deadline):
    if not check(wait_for_step(work, group, step, deadline), f"{work}: group {group} never reached step {step}"):
        return
    pid = rank_processes(work, group).get(rank)
    if check(pid is not None, f"{work}: no rank {rank} process of group {group}"):
        print(f"kill -9 rank {rank} of group {group} (pid {pid}) after step {step}", flush=True)
        os.kill(pid, signal.SIGKILL)


def finish(work, process, deadline):
    try:
        code = process.wait(timeout=max(deadline - time.time(), 1))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        check(False, f"{work}: the launcher did not finish within {RUN_TIMEOUT_S} s")
        code = None
    with open(f"{work}/launch.log") as f:
        print(f.read(), flush=True)
    return code


def state(path):
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, item):
            if isinstance(item, h5py.Dataset) and name.split("/")[0] in ("param", "optimizer"):
                out[name] = item[()]
        f.visititems(visit)
        out["@optimizer_steps"] = np.array(f.attrs["optimizer_steps"])
    return out


def check_run(work, groups, steps, killed, min_groups=1, first_step_kill=()):
    """The checks every run with failures must pass."""
    with open(f"{work}/launch.log") as f:
        launch_log = f.read()
    failed = sorted(int(g) for g in re.findall(r"group (\d+) failed", launch_log))
    check(failed == sorted(killed), f"{work}: the groups that failed were {failed}, the groups killed {sorted(killed)} "
                                    f"(a survivor must not die of a peer's death)")
    for g in killed:
        check(re.search(rf"group {g} failed .* restarting it", launch_log), f"{work}: group {g} was not restarted")
        with open(f"{work}/logs/group{g}.log") as f:
            log = f.read()
        # A group killed at the first step may be back before the others committed a step: then it
        # joins at step 0 and there is nothing to heal.
        rejoined_at_start = g in first_step_kill and re.search(rf"group {g}: quorum [1-9]\d* of groups .* at step 0 ", log)
        check(f"group {g}: healed from group" in log or rejoined_at_start,
              f"{work}: group {g} was not healed from a peer")
    finals = [f"{work}/ckpt/group{g}/ckpt-{steps:08d}.h5" for g in range(groups)]
    if all(check(os.path.exists(p), f"{work}: no final checkpoint {p}") for p in finals):
        first = state(finals[0])
        check(len(first) > 3, f"{work}: the checkpoint holds too little: {sorted(first)}")
        for g, path in enumerate(finals[1:], 1):
            other = state(path)
            differ = [k for k in first if k not in other or not np.array_equal(first[k], other[k])]
            check(not differ and first.keys() == other.keys(),
                  f"{work}: group {g}'s final state differs from group 0's in {differ[:4]}")
        print(f"{work}: the {groups} groups' final parameters and optimizer state are equal bit for bit "
              f"({len(first)} entries)", flush=True)
    for g in range(groups):
        r = rows(work, g)
        committed = [row for row in r if row["step"] >= 0]
        check(all(row["contributors"] >= min_groups for row in committed),
              f"{work}: group {g} committed a step with fewer than --min-groups {min_groups} groups")
        check(all(math.isfinite(row["loss"]) for row in committed), f"{work}: group {g} has a non-finite loss")
        steps_seen = sorted({row["step"] for row in committed})
        check(steps_seen and steps_seen[-1] == steps - 1, f"{work}: group {g}'s metrics end at {steps_seen[-1:]}")
        if g not in killed and min_groups < groups:  # with every group needed, survivors wait for restarts
            gaps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(r, r[1:]) if b["step"] == a["step"] + 1]
            worst = max(gaps) if gaps else 0
            print(f"{work}: survivor group {g}: longest time between committed steps {worst:.2f} s", flush=True)
            check(worst <= BOUND_S, f"{work}: survivor group {g} went {worst:.2f} s without a step (bound {BOUND_S} s)")
    check(not os.path.exists(f"{work}/store"), f"{work}: the store folder was left behind")
    left = [p for g in range(groups) for p in rank_processes(work, g).values()]
    check(not left, f"{work}: processes left behind: {left}")


def reference_losses(work, groups, ranks, steps, extra=()):
    process = launch(work, groups, ranks, steps, extra)
    code = finish(work, process, time.time() + RUN_TIMEOUT_S)
    check(code == 0, f"{work}: the failure-free run exited {code}")
    return {row["step"]: row["loss"] for row in rows(work, 0)}


def compare_prefix(work, reference, before):
    mine = {row["step"]: row["loss"] for row in rows(work, 0) if row["step"] < before}
    same = [s for s in range(before) if s in mine and mine[s] == reference.get(s)]
    check(len(same) == before, f"{work}: {before - len(same)} of the {before} steps before the first failure differ "
                               f"from the failure-free run")
    print(f"{work}: the {len(same)} steps before the first failure equal the failure-free run bit for bit", flush=True)


def final_params(path):
    with h5py.File(path, "r") as f:
        out = {}
        f["param"].visititems(lambda n, item: out.__setitem__(n, item[()]) if isinstance(item, h5py.Dataset) else None)
        return out


if "invariant" in cases:
    steps = 8
    one = f"{args.work}/invariant_1rank"
    os.makedirs(one)
    single = subprocess.run(["mpirun", "-n", "1", *shlex.split(args.mpi_flags), args.tessera, "train",
                             *train_args(one, steps)], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    check(single.returncode == 0, f"{one}: exited {single.returncode}\n{single.stderr}")
    with open(f"{one}/metrics/metrics.jsonl") as f:
        reference = {r["step"]: r["loss"] for r in map(json.loads, f) if r["kind"] == "train"}
    expected = final_params(f"{one}/ckpt/ckpt-{steps:08d}.h5")
    for groups, ranks, extra in [(3, 1, []), (2, 2, ["--plan", f"{args.plans}/fashion_spatial_np2.yaml"])]:
        work = f"{args.work}/invariant_{groups}x{ranks}"
        code = finish(work, launch(work, groups, ranks, steps, extra), time.time() + RUN_TIMEOUT_S)
        if not check(code == 0, f"{work}: the launcher exited {code}"):
            continue
        losses = [{r["step"]: r["loss"] for r in rows(work, g)} for g in range(groups)]
        worst = max(abs(sum(l[s] for l in losses) / groups - reference[s]) / abs(reference[s]) for s in range(steps))
        check(worst <= 1e-5, f"{work}: a step's loss differs from the 1-rank run's by {worst:.2e} relative")
        params = final_params(f"{work}/ckpt/group0/ckpt-{steps:08d}.h5")
        scale = max(float(np.abs(v).max()) for v in expected.values())
        diff = max(float(np.abs(params[k] - expected[k]).max()) for k in expected) / scale
        check(diff <= 1e-5, f"{work}: the final parameters differ from the 1-rank run's by {diff:.2e} (of the largest)")
        print(f"{work}: losses within {worst:.1e}, parameters within {diff:.1e} of the 1-rank run", flush=True)


if "three-groups" in cases:
    steps, kill_at, sync_kill = 900, 120, 300
    reference = reference_losses(f"{args.work}/three_reference", 3, 1, kill_at + 1)
    work = f"{args.work}/three"
    deadline = time.time() + RUN_TIMEOUT_S
    process = launch(work, 3, 1, steps, ["--inject-kill", f"2:{sync_kill}:sync"])
    kill_rank(work, 1, 0, kill_at, deadline)
    code = finish(work, process, deadline)
    if check(code == 0, f"{work}: the launcher exited {code}"):
        check_run(work, 3, steps, killed=[1, 2])
        compare_prefix(work, reference, kill_at)

if "spatial" in cases:
    # Group 0 must be back while group 1 still trains (450 steps after the kill), or there is
    # nothing left to heal it for.
    steps, kill_at = 600, 150
    work = f"{args.work}/spatial"
    deadline = time.time() + RUN_TIMEOUT_S
    process = launch(work, 2, 2, steps, ["--plan", f"{args.plans}/fashion_spatial_np2.yaml", "--inject-kill", "1:0"])
    kill_rank(work, 0, 1, kill_at, deadline)
    code = finish(work, process, deadline)
    if check(code == 0, f"{work}: the launcher exited {code}"):
        check_run(work, 2, steps, killed=[0, 1], first_step_kill=[1])

if "min-groups" in cases:
    steps, kill_at = 300, 100
    work = f"{args.work}/min_groups"
    deadline = time.time() + RUN_TIMEOUT_S
    process = launch(work, 2, 1, steps, launch_extra=["--min-groups", "2"])
    # Group 0 waits for group 1's restart: no step without it.
    kill_rank(work, 1, 0, kill_at, deadline)
    code = finish(work, process, deadline)
    if check(code == 0, f"{work}: the launcher exited {code}"):
        check_run(work, 2, steps, killed=[1], min_groups=2)


if "stop-resume" in cases:
    steps, stop_at = 600, 100
    work = f"{args.work}/stop_resume"
    deadline = time.time() + RUN_TIMEOUT_S
    process = launch(work, 2, 1, steps)
    if check(wait_for_step(work, 0, stop_at, deadline), f"{work}: group 0 never reached step {stop_at}"):
        os.kill(process.pid, signal.SIGTERM)
    code = finish(work, process, deadline)
    check(code == 75, f"{work}: the stopped launcher exited {code}, expected 75")
    for g in range(2):
        check(glob.glob(f"{work}/ckpt/group{g}/ckpt-*.h5"), f"{work}: group {g} wrote no checkpoint when stopped")
    check(not [p for g in range(2) for p in rank_processes(work, g).values()], f"{work}: processes left after the stop")
    os.rename(f"{work}/launch.log", f"{work}/launch_stopped.log")
    process = launch(work, 2, 1, steps, ["--resume", "auto"])
    code = finish(work, process, time.time() + RUN_TIMEOUT_S)
    if check(code == 0, f"{work}: the resumed launcher exited {code}"):
        check_run(work, 2, steps, killed=[])
        for g in range(2):
            with open(f"{work}/logs/group{g}.log") as f:
                check("resumed from" in f.read(), f"{work}: group {g} did not resume from its checkpoint")


def expect_exit_2(command, message, name, timeout=60):
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    check(result.returncode == 2, f"{name}: exit code {result.returncode}, expected 2\n{output}")
    check(message in output, f"{name}: the message lacks '{message}':\n{output}")
    check(output.count("error") <= 2, f"{name}: more than one message:\n{output}")
    print(f"{name}: exit 2 with '{message}'", flush=True)


if "bad-input" in cases:
    work = f"{args.work}/bad"
    os.makedirs(work)
    mpirun = ["mpirun", "-n", "1", *shlex.split(args.mpi_flags)]
    single = [*mpirun, args.tessera, "train", *train_args(work, 20)]
    expect_exit_2([*single, "--replica-store", "/dev/null/store", "--replica-group", "0", "--replica-groups", "2"],
                  "cannot be used", "unusable store")
    expect_exit_2([args.tessera, "launch", "--groups", "2", "--min-groups", "3", "--store", f"{work}/s1", "--",
                   *train_args(work, 20)], "--min-groups 3 must be between 1 and the 2 groups", "launch min-groups")
    expect_exit_2([*single, "--replica-store", f"{work}/s2", "--replica-group", "0", "--replica-groups", "2",
                   "--min-groups", "3"], "--min-groups 3 must be between 1 and the 2 groups", "train min-groups")
    expect_exit_2([*single, "--replica-store", f"{work}/s3", "--replica-group", "0", "--replica-groups", "5"],
                  "does not split evenly over the 5 replica groups", "batch split")
    # Group 0 waits for a quorum; group 1, with another seed, is refused at the rendezvous.
    first = subprocess.Popen([*single, "--replica-store", f"{work}/s4", "--replica-group", "0", "--replica-groups",
                              "2", "--seed", "1", "--start-window", "60"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(300):
        if os.path.exists(f"{work}/s4/identity"):
            break
        time.sleep(0.1)
    expect_exit_2([*single, "--replica-store", f"{work}/s4", "--replica-group", "1", "--replica-groups", "2",
                   "--seed", "2"], "different seed", "different seeds")
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()

exit_if_failed()
print("fault tolerance: every check passed")
