#!/usr/bin/env python3
"""`tessera calibrate` end to end: measures this machine (quickly) with kernel timings for a model,
checks the machine file it writes (every field, a kernel timing for every layer), that
`tessera plan` reads it and prices every layer of its plans from the calibrated timings, that
`--base` at one rank adds kernels to an existing file without measuring the node again, and that
`--merge` writes the median of calibrations, number by number.

With --gpu-base FILE: `tessera calibrate --device cuda` on top of that GPU machine file instead
(one rank, this machine's first GPU): the GPU's rates in the written file, the base's nodes and
communication kept, a kernel timing for every layer, and `tessera plan` pricing from them. Exits
77 (Skipped) with the reason where there is no usable GPU."""
import argparse
import os
import re
import shlex
import subprocess
import sys

import yaml

parser = argparse.ArgumentParser()
parser.add_argument("--tessera", required=True)
parser.add_argument("--mpirun", required=True,
                    help="the mpirun command line and its flags, one string ('': one-rank runs start the program alone)")
parser.add_argument("--model", required=True)
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--work", required=True, help="folder for the machine files (must exist or be creatable)")
parser.add_argument("--gpu-base", help="check `tessera calibrate --device cuda` on top of this GPU machine file")
args = parser.parse_args()

os.makedirs(args.work, exist_ok=True)
mpirun = shlex.split(args.mpirun)
problems = []


def one_rank():
    return mpirun + ["-n", "1"] if mpirun else []


def run(command, timeout=120):
    print("$", " ".join(command), flush=True)
    try:
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        print((e.stdout or b"").decode(errors="replace"))
        sys.exit(f"FAIL: {' '.join(command)} did not end within {timeout} s")
    output = result.stdout.decode(errors="replace")
    print(output, flush=True)
    if result.returncode != 0:
        if args.gpu_base and "calibrate --device cuda: " in output and (
                "CUDA device" in output or "built without CUDA" in output):
            print("SKIPPED: no usable GPU (the reason above)")
            sys.exit(77)
        sys.exit(f"FAIL: exit code {result.returncode}")
    return output


def plan_prices_from_timings(machine_file, rank_counts):
    """`tessera plan` reads the file and prices every layer of its plans from a calibrated timing."""
    for ranks in rank_counts:
        out = run(one_rank() + [args.tessera, "plan", "--model", args.model, "--ranks", str(ranks), "--batch",
                            str(args.batch), "--machine", machine_file])
        rows = [line for line in out.splitlines() if re.match(r"^\S+\s+.*\d+\.\d{3}[mr]\s", line)]
        if not rows:
            problems.append(f"tessera plan at {ranks} ranks printed no cost table")
        for row in rows:
            if re.search(r"\d\.\d{3}r\s", row):
                problems.append(f"tessera plan at {ranks} ranks priced a layer by the roofline, not a timing: {row}")


def check_gpu():
    with open(args.gpu_base) as f:
        base = yaml.safe_load(f)
    machine_file = os.path.join(args.work, "gpu.yaml")
    run(one_rank() + [args.tessera, "calibrate", "--device", "cuda", "--base", args.gpu_base, "--name",
                  "gpu-check", "--quick", "--repeats", "2", "--model", args.model, "--batch", str(args.batch),
                  "--ranks", "1,4", "-o", machine_file], timeout=300)
    with open(machine_file) as f:
        machine = yaml.safe_load(f)
    if machine.get("device") != "gpu" or machine.get("name") != "gpu-check":
        problems.append(f"expected the gpu machine gpu-check, got {machine.get('device')} {machine.get('name')}")
    for key, low, high in [("flops", 1e11, 1e16), ("bf16_flops", 1e11, 1e16), ("memory_bandwidth", 1e10, 1e14),
                           ("kernel_overhead", 1e-7, 1e-2), ("memory_per_rank", 1e9, 1e12)]:
        if not (low <= machine.get(key, 0) <= high):
            problems.append(f"{key} = {machine.get(key)} is outside [{low}, {high}]")
    for key in ["nodes", "ranks_per_node", "cores_per_node", "intra", "inter", "grad_overlap"]:
        if machine.get(key) != base.get(key):
            problems.append(f"'{key}' is not the base's: {base.get(key)} -> {machine.get(key)}")
    if "--device cuda" not in machine.get("source", "") or args.gpu_base not in machine.get("source", ""):
        problems.append("the source does not say it was measured on a GPU on top of the base")
    with open(args.model) as f:
        model = yaml.safe_load(f)
    kernels = machine.get("kernels", {})
    for layer in model["layers"]:
        prefix = f"{model['name']}/{layer['name']}|"
        for ranks in (1, 4):
            samples = f"|n{args.batch // ranks}|" if ranks == 1 else ""
            suffix = f"|t1|r{min(ranks, base['ranks_per_node'])}"  # one thread (a GPU), ranks sharing the node
            if not any(k.startswith(prefix) and k.endswith(suffix) and samples in k for k in kernels):
                problems.append(f"no kernel timing for layer {layer['name']} at {ranks} rank(s) (1 thread: a GPU)")
    if any(not (0 < s < 10) for s in kernels.values()):
        problems.append("a kernel timing is outside (0, 10) s")
    plan_prices_from_timings(machine_file, [1, 4])
    if problems:
        print("\n".join("FAIL: " + p for p in problems))
        sys.exit(1)
    print(f"OK: {len(kernels)} kernel timings on the GPU; flops {machine['flops']:.3g}, bf16_flops "
          f"{machine['bf16_flops']:.3g}, bandwidth {machine['memory_bandwidth']:.3g}")
    sys.exit(0)


