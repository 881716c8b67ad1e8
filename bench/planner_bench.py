#!/usr/bin/python3
r"""The planner against measured runs on this machine: for the Fashion-MNIST CNN and the 64^3
CosmoFlow model at 1-4 ranks, the planner's plan, the pure batch / spatial / model plans it
compares with (`tessera plan --explain`) and forced hybrid plans (sample x spatial, spatial x
filter, filter x channel; --no-hybrid leaves them out), each priced by the cost model (`tessera plan
--evaluate`) and measured (bench_train, same run; each repeat a round over every plan of every
case, so that a slow minute of the machine costs one run of many plans). Prints a table of predicted
against measured step time, and whether the planner's choice was as fast as the best of the other
plans (within the run-to-run spread).

    /usr/bin/python3 bench/planner_bench.py --machine machines/local.yaml [--repeats 3]

The machine file should come from `tessera calibrate` on this machine with the kernels of both
models at the batches used here, each rank count timed with that many ranks running together
(machines/dev_vm_2core.yaml was made so):

    mpirun -n 2 --bind-to none build/bin/tessera calibrate -o machines/local.yaml
    for P in 1 2 3 4; do
      mpirun -n $P --bind-to none --oversubscribe build/bin/tessera calibrate --base machines/local.yaml \
          --model models/fashion_cnn.yaml --batch 64 --ranks $P -o machines/local.yaml
      mpirun -n $P --bind-to none --oversubscribe build/bin/tessera calibrate --base machines/local.yaml \
          --model models/cosmoflow.yaml --batch 4 --ranks $P -o machines/local.yaml
    done

A VM's speed drifts over minutes, and one calibration is a sample of one moment: run the
commands above three times, some minutes apart, into three files, and merge them
(machines/dev_vm_2core_epyc_zen5.yaml was made so):

    build/bin/tessera calibrate --merge a.yaml b.yaml c.yaml -o machines/local.yaml

Runs use the planner's threads per rank (the node's cores over the ranks, at least 1), as
`tessera train` does.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

from driver_common import mpirun, run

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MODELS = [
    # name, model file, global batch, timed steps, warm-up steps
    ("fashion", "fashion_cnn.yaml", 64, 40, 10),
    ("cosmoflow", "cosmoflow.yaml", 4, 3, 1),
]


# Forced hybrid plans, priced and measured beside the planner's and the pure ones: per model and
# rank count, label -> (default split, {layer: split}). The planner rarely picks a hybrid plan on
# this machine; these check the cost model where it prices one.
FASHION_CONV = ["conv1", "relu1", "pool1"], ["conv2", "relu2", "pool2"]
COSMO_CONV = [[f"conv{i}", f"act{i}", f"pool{i}"] for i in range(1, 6)]


def hybrid_plans(name, procs):
    def each(layers, split):
        return {layer: split for layer in layers}

    plans = {}
    if name == "fashion":
        first, second = FASHION_CONV
        if procs == 4:
            plans["sample x spatial"] = ("{sample: 4}", {**each(first + second, "{sample: 2, spatial: [2, 1]}")})
            plans["spatial x filter"] = ("{sample: 4}", {**each(first, "{sample: 1, spatial: [2, 2]}"),
                                                         **each(second, "{sample: 1, spatial: [1, 4]}"),
                                                         **each(["fc1", "relu3"], "{sample: 1, filter: 4}")})
            plans["filter x channel"] = ("{sample: 4}", {**each(["conv1", "relu1"], "{sample: 2, filter: 2}"),
                                                         "conv2": "{sample: 1, filter: 2, channel: 2}",
                                                         "fc1": "{sample: 1, channel: 4}"})
        elif procs > 1:
            plans["spatial x filter"] = ("{sample: %d}" % procs,
                                         {**each(first, "{sample: 1, spatial: [%d, 1]}" % procs),
                                          **each(second, "{sample: 1, spatial: [1, %d]}" % procs),
                                          **each(["fc1", "relu3"], "{sample: 1, filter: %d}" % procs)})
            plans["filter x channel"] = ("{sample: %d}" % procs,
                                         {**each(["conv1", "relu1"], "{sample: 1, filter: %d}" % procs),
                                          "conv2": "{sample: 1, channel: %d}" % procs,
                                          **each(["fc1", "relu3"], "{sample: 1, filter: %d}" % procs)})
    elif name == "cosmoflow":
        if procs == 4:
            plans["sample x spatial"] = ("{sample: 4}", {l: "{sample: 2, spatial: [2, 1, 1]}" for b in COSMO_CONV[:3] for l in b})
            plans["spatial x filter"] = ("{sample: 4}", {**{l: "{sample: 1, spatial: [2, 2, 1]}" for b in COSMO_CONV[:3] for l in b},
                                                         **each(["fc1", "act6"], "{sample: 1, filter: 4}")})
            plans["filter x channel"] = ("{sample: 4}", {**each(["conv3", "act3"], "{sample: 2, filter: 2}"),
                                                         "conv4": "{sample: 1, filter: 2, channel: 2}",
                                                         "conv5": "{sample: 2, channel: 2}"})
        elif procs == 2:
            plans["spatial x filter"] = ("{sample: 2}", {**{l: "{sample: 1, spatial: [2, 1, 1]}" for b in COSMO_CONV[:2] for l in b},
                                                         **each(["fc1", "act6"], "{sample: 1, filter: 2}")})
            plans["filter x channel"] = ("{sample: 2}", {**each(["conv3", "act3"], "{sample: 1, filter: 2}"),
                                                         "conv4": "{sample: 1, channel: 2}",
                                                         **each(["fc1", "act6"], "{sample: 1, filter: 2}")})
    return plans


def write_plan(path, procs, default, layers):
    with open(path, "w") as f:
        f.write(f"ranks: {procs}\ndefault: {default}\nlayers:\n")
        for layer, split in layers.items():
            f.write(f"  {layer}: {split}\n")


def tessera_plan(build, *args):
    result = subprocess.run([os.path.join(build, "bin", "tessera"), "plan", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        sys.exit(f"tessera plan {' '.join(args)} failed:\n{result.stdout}")
    return result.stdout


def predicted(text):
    return 1e3 * float(re.search(r"predicted step ([0-9.eE+-]+) s", text).group(1))


def measure(build, model, procs, plan, batch, steps, warmup, threads):
    # Waiting ranks yield their core: with more ranks than cores (3 and 4 ranks here) a rank that
    # busy-polls in MPI would take the core from one that computes.
    command = mpirun(procs, "--mca", "mpi_yield_when_idle", "1") + [os.path.join(build, "bin", "bench_train"), "--model", model, "--batch", str(batch),
                               "--steps", str(steps), "--warmup", str(warmup), "--threads", str(threads),
                               "--lr", "0.0001"]
    if plan:
        command += ["--plan", plan]
    return run(command)["step_ms"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--machine", default=os.path.join(ROOT, "machines", "local.yaml"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", default="1,2,3,4")
    parser.add_argument("--models", default="fashion,cosmoflow")
    parser.add_argument("--cores", type=int, default=os.cpu_count())
    parser.add_argument("--no-hybrid", dest="hybrid", action="store_false",
                        help="leave out the forced hybrid plans (sample x spatial, spatial x filter, filter x channel)")
    args = parser.parse_args()
    if not os.path.exists(args.machine):
        sys.exit(f"no machine file {args.machine}: write one with tessera calibrate (see --help)")

    rows = []
    verdicts = []
    with tempfile.TemporaryDirectory() as tmp:
        # Every case's plans, priced; then the repeats, each a round over all cases, so that a slow
        # minute of the machine costs one run of many plans (which the median discards) rather than
        # every run of a few.
        cases = []
        for name, model_file, batch, steps, warmup in MODELS:
            if name not in args.models.split(","):
                continue
            model = os.path.join(ROOT, "models", model_file)
            for procs in (int(p) for p in args.ranks.split(",")):
                threads = max(1, args.cores // procs)
                folder = os.path.join(tmp, f"{name}_{procs}")
                os.makedirs(folder)
                chosen = os.path.join(folder, "planner.yaml")
                common = ["--model", model, "--ranks", str(procs), "--batch", str(batch), "--machine", args.machine]
                tessera_plan(args.build, *common, "--explain", "--references-dir", folder, "-o", chosen)
                plans = {"planner": chosen}
                for ref in ("pure_batch", "pure_spatial", "pure_model"):
                    path = os.path.join(folder, ref + ".yaml")
                    if os.path.exists(path):
                        plans[ref.replace("_", " ")] = path
                if args.hybrid:
                    for label, (default, layers) in hybrid_plans(name, procs).items():
                        path = os.path.join(folder, label.replace(" ", "_") + ".yaml")
                        write_plan(path, procs, default, layers)
                        plans[label] = path
                # The same plan under two names is measured once.
                texts = {}
                for label, path in list(plans.items()):
                    body = "".join(l for l in open(path) if not l.startswith("#"))
                    if body in texts.values():
                        same = next(k for k, v in texts.items() if v == body)
                        plans[label] = same
                    else:
                        texts[label] = body
                prediction = {label: predicted(tessera_plan(args.build, *common, "--evaluate", plans[label]))
                              for label in texts}
                cases.append(dict(name=name, model=model, procs=procs, batch=batch, steps=steps, warmup=warmup,
                                  threads=threads, plans=plans, texts=texts, prediction=prediction,
                                  times={label: [] for label in texts}))
        for _ in range(args.repeats):
            for case in cases:
                for label in case["texts"]:
                    case["times"][label].append(measure(args.build, case["model"], case["procs"], case["plans"][label],
                                                        case["batch"], case["steps"], case["warmup"], case["threads"]))
        for case in cases:
            name, procs, plans, texts, times = case["name"], case["procs"], case["plans"], case["texts"], case["times"]
            for label in plans:
                key = label if label in texts else plans[label]  # a duplicate names the plan it repeats
                t = times[key]
                rows.append((name, procs, label + ("" if label in texts else f" (= {key})"), case["prediction"][key],
                             statistics.median(t), min(t), max(t)))
            best_ref = min((statistics.median(times[l]), l) for l in texts if l != "planner") if len(texts) > 1 else None
            mine = times["planner"]
            if best_ref:
                ref_times = times[best_ref[1]]
                spread = max(max(mine) - min(mine), max(ref_times) - min(ref_times))
                ok = statistics.median(mine) <= best_ref[0] + spread
                verdicts.append((name, procs, statistics.median(mine), best_ref[1], best_ref[0], spread, ok))

    print(f"Planner vs measured on this machine ({args.machine}), {args.repeats} runs each (median, min-max)")
    print(f"{'model':>10} {'ranks':>5} {'plan':<28} {'predicted ms':>12} {'measured ms':>12} {'min-max':>17} {'error':>7}")
    errors = []
    for name, procs, label, pred, med, lo, hi in rows:
        err = (pred - med) / med
        if "(=" not in label:
            errors.append(abs(err))
        print(f"{name:>10} {procs:>5} {label:<28} {pred:>12.2f} {med:>12.2f} {lo:>8.2f}-{hi:<8.2f} {100 * err:>6.1f}%")
    within = sum(1 for e in errors if e <= 0.20)
    signed = [(pred - med) / med for _, _, label, pred, med, _, _ in rows if "(=" not in label]
    print(f"\n{within} of {len(errors)} distinct plans predicted within +-20% of measured "
          f"(median |error| {100 * statistics.median(errors):.1f}%, largest {100 * max(errors):.1f}%; "
          f"{sum(1 for e in signed if e < 0)} under, {sum(1 for e in signed if e > 0)} over)")
    hybrid = [abs(pred - med) / med for _, _, label, pred, med, _, _ in rows if " x " in label and "(=" not in label]
    if hybrid:
        print(f"forced hybrid plans: {sum(1 for e in hybrid if e <= 0.20)} of {len(hybrid)} within +-20% "
              f"(median |error| {100 * statistics.median(hybrid):.1f}%, largest {100 * max(hybrid):.1f}%)")
    # The 1-rank plans exchange nothing and wait for nobody: their error is the machine's speed now
    # against its speed when calibrated.
    solo = [(pred - med) / med for _, procs, label, pred, med, _, _ in rows if procs == 1 and "(=" not in label]
    if solo:
        drift = any(abs(e) > 0.10 for e in solo)
        print(f"1-rank plans (no exchanges): {', '.join(f'{100 * e:+.1f}%' for e in solo)}"
              + ("; more than 10% off: the machine runs at another speed than when it was calibrated (calibrate again)"
                 if drift else ""))
    print(f"\n{'model':>10} {'ranks':>5} {'planner ms':>11} {'best other plan':>16} {'its ms':>8} {'spread':>7}  verdict")
    for name, procs, mine, ref, ref_ms, spread, ok in verdicts:
        print(f"{name:>10} {procs:>5} {mine:>11.2f} {ref:>16} {ref_ms:>8.2f} {spread:>7.2f}  "
              f"{'as fast or faster' if ok else 'SLOWER'}")


if __name__ == "__main__":
    main()
