#!/usr/bin/env python3
"""Stop on a signal and resume, through `mpirun ... tessera train` (no Slurm).

An uninterrupted run of --steps S gives the reference losses. Then, for each case, the same run
with --checkpoint-dir D is signalled once its progress lines show some steps done:

  usr1-mpirun   SIGUSR1 to mpirun, which forwards it to every rank;
  term-one-rank SIGTERM to one rank only (as Slurm sends at the time limit, here to one rank:
                the ranks must agree and stop at the same step).

It must exit 75 (EX_TEMPFAIL) within the time limit, rank 0 must print "stopped at step K on a
signal ...; checkpoint written to ...; resume with --resume auto" once, D must hold the checkpoint
of step K < S, and the same command with `--resume auto` must exit 0 with every training step's
loss (metrics.jsonl, each step once) and the final loss (summary.json) equal to the reference
within 1e-6 relative (bit-identical is expected, and reported). With --timing-dependent (modes
whose updates follow measured times: dssp, eager with late groups) the resumed run must still
have every step once and finite losses, but its losses are not compared.
"""
import math
import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--tessera", required=True)
parser.add_argument("--mpirun", required=True, help="the mpirun command line, without -n")
parser.add_argument("--model", required=True)
parser.add_argument("--data", required=True)
parser.add_argument("--work", required=True)
parser.add_argument("--ranks", type=int, default=2)
parser.add_argument("--steps", type=int, default=120)
parser.add_argument("--signal-after", type=int, default=10, help="signal once this step's progress line is out")
parser.add_argument("--case", action="append", choices=["usr1-mpirun", "term-one-rank"])
parser.add_argument("--timing-dependent", action="store_true",
                    help="the mode's updates follow measured times: do not compare the losses with the reference")
parser.add_argument("--train-arg", action="append", default=[],
                    help="one more argument for every tessera train run (repeatable), e.g. --sync")
args = parser.parse_args()
cases = args.case or ["usr1-mpirun", "term-one-rank"]
EXIT_STOPPED = 75
TOLERANCE = 1e-6

shutil.rmtree(args.work, ignore_errors=True)
os.makedirs(args.work)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from checks import check, exit_if_failed  # noqa: E402


def command(name, *extra):
    return (shlex.split(args.mpirun) + ["-n", str(args.ranks), args.tessera, "train", "--model", args.model,
                                        "--data", args.data, "--steps", str(args.steps), "--batch", "32",
                                        "--seed", "5", "--progress-every", "5", "--checkpoint-every", "1000",
                                        "--checkpoint-dir", os.path.join(args.work, name, "checkpoints"),
                                        "--metrics-dir", os.path.join(args.work, name, "metrics")] + args.train_arg +
            list(extra))


