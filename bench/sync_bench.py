#!/usr/bin/python3
"""Synchronization modes of replica groups compared on one training task: each mode's time and
steps to a target test accuracy, updates per second, bytes across groups, consensus distance,
AdaScale's gain and ssp's staleness, without and with an injected delay on every exchange across
groups and with injected stragglers. Prints one markdown table.

    python3 bench/sync_bench.py [--steps 2800] [--eval-every 100] [--target 0.9] [--delays 0,20ms]
                                [--stragglers none,slow:1:2x] [--modes bsp,local_sgd4,...]
                                [--preset stragglers] [--dataset fashion|cosmo] [--output FILE]

Every run is `mpirun -n RANKS tessera train` with a 1-rank plan, so RANKS ranks are RANKS replica
groups of one rank, each mode as `--sync MODE ...` (README: Synchronization; docs/sync.md):

    bsp            every gradient over all groups every step (the baseline of the ratios)
    local_sgd4     local_sgd, average every 4 steps          local_sgd16   the same, every 16
    post_local16   local_sgd every 16 steps, bsp for the first quarter of the steps (--sync-start)
    diloco16       diloco every 16 steps (outer Nesterov, lr 0.7, momentum 0.9 unless given)
    diloco64       the same, every 64 steps
    easgd4         easgd every 4 steps (alpha 0.9 / groups unless --easgd-alpha)
    gossip_ring    gossip on the ring, every step
    adascale       adascale (gradients over all groups, learning rate times the gain)
    ssp2           ssp, staleness 2 (--staleness)             ssp4          the same, staleness 4
    dssp1_8        dssp, its bound chosen in [1, 8] (--staleness-range)
    eager_solo     eager, a round fires with the first group (--quorum solo), staleness 4
    eager_majority eager, a round fires with more than half the groups (--quorum majority), staleness 4

--modes defaults to every mode but ssp2, ssp4, dssp1_8, eager_solo and eager_majority.

Runs are keyed by (mode, delay, straggler): every --delays value (--inject-comm-delay) with every
--stragglers value (--inject-straggler, docs/sync.md: Stragglers), e.g. slow:1:2x (group 1's steps
take 2x its compute), random:1:2x (each step one group drawn by the seed sleeps 2x its compute),
tail:10ms (every group sleeps an exponential delay of mean 10 ms each step); none (the default)
passes no --inject-straggler and keeps the folder names of runs without one. A spec with commas
(slow:1,2:2x) stays one entry: a piece that starts with a digit joins the one before it. Ratios
to bsp are within the same (delay, straggler). With a straggler, bsp's mean step is compared with
what waiting for the slowest group every step predicts from bsp's step without one, c: random:1:2x
(one group sleeps twice its compute each step) gives c + 2c = 3c; slow:1:2x gives 2c.

--preset stragglers: modes bsp,ssp2,ssp4,dssp1_8,eager_solo,eager_majority,local_sgd4, stragglers
none,slow:1:2x,random:1:2x, delays 0, 2800 steps and --work-dir runs/sync_bench_stragglers (folder names do not hold the
steps, so runs of other lengths in runs/sync_bench stay); those options given as well win:

    python3 bench/sync_bench.py --preset stragglers --resume --output runs/sync_bench_stragglers/table.md

AdaScale's claim is checked against a reference run of one group (one rank, bsp) at batch
--batch / RANKS with the same learning rate: RANKS groups at --batch should reach the target in
at most half the reference's steps. The reference runs once (--inject-comm-delay has nothing to
delay with one group) for --ref-steps (default twice --steps: a reference that has not reached the
target by then is slower than twice any run that reaches it within --steps).

Times to target count training only: every validation's own time is taken out of the clock
(`elapsed_s` of metrics.csv counts it). "wall s" is the whole mpirun, start-up and validations
included. "updates/s" is the steps over those training seconds. Bytes across groups are rank 0's
(every rank of a 1-rank-group job sends alike); so are ssp's staleness (the mean over the steps of
`staleness` in metrics.jsonl) and its seconds waited for the others (`sync_wait_s` of the last
training row), likewise for dssp and eager, with eager's groups per round (`contributors`, mean);
binaries older than ssp write neither, shown as "-".

--dataset fashion (the default): models/fashion_cnn.yaml on Fashion-MNIST (--data-dir with
train.h5 and test.h5; made with `tessera convert fashion-mnist` when missing), target a test
accuracy. --dataset cosmo: models/cosmoflow.yaml on `tessera generate cosmo --size 64` data (made
into --data-dir when missing), target a validation MSE (--cosmo-target-mse); the defaults for
CosmoFlow (steps, batch, optimizer, target) are guesses not yet tried at full length.
--resume reuses every run whose folder holds a summary.json of the same command.
"""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time

