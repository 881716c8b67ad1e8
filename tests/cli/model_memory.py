#!/usr/bin/env python3
"""A model larger than a rank's memory: refused before anything is allocated, trained under a split.

tests/cli/models/wide_fashion.yaml holds 11.9 M weights: with their gradients and SGD momentum about
143 MB on one rank. With --memory-per-rank 120 MB:

- 1 rank (every layer whole): exit 2 with one message naming fc2 and the bytes, and a peak resident
  size at most 40 MB above a tiny model's refusal (building fc2's weights and gradient alone would
  add 75 MB: the refusal comes before anything is allocated);
- 4 ranks under tests/cli/plans/wide_fashion_np4.yaml (fc1 by filter, fc2 by channel): 3 steps,
  exit 0, every rank's peak resident size less than half the whole model's 143 MB above that baseline;
- 2 replica groups of a 1-rank plan with 250 MB: bsp trains; --sync eager, whose buffers hold 13
  more copies of the parameters, is refused with a message that counts them.

Peak resident sizes are the largest process's of each mpirun (getrusage of the children, measured
in a wrapper process per run).
"""
import argparse
import re
import shlex
import subprocess
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--tessera", required=True)
parser.add_argument("--mpirun", required=True, help="the mpirun command line, without -n")
parser.add_argument("--models", required=True, help="the project's models/ (fashion_cnn.yaml)")
parser.add_argument("--tests", required=True, help="tests/cli (models/wide_fashion.yaml, plans/wide_fashion_np4.yaml)")
parser.add_argument("--data", required=True)
args = parser.parse_args()

LIMIT = 120e6
MB = 1e6
WRAPPER = ("import resource, subprocess, sys\n"
           "r = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)\n"
           "sys.stdout.buffer.write(r.stdout)\n"
           "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
           "sys.exit(r.returncode)\n")
problems = []


def run(ranks, model, *extra):
    """(exit code, output, peak resident bytes of the largest process)."""
    cmd = (shlex.split(args.mpirun) + ["-n", str(ranks), args.tessera, "train", "--model", model, "--data", args.data,
                                       "--batch", "32", "--momentum", "0.9", "--progress-every", "1"] + list(extra))
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run([sys.executable, "-c", WRAPPER] + cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=240)
    text = done.stdout.decode(errors="replace")
    print(text, flush=True)
    peak = re.search(r"PEAK_RSS_KB (\d+)", text)
    return done.returncode, text, int(peak.group(1)) * 1024 if peak else float("inf")


def check(condition, message):
    if not condition:
        problems.append(message)
        print(f"FAIL: {message}", flush=True)


code, text, baseline = run(1, f"{args.models}/fashion_cnn.yaml", "--steps", "3", "--memory-per-rank", "1000")
check(code == 2 and "MiB per rank" in text, f"a tiny limit: exit {code}, expected 2 with the memory message")
print(f"baseline (a refusal before anything is allocated): {baseline / MB:.1f} MB", flush=True)

wide = f"{args.tests}/models/wide_fashion.yaml"
code, text, peak = run(1, wide, "--steps", "3", "--memory-per-rank", str(int(LIMIT)))
check(code == 2, f"1 rank: exit {code}, expected 2")
check(re.search(r"this plan needs about [0-9.]+ MiB per rank .* more than the 114\.4 MiB a rank has "
                r"\(--memory-per-rank\); its largest layer, 'fc2'", text) is not None,
      "1 rank: the refusal does not name the bytes, the limit and fc2")
check(text.count("tessera: error") == 1, f"1 rank: {text.count('tessera: error')} error lines, expected 1")
check(peak <= baseline + 40 * MB, f"1 rank: peak resident {peak / MB:.1f} MB, more than the baseline + 40 MB: "
      "weights were allocated before the refusal")

code, text, peak = run(4, wide, "--steps", "3", "--memory-per-rank", str(int(LIMIT)), "--plan",
                       f"{args.tests}/plans/wide_fashion_np4.yaml")
check(code == 0 and "trained 3 steps" in text, f"4 ranks split by filter and channel: exit {code}, expected 0")
check(peak <= baseline + 71.5 * MB, f"4 ranks: peak resident {peak / MB:.1f} MB per rank, more than the baseline + "
      "half the whole model's 143 MB")
print(f"peak resident per rank: 4 ranks {peak / MB:.1f} MB (baseline {baseline / MB:.1f} MB)", flush=True)

one_rank = f"{args.tests}/plans/one_rank.yaml"
code, text, _ = run(2, wide, "--steps", "3", "--memory-per-rank", "250000000", "--plan", one_rank)
check(code == 0, f"2 groups under bsp with 250 MB: exit {code}, expected 0")
code, text, _ = run(2, wide, "--steps", "3", "--memory-per-rank", "250000000", "--plan", one_rank, "--sync", "eager")
check(code == 2 and re.search(r"MiB of --sync eager's buffers \(13 copies of the rank's parameters\)", text) is not None,
      f"2 groups under eager with 250 MB: exit {code}, expected 2 with the synchronizer's buffers counted")

if problems:
    sys.exit("FAIL: " + "; ".join(problems))
print("OK")
