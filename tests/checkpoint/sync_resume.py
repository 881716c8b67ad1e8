#!/usr/bin/env python3
"""Every synchronization mode's checkpoint resumes to the uninterrupted run, bit for bit.

For each mode, 4 ranks run a 1-rank plan as 4 replica groups: an uninterrupted 12-step run, and a
7-step run (its checkpoint falls between two syncs, where the groups differ) resumed to 12 steps.
The resumed rows (loss, syncs, bytes across groups, gain, consensus distance) equal the
uninterrupted ones exactly. The checkpoint, read with h5py, holds each group's parameters under
replica/ (the group outermost) and their mean, the consensus model, under param/.
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys

import h5py
import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("--tessera", required=True)
parser.add_argument("--mpirun", required=True)
parser.add_argument("--model", required=True)
parser.add_argument("--data", required=True)
parser.add_argument("--work", required=True)
args = parser.parse_args()

shutil.rmtree(args.work, ignore_errors=True)
os.makedirs(args.work)
plan = os.path.join(args.work, "one_rank.yaml")
with open(plan, "w") as f:
    f.write("ranks: 1\ndefault: {sample: 1}\n")

MODES = {
    "local_sgd": ["--sync", "local_sgd", "--sync-period", "3"],
    "post_local": ["--sync", "local_sgd", "--sync-period", "3", "--sync-start", "2", "--sync-optimizer-state"],
    "diloco": ["--sync", "diloco", "--sync-period", "4"],
    "easgd": ["--sync", "easgd", "--sync-period", "2"],
    "gossip": ["--sync", "gossip", "--gossip-topology", "ring"],
    "adascale": ["--sync", "adascale"],
    "ssp": ["--sync", "ssp", "--staleness", "2"],
}
COLUMNS = ["loss", "syncs", "cross_group_bytes", "gain", "consensus"]
problems = []


def run(extra):
    cmd = (shlex.split(args.mpirun) + ["-n", "4", args.tessera, "train", "--model", args.model, "--plan", plan,
                                       "--data", args.data, "--batch", "32", "--lr", "0.05", "--momentum", "0.9",
                                       "--seed", "3", "--progress-every", "100"] + extra)
    print("$", " ".join(cmd), flush=True)
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    print(result.stdout.decode(errors="replace"), flush=True)
    if result.returncode != 0:
        sys.exit(f"FAIL: exit code {result.returncode}")


def rows(metrics):
    with open(os.path.join(metrics, "metrics.jsonl")) as f:
        return [{k: r[k] for k in ["step"] + COLUMNS} for r in map(json.loads, f) if r["kind"] == "train"]


for name, options in MODES.items():
    work = os.path.join(args.work, name)
    full, part, ckpt = (os.path.join(work, d) for d in ("full", "part", "ckpt"))
    run(options + ["--steps", "12", "--metrics-dir", full])
    run(options + ["--steps", "7", "--checkpoint-dir", ckpt, "--metrics-dir", part])
    saved = os.path.join(ckpt, "ckpt-00000007.h5")
    with h5py.File(saved, "r") as f:
        replicas = f.get("replica/param/fc1.weight")
        if name == "adascale":  # groups never differ: no per-group copies
            if replicas is not None:
                problems.append(f"{name}: the checkpoint holds per-group copies")
        elif replicas is None:
            problems.append(f"{name}: the checkpoint holds no replica/param/fc1.weight")
        else:
            groups = np.asarray(replicas)
            mean = np.asarray(f["param/fc1.weight"])
            if groups.shape != (4,) + mean.shape:
                problems.append(f"{name}: replica/ has shape {groups.shape}, param/ {mean.shape}")
            elif np.array_equal(groups[0], groups[1]):
                problems.append(f"{name}: the groups did not differ at the checkpoint (the test proves nothing)")
            expected = f["sync/center/fc1.weight"] if name == "easgd" else groups.mean(axis=0)
            if name == "ssp" and f["sync/pending/0/fc1.weight"].shape != groups.shape:
                problems.append(f"{name}: pending corrections are not stored per group")
            if not np.allclose(mean, expected, rtol=1e-5, atol=1e-7):
                problems.append(f"{name}: param/ is not the consensus model")
    run(options + ["--steps", "12", "--checkpoint-dir", ckpt, "--resume", "auto", "--metrics-dir", part])
    a, b = rows(full), rows(part)
    if a != b:
        for x, y in zip(a, b):
            if x != y:
                problems.append(f"{name}: step {x['step']}: uninterrupted {x}, resumed {y}")
                break
        else:
            problems.append(f"{name}: {len(a)} uninterrupted rows, {len(b)} resumed")
    if not any(r["syncs"] for r in a):
        problems.append(f"{name}: no syncs counted")

if problems:
    sys.exit("FAIL:\n  " + "\n  ".join(problems))
print(f"OK: {', '.join(MODES)} resume bit for bit")