from driver_common import mpirun

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# name -> (tessera train options, what the table calls it); "{quarter}" is a quarter of the steps.
MODES = {
    "bsp": (["--sync", "bsp"], "bsp"),
    "local_sgd4": (["--sync", "local_sgd", "--sync-period", "4"], "local_sgd H=4"),
    "local_sgd16": (["--sync", "local_sgd", "--sync-period", "16"], "local_sgd H=16"),
    "post_local16": (["--sync", "local_sgd", "--sync-period", "16", "--sync-start", "{quarter}"],
                     "post-local H=16 from step {quarter}"),
    "diloco16": (["--sync", "diloco", "--sync-period", "16"], "diloco H=16"),
    "diloco64": (["--sync", "diloco", "--sync-period", "64"], "diloco H=64"),
    "easgd4": (["--sync", "easgd", "--sync-period", "4"], "easgd period 4"),
    "gossip_ring": (["--sync", "gossip", "--gossip-topology", "ring", "--sync-period", "1"], "gossip ring, every step"),
    "adascale": (["--sync", "adascale"], "adascale"),
    "ssp2": (["--sync", "ssp", "--staleness", "2"], "ssp s=2"),
    "ssp4": (["--sync", "ssp", "--staleness", "4"], "ssp s=4"),
    "dssp1_8": (["--sync", "dssp", "--staleness-range", "1:8"], "dssp [1, 8]"),
    "eager_solo": (["--sync", "eager", "--quorum", "solo"], "eager solo, s=4"),
    "eager_majority": (["--sync", "eager", "--quorum", "majority"], "eager majority, s=4"),
}
STRAGGLER_MODES = ("ssp", "dssp", "eager")
DEFAULT_MODES = [m for m in MODES if not m.startswith(STRAGGLER_MODES)]

# --preset NAME -> what it sets (options given on the command line win).
PRESETS = {
    "stragglers": dict(modes="bsp,ssp2,ssp4,dssp1_8,eager_solo,eager_majority,local_sgd4",
                       stragglers="none,slow:1:2x,random:1:2x", delays="0",
                       steps=2800, work_dir=os.path.join(ROOT, "runs", "sync_bench_stragglers")),
}
STRAGGLER_KINDS = ("slow", "random", "tail")

DATASETS = {
    # model, training file, validation file, defaults
    "fashion": dict(model="fashion_cnn.yaml", train="train.h5", val="test.h5", data_dir=os.path.join("data", "fashion-mnist"),
                    steps=2800, eval_every=100, eval_batch=1000, batch=64, optimizer="sgd", lr=0.05, momentum=0.9),
    "cosmo": dict(model="cosmoflow.yaml", train="train.h5", val="validation.h5", data_dir=os.path.join("data", "cosmo64"),
                  steps=640, eval_every=32, eval_batch=16, batch=16, optimizer="adam", lr=0.0003, momentum=0.0),
}