if args.gpu_base:
    check_gpu()


machine_file = os.path.join(args.work, "local.yaml")
run(mpirun + ["-n", "2", args.tessera, "calibrate", "--quick", "--repeats", "2", "--model", args.model,
              "--batch", str(args.batch), "--ranks", "1,2", "-o", machine_file])
with open(machine_file) as f:
    machine = yaml.safe_load(f)

for key in ["name", "source", "device", "nodes", "ranks_per_node", "cores_per_node", "flops", "memory_bandwidth",
            "memory_per_rank", "kernel_overhead", "grad_overlap", "intra", "inter", "kernels"]:
    if key not in machine:
        problems.append(f"the machine file lacks '{key}'")
if machine.get("device") != "cpu" or machine.get("nodes") != 1:
    problems.append(f"expected one cpu node, got device {machine.get('device')} nodes {machine.get('nodes')}")
cores = machine["cores_per_node"]
if cores != os.cpu_count():
    problems.append(f"cores_per_node {cores}, but this machine has {os.cpu_count()} hardware threads")
for key, low, high in [("flops", 1e9, 1e14), ("memory_bandwidth", 1e9, 1e13), ("kernel_overhead", 1e-8, 1e-2)]:
    if not (low <= machine[key] <= high):
        problems.append(f"{key} = {machine[key]} is outside [{low}, {high}]")
for collective in ["p2p", "allreduce", "alltoall"]:
    ab = machine["intra"][collective]
    if not (0 <= ab["alpha"] < 1e-3 and 0 < ab["beta"] < 1e-7):
        problems.append(f"intra.{collective} = {ab} is implausible for shared memory")
    if machine["inter"][collective] != ab:
        problems.append(f"inter.{collective} differs from intra on one node")
if "inter = intra" not in machine["source"]:
    problems.append("the source does not say that inter = intra")

# A timing for every layer at 1 rank (all the node's threads) and at 2 ranks.
with open(args.model) as f:
    model = yaml.safe_load(f)
kernels = machine["kernels"]
threads = {p: max(1, cores // min(p, machine["ranks_per_node"])) for p in (1, 2)}  # Machine::threads_per_rank
for layer in model["layers"]:
    prefix = f"{model['name']}/{layer['name']}|"
    for ranks, t in threads.items():
        samples = f"|n{args.batch // ranks}|" if ranks == 1 else ""
        suffix = f"|t{t}|r{min(ranks, machine['ranks_per_node'])}"  # threads, ranks sharing the node
        if not any(k.startswith(prefix) and k.endswith(suffix) and samples in k for k in kernels):
            problems.append(f"no kernel timing for layer {layer['name']} at {ranks} rank(s) ({t} threads)")
if any(not (0 < s < 10) for s in kernels.values()):
    problems.append("a kernel timing is outside (0, 10) s")

plan_prices_from_timings(machine_file, [1, 2])

# --base at one rank: the node's numbers stay, kernels are added (here: re-timed for 1 rank).
again_file = os.path.join(args.work, "again.yaml")
run(one_rank() + [args.tessera, "calibrate", "--base", machine_file, "--quick", "--repeats", "1",
              "--model", args.model, "--batch", str(args.batch), "--ranks", "1", "-o", again_file])
with open(again_file) as f:
    again = yaml.safe_load(f)
for key in ["name", "source", "flops", "memory_bandwidth", "intra", "inter", "cores_per_node", "ranks_per_node"]:
    if again[key] != machine[key]:
        problems.append(f"--base changed '{key}': {machine[key]} -> {again[key]}")
if set(again["kernels"]) != set(kernels):
    problems.append("--base lost or invented kernel keys")

# --merge: the median of three calibrations, each measured number on its own (a third file made
# from the first with every rate and timing 10x, and one kernel only it has).
scaled = dict(machine)
scaled["flops"] = 10 * machine["flops"]
scaled["kernels"] = {key: 10 * value for key, value in kernels.items()}
scaled["kernels"]["extra/only|here"] = 0.5
scaled_file = os.path.join(args.work, "scaled.yaml")
with open(scaled_file, "w") as f:
    yaml.safe_dump(scaled, f)
merged_file = os.path.join(args.work, "merged.yaml")
run(one_rank() + [args.tessera, "calibrate", "--merge", machine_file, again_file, scaled_file, "-o", merged_file])
with open(merged_file) as f:
    merged = yaml.safe_load(f)


def close(a, b):
    return abs(a - b) <= 1e-5 * abs(b)


if not close(merged["flops"], sorted([machine["flops"], again["flops"], scaled["flops"]])[1]):
    problems.append(f"--merge: flops {merged['flops']} is not the median of the three")
for key, value in kernels.items():
    expected = sorted([value, again["kernels"][key], 10 * value])[1]
    if not close(merged["kernels"].get(key, -1), expected):
        problems.append(f"--merge: kernel {key} is {merged['kernels'].get(key)}, not the median {expected}")
if merged["kernels"].get("extra/only|here") != 0.5:
    problems.append("--merge: a timing that one file has was not kept")
if "median of 3 calibrations" not in merged["source"]:
    problems.append("--merge: the source does not say that the file is a median of calibrations")
plan_prices_from_timings(merged_file, [1, 2])

if problems:
    print("\n".join("FAIL: " + p for p in problems))
    sys.exit(1)
print(f"OK: {len(kernels)} kernel timings; flops {machine['flops']:.3g}, bandwidth {machine['memory_bandwidth']:.3g}")
