#!/usr/bin/env python3
"""A plan that fits a rank's memory only without outputs written into halo windows runs without them.

On the host, pooling writes its output into the next convolution's halo window where the step
plan keeps it (the arena may grow by up to 5 %). CosmoFlow 128^3 with two input channels (whose
first convolution therefore makes neither its pooling's output nor its gradient) on 2 ranks split
along D (plans/cosmoflow_spatial2_deep.yaml) needs a little more with the windows than without. With
--memory-per-rank:

- far too small: exit 2, one message with the least the plan needs (without windows), X MiB,
  naming conv1 (its output) as the largest layer, not the leaky ReLU running in place over it;
- X + 0.1 MiB: trains (exit 0) and says that no layer writes into its reader's halo window;
- 2 X: trains with the windows (no such line).
"""
import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile

parser = argparse.ArgumentParser()
parser.add_argument("--tessera", required=True)
parser.add_argument("--mpirun", required=True, help="the mpirun command line, without -n")
parser.add_argument("--models", required=True, help="the project's models/ (cosmoflow_128.yaml)")
parser.add_argument("--plans", required=True, help="the project's plans/ (cosmoflow_spatial2_deep.yaml)")
args = parser.parse_args()

NOTICE = "no layer writes into its reader's halo window"
problems = []


def run(*command):
    cmd = shlex.split(args.mpirun) + ["-n", "2", args.tessera] + list(command)
    print("$", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=240)
    text = done.stdout.decode(errors="replace")
    print(text, flush=True)
    return done.returncode, text


def check(condition, message):
    if not condition:
        problems.append(message)
        print(f"FAIL: {message}", flush=True)


with tempfile.TemporaryDirectory() as folder:
    code, _ = run("generate", "cosmo", "--train", "2", "--size", "128", "--channels", "2", "--seed", "3", "--output",
                  folder)
    if code != 0:
        sys.exit(f"generating the data failed (exit {code})")
    model = os.path.join(folder, "cosmoflow_128_2ch.yaml")
    with open(os.path.join(args.models, "cosmoflow_128.yaml")) as source, open(model, "w") as target:
        target.write(source.read().replace("shape: [1, 128, 128, 128]", "shape: [2, 128, 128, 128]"))

    def train(limit):
        return run("train", "--model", model, "--plan",
                   os.path.join(args.plans, "cosmoflow_spatial2_deep.yaml"), "--data",
                   os.path.join(folder, "train.h5"), "--batch", "1", "--steps", "1", "--lr", "0.0001",
                   "--memory-per-rank", str(int(limit)))

    code, text = train(1 << 20)
    need = re.search(r"this plan needs about ([0-9.]+) MiB per rank", text)
    check(code == 2 and need is not None, f"a 1 MiB limit: exit {code}, expected 2 with what the plan needs")
    # The layer named holds the most of its own: conv1's output, not the leaky ReLU running in place
    # over it; and what it holds is part of the total.
    largest = re.search(r"its largest layer, '(\w+)' .*, holds ([0-9.]+) MiB of it", text)
    check(largest is not None and largest.group(1) == "conv1", f"a 1 MiB limit: the largest layer named is "
          f"{largest.group(1) if largest else None}, expected conv1")
    if need and largest:
        check(float(largest.group(2)) <= float(need.group(1)), "a 1 MiB limit: the largest layer holds more than "
              "the whole plan needs")
    if need:
        least = float(need.group(1)) * (1 << 20)
        code, text = train(least + 0.1 * (1 << 20))
        check(code == 0 and "trained 1 steps" in text, f"the least it needs + 0.1 MiB: exit {code}, expected 0")
        check(NOTICE in text, "the least it needs + 0.1 MiB: no word that the windows are off (do the windows "
              "still grow this plan's arena?)")
        code, text = train(2 * least)
        check(code == 0 and NOTICE not in text, f"twice that: exit {code}, the windows "
              f"{'off' if NOTICE in text else 'on'}; expected 0 with the windows on")

if problems:
    sys.exit("window memory: " + "; ".join(problems))
print("window memory: ok")