PLAN_1RANK = "ranks: 1\ndefault: {sample: 1}\n"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=sorted(DATASETS), default="fashion")
    p.add_argument("--steps", type=int, help="training steps of every run (fashion: 2800, about 3 epochs at batch 64; "
                   "cosmo: 640)")
    p.add_argument("--eval-every", type=int, help="validate every N steps (fashion: 100; cosmo: 32)")
    p.add_argument("--eval-batch", type=int, help="validation batch (fashion: 1000; cosmo: 16)")
    p.add_argument("--target", type=float, default=0.9, help="fashion: target test accuracy (0.9)")
    p.add_argument("--cosmo-target-mse", type=float, default=0.05, help="cosmo: target validation MSE (0.05, a guess)")
    p.add_argument("--delays", help="comma-separated --inject-comm-delay values; 0: none (0,20ms)")
    p.add_argument("--stragglers", help="comma-separated --inject-straggler specs, e.g. slow:1:2x, random:1:2x, "
                   "tail:10ms; none: no straggler (none)")
    p.add_argument("--modes", help="comma-separated subset of: " + ", ".join(MODES) + " (all but ssp2, ssp4, dssp1_8, eager_solo, "
                   "eager_majority)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="stragglers: modes bsp,ssp2,ssp4,dssp1_8,eager_solo,eager_majority,"
                   "local_sgd4, stragglers none,slow:1:2x,random:1:2x, delays 0, 2800 steps, work dir runs/sync_bench_stragglers (options "
                   "given as well win)")
    p.add_argument("--no-reference", action="store_true", help="leave out adascale's 1-group reference run")
    p.add_argument("--ref-steps", type=int, help="steps of the 1-group reference (default: 2 x --steps)")
    p.add_argument("--ranks", type=int, default=4, help="ranks = replica groups (4)")
    p.add_argument("--batch", type=int, help="global batch of the multi-group runs (fashion: 64; cosmo: 16)")
    p.add_argument("--optimizer", help="sgd, adam or adamw (fashion: sgd; cosmo: adam)")
    p.add_argument("--lr", type=float, help="learning rate, the same for every run (fashion: 0.05; cosmo: 0.0003)")
    p.add_argument("--momentum", type=float, help="SGD momentum (fashion: 0.9)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--outer-optimizer", help="diloco: sgd or nesterov (Tessera's default: nesterov)")
    p.add_argument("--outer-lr", type=float, help="diloco's outer learning rate (Tessera's default: 0.7)")
    p.add_argument("--outer-momentum", type=float, help="diloco's outer momentum (Tessera's default: 0.9)")
    p.add_argument("--easgd-alpha", type=float, help="easgd's elastic pull (Tessera's default: 0.9 / groups)")
    p.add_argument("--threads", type=int, help="threads per rank (default: Tessera's, the node's cores / its ranks)")
    p.add_argument("--data-dir", help="folder with the data (fashion: data/fashion-mnist; cosmo: data/cosmo64); "
                   "made when missing")
    p.add_argument("--cosmo-train", type=int, default=1024, help="cosmo: training samples to generate (1024)")
    p.add_argument("--cosmo-validation", type=int, default=128, help="cosmo: validation samples to generate (128)")
    p.add_argument("--work-dir", help="folder for the plan and every run's metrics and log (runs/sync_bench; "
                   "--preset stragglers: runs/sync_bench_stragglers)")
    p.add_argument("--tessera", default=os.path.join(ROOT, "build", "bin", "tessera"))
    p.add_argument("--mpirun", default="mpirun", help="the mpirun program (Open MPI's options are used)")
    p.add_argument("--resume", action="store_true", help="reuse runs already done with the same command")
    p.add_argument("--output", help="also write the table (with its heading) into this file")
    args = p.parse_args()

    preset = PRESETS[args.preset] if args.preset else {}
    defaults = dict(modes=",".join(DEFAULT_MODES), stragglers="none", delays="0,20ms",
                    work_dir=os.path.join(ROOT, "runs", "sync_bench"))
    for key, value in dict(defaults, **preset).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    d = DATASETS[args.dataset]
    for key in ("steps", "eval_every", "eval_batch", "batch", "optimizer", "lr", "momentum"):
        if getattr(args, key) is None:
            setattr(args, key, d[key])
    if args.data_dir is None:
        args.data_dir = os.path.join(ROOT, d["data_dir"])
    if args.ref_steps is None:
        args.ref_steps = 2 * args.steps
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    args.delays = [x.strip() for x in args.delays.split(",") if x.strip()]
    args.stragglers = split_stragglers(args.stragglers)
    unknown = [x for x in args.stragglers if not no_straggler(x) and x.split(":")[0] not in STRAGGLER_KINDS]
    if unknown:
        p.error(f"unknown straggler spec(s) {', '.join(unknown)}; known: none, "
                + ", ".join(f"{k}:..." for k in STRAGGLER_KINDS))
    if not args.delays or not args.stragglers or not args.modes:
        p.error("--modes, --delays and --stragglers need at least one value each")
    if args.ranks < 2:
        p.error("--ranks must be at least 2 (one replica group has nothing to synchronize)")
    if args.batch % args.ranks:
        p.error(f"--batch {args.batch} must be a multiple of --ranks {args.ranks} (the reference runs batch / ranks)")
    if args.steps < 1 or args.eval_every < 1:
        p.error("--steps and --eval-every must be positive")
    args.tessera = os.path.abspath(args.tessera)
    args.work_dir = os.path.abspath(args.work_dir)
    args.data_dir = os.path.abspath(args.data_dir)
    return args