def run(name, log_name, *extra, timeout=240):
    os.makedirs(os.path.join(args.work, name), exist_ok=True)
    log = os.path.join(args.work, name, log_name)
    cmd = command(name, *extra)
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    with open(log, "w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    text = open(log).read()
    return done.returncode, text


def losses(name):
    path = os.path.join(args.work, name, "metrics", "metrics.jsonl")
    rows = [json.loads(line) for line in open(path) if line.strip()]
    train = [r for r in rows if r.get("kind") == "train"]
    steps = [r["step"] for r in train]
    return steps, [r["loss"] for r in train]


def final_loss(name):
    return json.load(open(os.path.join(args.work, name, "metrics", "summary.json")))["final_loss"]


def children(pid):
    """The processes whose parent is `pid` (mpirun's ranks)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[1]) == pid:
            found.append(int(entry))
    return sorted(found)


def close(a, b):
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b), 1e-30)


# The reference: uninterrupted.
code, text = run("reference", "run.log")
if not check(code == 0, f"the uninterrupted run exited {code}"):
    print(text)
    exit_if_failed()
ref_steps, ref_losses = losses("reference")
ref_final = final_loss("reference")
check(ref_steps == list(range(1, args.steps + 1)) or ref_steps == list(range(args.steps)),
      f"the reference has train rows for steps {ref_steps[:3]}...{ref_steps[-3:]}")
print(f"reference: {args.steps} steps, final loss {ref_final!r}", flush=True)

for case in cases:
    print(f"--- {case}", flush=True)
    folder = os.path.join(args.work, case)
    os.makedirs(folder)
    log_path = os.path.join(folder, "stopped.log")
    cmd = command(case)
    print("$", " ".join(shlex.quote(c) for c in cmd), flush=True)
    with open(log_path, "w") as out:
        mpirun = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    marker = f"step {args.signal_after}/{args.steps} "
    start = time.monotonic()
    while time.monotonic() - start < 120 and mpirun.poll() is None:
        if marker in open(log_path).read():
            break
        time.sleep(0.05)
    if mpirun.poll() is not None:
        check(False, f"{case}: the run ended (exit {mpirun.returncode}) before it was signalled")
        print(open(log_path).read())
        continue
    if case == "usr1-mpirun":
        mpirun.send_signal(signal.SIGUSR1)
        print(f"sent SIGUSR1 to mpirun ({mpirun.pid})", flush=True)
    else:
        ranks = children(mpirun.pid)
        check(len(ranks) == args.ranks, f"{case}: mpirun has {len(ranks)} child processes, expected {args.ranks}")
        if ranks:
            os.kill(ranks[-1], signal.SIGTERM)
            print(f"sent SIGTERM to one rank (pid {ranks[-1]} of {ranks})", flush=True)
    try:
        code = mpirun.wait(timeout=120)
    except subprocess.TimeoutExpired:
        mpirun.kill()
        code = mpirun.wait()
        check(False, f"{case}: the signalled run did not end within 120 s (a hang)")
    text = open(log_path).read()
    print(text, flush=True)
    check(code == EXIT_STOPPED, f"{case}: the signalled run exited {code}, expected {EXIT_STOPPED}")
    stops = re.findall(r"stopped at step (\d+) on a signal[^;]*; checkpoint written to (\S+); resume with --resume auto",
                       text)
    if not check(len(stops) == 1, f"{case}: {len(stops)} 'stopped at step K on a signal ...' lines, expected 1"):
        continue
    stopped_at, checkpoint = int(stops[0][0]), stops[0][1]
    check(args.signal_after <= stopped_at < args.steps,
          f"{case}: stopped at step {stopped_at}, expected between {args.signal_after} and {args.steps - 1}")
    check(os.path.isfile(checkpoint), f"{case}: the checkpoint {checkpoint} does not exist")
    check(os.path.dirname(os.path.abspath(checkpoint)) == os.path.join(folder, "checkpoints"),
          f"{case}: the checkpoint {checkpoint} is not in the --checkpoint-dir")
    check("tessera: error" not in text, f"{case}: an error was printed")

    code, text = run(case, "resumed.log", "--resume", "auto")
    if not check(code == 0, f"{case}: the resumed run exited {code}"):
        print(text)
        continue
    check(f"at step {stopped_at}" in text, f"{case}: the resumed run does not say it resumed at step {stopped_at}")
    steps, case_losses = losses(case)
    check(steps == ref_steps, f"{case}: the metrics have train rows for steps {steps}, expected each step once")
    final = final_loss(case)
    if args.timing_dependent:
        check(all(math.isfinite(x) for x in case_losses + [final]), f"{case}: a loss is not finite")
        print(f"{case}: stopped at step {stopped_at} with exit {EXIT_STOPPED}, resumed, final loss {final!r} "
              f"(not compared: the mode follows measured times)", flush=True)
        continue
    check(close(final, ref_final), f"{case}: final loss {final!r} differs from the uninterrupted {ref_final!r}")
    differ = [(s, a, b) for s, a, b in zip(steps, case_losses, ref_losses) if not close(a, b)]
    check(not differ, f"{case}: losses differ from the uninterrupted run at steps {differ[:5]}")
    identical = final == ref_final and case_losses == ref_losses
    print(f"{case}: stopped at step {stopped_at} with exit {EXIT_STOPPED}, resumed, final loss {final!r} "
          f"({'bit-identical to' if identical else 'within 1e-6 of'} the uninterrupted run)", flush=True)

exit_if_failed()
print("OK")