def no_delay(delay):
    return delay in ("0", "none", "0ms", "0s")


def no_straggler(straggler):
    return straggler is None or straggler in ("", "none")


def split_stragglers(text):
    """The comma-separated specs; a piece that starts with a digit (the 2:2x of slow:1,2:2x) joins the one before."""
    specs = []
    for piece in (x.strip() for x in text.split(",")):
        if not piece:
            continue
        if specs and piece[0].isdigit():
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs


def seconds_of(text):
    """Seconds of a duration such as 50ms or 0.1s (None when not one)."""
    for unit, factor in (("ms", 1e-3), ("s", 1.0)):
        if text.endswith(unit):
            try:
                return float(text[:-len(unit)]) * factor
            except ValueError:
                return None
    return None


def expected_bsp_step(straggler, c, groups):
    """bsp's expected step under `straggler` from its step without one, c: every step waits for the
    slowest group, whose sleep comes on top of c. (seconds, the formula) or None."""
    kind, _, rest = straggler.partition(":")
    parts = rest.split(":")
    try:
        if kind == "slow" and len(parts) == 2 and parts[1].endswith("x"):
            f = float(parts[1][:-1])
            return f * c, f"{f:g}c (the slow group's steps take {f:g}x its compute, taken as c)"
        if kind == "random" and len(parts) == 2 and parts[1].endswith("x"):
            f = float(parts[1][:-1])
            return (1 + f) * c, (f"c + {f:g}c = {1 + f:g}c (each step a delayed group sleeps {f:g}x its compute, "
                                 f"taken as c)")
        if kind == "random" and len(parts) == 2 and seconds_of(parts[1]) is not None:
            return c + seconds_of(parts[1]), f"c + {parts[1]}"
        if kind == "tail" and len(parts) == 1 and seconds_of(parts[0]) is not None:
            harmonic = sum(1 / k for k in range(1, groups + 1))
            return (c + seconds_of(parts[0]) * harmonic,
                    f"c + {parts[0]} x H_{groups} = c + {parts[0]} x {harmonic:.3g} (the mean of the largest of "
                    f"{groups} exponential sleeps)")
    except ValueError:
        return None
    return None


def launcher(args, procs):
    command = mpirun(procs)
    command[0] = args.mpirun
    return command


def ensure_data(args):
    """The training and validation files, made when missing (the Fashion-MNIST copy that the CLI
    tests convert into the build tree is used when there is one)."""
    d = DATASETS[args.dataset]
    train, val = os.path.join(args.data_dir, d["train"]), os.path.join(args.data_dir, d["val"])
    if os.path.exists(train) and os.path.exists(val):
        return train, val
    if args.dataset == "fashion":
        tests_copy = os.path.join(os.path.dirname(os.path.dirname(args.tessera)), "tests", "cli", "data", "fmnist")
        if all(os.path.exists(os.path.join(tests_copy, f)) for f in (d["train"], d["val"])):
            return os.path.join(tests_copy, d["train"]), os.path.join(tests_copy, d["val"])
        command = [args.tessera, "convert", "fashion-mnist", "--output", args.data_dir]
        procs = None
    else:
        command = launcher(args, args.ranks) + [args.tessera, "generate", "cosmo", "--output", args.data_dir,
                                                "--train", str(args.cosmo_train), "--validation",
                                                str(args.cosmo_validation), "--size", "64", "--seed", str(args.seed)]
        procs = args.ranks
    print(f"making the data: {' '.join(command)}", file=sys.stderr)
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0 or not (os.path.exists(train) and os.path.exists(val)):
        sys.exit(f"could not make the data ({result.returncode}{', ' + str(procs) + ' ranks' if procs else ''}): "
                 f"{' '.join(command)}\n{result.stdout}")
    return train, val


class Run:
    """One training run: its command, and what its metrics say once done."""

    def __init__(self, key, label, delay, straggler, procs, batch, steps, sync_options):
        self.key, self.label, self.delay, self.straggler = key, label, delay, straggler
        self.procs, self.batch, self.steps, self.sync_options = procs, batch, steps, sync_options
        self.error = None
        self.wall = None
        self.summary = {}
        self.validation = []  # (step, accuracy or None, loss, training seconds so far)
        self.train_rows = []
        self.validating = 0.0
        self.staleness = []    # ssp: per training row of metrics.jsonl (absent from older binaries)
        self.sync_wait = None  # ssp: sync_wait_s of the last training row (seconds waited so far)
        self.contributors = []  # eager: groups whose gradients are in each update

    def folder(self, args):
        name = self.key if self.delay is None else f"{self.key}_{'nodelay' if no_delay(self.delay) else self.delay}"
        if not no_straggler(self.straggler):  # runs without one keep their names (--resume)
            name += "_" + self.straggler.replace(":", "-").replace(",", "+")
        return os.path.join(args.work_dir, args.dataset, name)

    def command(self, args, plan, train, val, metrics_dir):
        command = launcher(args, self.procs) + [args.tessera]
        if args.threads:
            command += ["--threads", str(args.threads)]
        command += ["train", "--model", os.path.join(ROOT, "models", DATASETS[args.dataset]["model"]), "--plan", plan,
                    "--data", train, "--val-data", val, "--batch", str(self.batch), "--steps", str(self.steps),
                    "--epochs", "1000",  # --steps ends the run
                    "--eval-every", str(args.eval_every), "--eval-batch", str(args.eval_batch),
                    "--optimizer", args.optimizer, "--lr", repr(args.lr), "--seed", str(args.seed)]
        if args.optimizer == "sgd" and args.momentum:
            command += ["--momentum", repr(args.momentum)]
        command += self.sync_options
        if self.delay is not None and not no_delay(self.delay):
            command += ["--inject-comm-delay", self.delay]
        if not no_straggler(self.straggler):
            command += ["--inject-straggler", self.straggler]
        return command + ["--metrics-dir", metrics_dir]

    def execute(self, args, plan, train, val):
        folder = self.folder(args)
        os.makedirs(folder, exist_ok=True)
        command = self.command(args, plan, train, val, folder)
        text = " ".join(command)
        done = os.path.join(folder, "command.txt")
        summary = os.path.join(folder, "summary.json")
        if args.resume and os.path.exists(summary) and os.path.exists(done):
            with open(done) as f:
                saved = json.load(f)
            if saved.get("command") == text:
                self.wall = saved.get("wall_s")
                print(f"reusing {self.label} ({self.setting_text()}): {folder}", file=sys.stderr)
                self.read(folder)
                return
        for stale in ("summary.json", "metrics.csv", "metrics.jsonl", "command.txt"):
            if os.path.exists(os.path.join(folder, stale)):
                os.remove(os.path.join(folder, stale))
        print(f"running {self.label} ({self.setting_text()}): {text}", file=sys.stderr, flush=True)
        start = time.monotonic()
        with open(os.path.join(folder, "log.txt"), "w") as log:
            result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, text=True)
        self.wall = time.monotonic() - start
        if result.returncode != 0:
            self.error = f"failed (exit {result.returncode}; {os.path.join(folder, 'log.txt')})"
            print(f"  {self.error}", file=sys.stderr)
            return
        with open(done, "w") as f:
            json.dump({"command": text, "wall_s": self.wall}, f)
        self.read(folder)

    def read(self, folder):
        try:
            with open(os.path.join(folder, "summary.json")) as f:
                self.summary = json.load(f)
            with open(os.path.join(folder, "metrics.csv")) as f:
                rows = list(csv.DictReader(f))
        except (OSError, ValueError) as e:
            self.error = f"no metrics ({e})"
            return
        validating = 0.0  # validation time so far, taken out of the clock
        previous = 0.0    # elapsed_s of the row before
        for row in rows:
            elapsed = float(row["elapsed_s"])
            if row["kind"] == "validation":
                accuracy = float(row["accuracy"]) if row["accuracy"] else None
                self.validation.append((int(row["step"]), accuracy, float(row["loss"]), previous - validating))
                validating += elapsed - previous
            elif row["kind"] == "train":
                self.train_rows.append(row)
            previous = elapsed
        self.validating = validating
        last = {}
        try:
            with open(os.path.join(folder, "metrics.jsonl")) as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    if row.get("kind") != "train":
                        continue
                    last = row
                    if row.get("staleness") is not None:
                        self.staleness.append(float(row["staleness"]))
                    if row.get("contributors") is not None:
                        self.contributors.append(float(row["contributors"]))
        except OSError:
            pass
        if last.get("sync_wait_s") is not None:
            self.sync_wait = float(last["sync_wait_s"])

    def delay_text(self):
        return "-" if self.delay is None else ("none" if no_delay(self.delay) else self.delay)

    def straggler_text(self):
        return "-" if self.delay is None else ("none" if no_straggler(self.straggler) else self.straggler)

    def setting_text(self):
        if no_straggler(self.straggler):
            return self.delay_text()
        return f"{self.delay_text()}, straggler {self.straggler}"

    def train_seconds(self):
        """The run's own clock less its validations (None without a summary)."""
        return self.summary["seconds"] - self.validating if "seconds" in self.summary else None

    def updates_per_second(self):
        seconds = self.train_seconds()
        return self.summary.get("steps", self.steps) / seconds if seconds else None

    def mean_step(self):
        seconds = self.train_seconds()
        return seconds / self.summary.get("steps", self.steps) if seconds is not None else None

    def reached(self, args):
        """(steps, training seconds) at the first validation that meets the target, or None."""
        for step, accuracy, loss, seconds in self.validation:
            if args.dataset == "fashion" and accuracy is not None and accuracy >= args.target:
                return step, seconds
            if args.dataset == "cosmo" and loss <= args.cosmo_target_mse:
                return step, seconds
        return None

    def final_quality(self, args):
        if args.dataset == "fashion":
            v = self.summary.get("val_accuracy")
            return "-" if v is None else f"{100 * v:.2f}%"
        v = self.summary.get("val_loss")
        return "-" if v is None else f"{v:.4g}"

    def most_consensus(self):
        """The largest consensus distance measured (before each sync and at each validation)."""
        values = [float(r["consensus"]) for r in self.train_rows if r["consensus"]]
        if self.summary.get("consensus") is not None:
            values.append(self.summary["consensus"])
        return max(values) if values else None

    def gains(self):
        return [float(r["gain"]) for r in self.train_rows if r["gain"]]


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table(args, runs, reference):
    target = f"test accuracy >= {100 * args.target:g}%" if args.dataset == "fashion" else \
        f"validation MSE <= {args.cosmo_target_mse:g}"
    model = DATASETS[args.dataset]["model"]
    lines = [f"# Synchronization modes: {model}, {args.ranks} replica groups of 1 rank, global batch {args.batch}, "
             f"{args.steps} steps, {args.optimizer} lr {args.lr:g}"
             + (f" momentum {args.momentum:g}" if args.optimizer == "sgd" and args.momentum else "")
             + f"; target {target}, validated every {args.eval_every} steps", ""]
    quality = "final test acc." if args.dataset == "fashion" else "final val. MSE"
    lines.append(f"| delay | straggler | mode | wall s | train s | updates/s | updates/s vs bsp | steps to target | "
                 f"train s to target | speed-up vs bsp | steps vs bsp | {quality} | MB across groups, rank 0 | "
                 f"bytes vs bsp | consensus end | consensus max | gain end (mean) | staleness (mean) | sync wait s | "
                 f"groups per update (mean) |")
    lines.append("|" + "---|" * 20)
    for setting, group in runs:
        base = next((r for r in group if r.key == "bsp" and not r.error), None)
        base_hit = base.reached(args) if base else None
        base_bytes = base.summary.get("cross_group_bytes") if base else None
        base_rate = base.updates_per_second() if base else None
        rows = list(group)
        if reference is not None and setting == runs[0][0]:
            rows.append(reference)
        for r in rows:
            if r.error:
                lines.append(f"| {r.delay_text()} | {r.straggler_text()} | {r.label} | {fmt(r.wall, '.0f')} | "
                             f"{r.error} |" + " |" * 15)
                continue
            s = r.summary
            hit = r.reached(args)
            steps_to = f"{hit[0]}" if hit else f"not reached ({r.steps})"
            secs_to = f"{hit[1]:.1f}" if hit else "-"
            speedup = steps_ratio = bytes_ratio = "-"
            if r is not reference and r is not base and hit and base_hit:
                speedup = f"{base_hit[1] / hit[1]:.2f}x" if hit[1] > 0 else "-"
                steps_ratio = f"{hit[0] / base_hit[0]:.2f}"
            elif r is base and hit:
                speedup, steps_ratio = "1.00x", "1.00"
            nbytes = s.get("cross_group_bytes")
            if r is not reference and base_bytes and nbytes is not None:
                bytes_ratio = f"{nbytes / base_bytes:.3f}"
            gains = r.gains()
            gain = f"{s.get('gain', 1):.3g} ({statistics.mean(gains):.3g})" if gains else fmt(s.get("gain"), ".3g")
            rate = r.updates_per_second()
            rate_ratio = "-"
            if r is not reference and rate and base_rate:
                rate_ratio = f"{rate / base_rate:.2f}"
            stale = r.key.startswith(STRAGGLER_MODES)
            staleness = fmt(statistics.mean(r.staleness) if stale and r.staleness else None, ".2f")
            wait = fmt(r.sync_wait if stale else None, ".3g")
            eager = r.key.startswith("eager")
            groups = fmt(statistics.mean(r.contributors) if eager and r.contributors else None, ".2f")
            lines.append(f"| {r.delay_text()} | {r.straggler_text()} | {r.label} | {fmt(r.wall, '.0f')} | "
                         f"{fmt(r.train_seconds(), '.1f')} | {fmt(rate, '.1f')} | {rate_ratio} | {steps_to} | "
                         f"{secs_to} | {speedup} | {steps_ratio} | {r.final_quality(args)} | "
                         f"{fmt(nbytes / 1e6 if nbytes is not None else None, '.1f')} | {bytes_ratio} | "
                         f"{fmt(s.get('consensus'), '.3g')} | {fmt(r.most_consensus(), '.3g')} | {gain} | "
                         f"{staleness} | {wait} | {groups} |")
    lines.append("")
    lines.append("train s: the run's own clock less its validations; updates/s: steps over train s; ratios to bsp "
                 "(updates/s, speed-up, steps, bytes) are within the same delay and straggler; speed-up: bsp's "
                 "training seconds to the target over the mode's; steps vs bsp: the mode's steps to target over "
                 "bsp's; consensus: ||x_g - mean|| / ||mean|| over groups, at the end (the last validation) and the "
                 "largest measured (before every sync and at validations; gossip: at validations only); gain: "
                 "AdaScale's at the last step (mean over the steps); staleness (ssp, dssp, eager): how many steps "
                 "late the oldest gradient in an update was, mean over the steps; sync wait s: rank 0's seconds "
                 "waiting for the other groups, in all; groups per update (eager): how many groups' gradients a "
                 "round summed, mean over the steps.")
    expectations = []
    for (delay, straggler), group in runs:
        bsp = next((r for r in group if r.key == "bsp" and not r.error), None)
        if no_straggler(straggler) or bsp is None or bsp.mean_step() is None:
            continue
        clean = next((g for (d, x), g in runs if d == delay and no_straggler(x)), [])
        plain = next((r for r in clean if r.key == "bsp" and not r.error), None)
        setting = f"bsp under {straggler}, delay {bsp.delay_text()}"
        if plain is None or plain.mean_step() is None:
            expectations.append(f"{setting}: mean step {1e3 * bsp.mean_step():.2f} ms; no bsp run without a "
                                f"straggler at this delay to compare with.")
            continue
        c = plain.mean_step()
        expected = expected_bsp_step(straggler, c, args.ranks)
        if expected is None:
            expectations.append(f"{setting}: mean step {1e3 * bsp.mean_step():.2f} ms against {1e3 * c:.2f} ms "
                                f"without a straggler (no expectation for this spec).")
            continue
        value, formula = expected
        expectations.append(f"{setting}: mean step {1e3 * bsp.mean_step():.2f} ms measured against "
                            f"{1e3 * value:.2f} ms expected = {formula}, c = {1e3 * c:.2f} ms (bsp's mean step "
                            f"without a straggler; every step waits for the slowest group): measured / expected "
                            f"{bsp.mean_step() / value:.2f}.")
    if expectations:
        lines.append("")
        lines.extend(expectations)
    if reference is not None:
        lines.append("")
        ref_hit = None if reference.error else reference.reached(args)
        for _, group in runs:
            ada = next((r for r in group if r.key == "adascale" and not r.error), None)
            if ada is None:
                continue
            hit = ada.reached(args)
            if reference.error:
                verdict = "reference failed"
            elif hit is None:
                verdict = f"adascale did not reach the target in {ada.steps} steps"
            elif ref_hit is None:
                verdict = (f"adascale {hit[0]} steps; the reference did not reach it in {reference.steps} steps, so the "
                           f"ratio is below {hit[0] / reference.steps:.2f}: claim (<= 0.5) "
                           + ("holds" if hit[0] / reference.steps <= 0.5 else "undecided"))
            else:
                ratio = hit[0] / ref_hit[0]
                verdict = (f"adascale {hit[0]} steps against the reference's {ref_hit[0]}: ratio {ratio:.2f}, claim "
                           f"(<= 0.5) " + ("holds" if ratio <= 0.5 else "fails"))
            lines.append(f"AdaScale, delay {ada.setting_text()}: {args.ranks} groups at batch {args.batch} against 1 "
                         f"group at batch {reference.batch}, same lr: {verdict}.")
    return "\n".join(lines)


def main():
    args = parse_args()
    if not os.path.exists(args.tessera):
        sys.exit(f"no Tessera binary at {args.tessera} (--tessera)")
    train, val = ensure_data(args)
    os.makedirs(os.path.join(args.work_dir, args.dataset), exist_ok=True)
    plan = os.path.join(args.work_dir, "plan_1rank.yaml")
    with open(plan, "w") as f:
        f.write(PLAN_1RANK)

    quarter = str(args.steps // 4)
    runs = []  # ((delay, straggler), the runs of that setting)
    for delay in args.delays:
        for straggler in args.stragglers:
            group = []
            for key in args.modes:
                options, label = MODES[key]
                options = [o.replace("{quarter}", quarter) for o in options]
                if key.startswith("diloco"):
                    for flag, value in (("--outer-optimizer", args.outer_optimizer), ("--outer-lr", args.outer_lr),
                                        ("--outer-momentum", args.outer_momentum)):
                        if value is not None:
                            options += [flag, str(value)]
                if key.startswith("easgd") and args.easgd_alpha is not None:
                    options += ["--easgd-alpha", str(args.easgd_alpha)]
                group.append(Run(key, label.replace("{quarter}", quarter), delay, straggler, args.ranks, args.batch,
                                 args.steps, options))
            runs.append(((delay, straggler), group))
    reference = None
    if "adascale" in args.modes and not args.no_reference:
        reference = Run("reference_1group", f"1-group reference, batch {args.batch // args.ranks}", None, None, 1,
                        args.batch // args.ranks, args.ref_steps, ["--sync", "bsp"])

    for _, group in runs:
        for r in group:
            r.execute(args, plan, train, val)
    if reference is not None:
        reference.execute(args, plan, train, val)

    text = table(args, runs, reference)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    failed = [r for _, g in runs for r in g] + ([reference] if reference else [])
    if any(r.error for r in failed):
        sys.exit(1)


if __name__ == "__main__":
    main()
