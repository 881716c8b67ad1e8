#!/usr/bin/python3
"""The planner at scale, on paper: strong- and weak-scaling curves of the CosmoFlow model at 128^3
and 512^3 (models/cosmoflow_128.yaml, models/cosmoflow_512.yaml) from 1 to 4 096 ranks on a
Summit-class machine file (machines/summit_class.yaml), the planner's plan against pure batch
(sample) parallelism, and the planner's search time for a 100-layer model at 4 096 ranks.

    /usr/bin/python3 bench/planner_scaling.py [--build build] [--machine machines/summit_class.yaml]

Every number is a prediction of the cost model (`tessera plan --explain`) from the machine file's
public specifications, not a measurement. For every rank count P = 1, 2, 4, ..., 4096:
- strong scaling: a fixed global batch (--strong-128, --strong-512);
- weak scaling: batch = P x --weak-128 samples per rank at 128^3, and one sample per
  --weak-512-ranks ranks at 512^3 (a 512^3 sample's activations do not fit one 16 GB GPU).
Columns: the planner's predicted step time and samples/s; the same for pure batch parallelism
(every layer split by sample only; '-' with the reason when it cannot run: more ranks than
samples, or no memory for it); the planner's speed-up over pure batch at the same P and over the
best pure-batch rate of the whole curve; the planner's split of conv1; the kinds of split its plan
uses; memory per rank; search time (the planner's own, printed by `tessera plan`).
'<<' marks the rank counts where the planner's hybrid plan is faster than any pure-batch run of
the same curve: where hybrid parallelism overtakes pure batch parallelism.

Rank counts at which not even a perfect division of the one-rank memory fits the machine's memory
per rank (batch x the one-sample, one-rank footprint / P > memory per rank) are not planned (the
planner would search for a long time to say so); the row says so.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 1 << 20


def tessera_plan(build, *args):
    """(exit code, output, wall seconds) of `tessera plan ARGS`."""
    start = time.monotonic()
    result = subprocess.run([os.path.join(build, "bin", "tessera"), "plan", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return result.returncode, result.stdout, time.monotonic() - start


def parse(text):
    """What the output of `tessera plan --explain` says."""
    out = {}
    m = re.search(r"^predicted step ([0-9.eE+-]+) s", text, re.M)
    out["step_ms"] = 1e3 * float(m.group(1)) if m else None
    m = re.search(r"memory per rank ([0-9.]+) MiB", text)
    out["mem_mib"] = float(m.group(1)) if m else None
    m = re.search(r"^search: (\d+) candidate splits over (\d+) layers, (\d+) states, ([0-9.]+) s( \(exact\))?", text, re.M)
    out["search_s"] = float(m.group(4)) if m else None
    out["states"] = int(m.group(3)) if m else None
    out["exact"] = bool(m and m.group(5))
    out["refs"] = {}
    for m in re.finditer(r"^  (pure batch|pure spatial|pure model)\s+([0-9.]+)\s+([0-9.]+)x\s+([0-9.]+)(  does not fit)?",
                         text, re.M):
        out["refs"][m.group(1)] = (float(m.group(2)), float(m.group(4)), not m.group(5))
    # The plan YAML: default split and the layers listed.
    m = re.search(r"^default: (\{.*\})$", text, re.M)
    default = m.group(1) if m else "?"
    layers = dict(re.findall(r"^  (\w+): (\{.*\})$", text, re.M))
    out["conv1"] = layers.get("conv1", default)
    # The kinds of split the plan uses, from the per-layer table.
    kinds = set()
    for m in re.finditer(r"^\w+\s+(\{[^}]*\})\s+[0-9.]+[mr]\s", text, re.M):
        split = m.group(1)
        s = re.search(r"sample: (\d+)", split)
        if s and int(s.group(1)) > 1:
            kinds.add("sample")
        sp = re.search(r"spatial: \[([0-9, ]+)\]", split)
        if sp and any(int(x) > 1 for x in sp.group(1).split(",")):
            kinds.add("spatial")
        if re.search(r"(filter|channel): \d+", split):
            kinds.add("model")
    out["kinds"] = "x".join(k for k in ("sample", "spatial", "model") if k in kinds) or "none"
    return out


def one_rank_footprint(build, model, machine):
    """MiB per rank of one sample at one rank (the planner's least, from its plan or its refusal)."""
    code, text, _ = tessera_plan(build, "--model", model, "--ranks", "1", "--batch", "1", "--machine", machine)
    if code == 0:
        return parse(text)["mem_mib"]
    m = re.search(r"the least memory the planner found is ([0-9.]+) MiB", text)
    if not m:
        sys.exit(f"cannot read the one-rank footprint of {model}:\n{text}")
    return float(m.group(1))


def machine_memory_mib(machine):
    with open(machine) as f:
        m = re.search(r"^memory_per_rank:\s*([0-9.eE+-]+)", f.read(), re.M)
    return float(m.group(1)) / MIB


def curve(build, machine, model, batches, footprint, limit_mib):
    """Rows of one scaling curve: batches is a list of (P, batch)."""
    rows = []
    for P, batch in batches:
        row = {"P": P, "batch": batch}
        if batch < 1:
            row["skip"] = "fewer than one sample"
            rows.append(row)
            continue
        bound = batch * footprint / P
        if bound > limit_mib:
            row["skip"] = f"no plan fits: needs >= {bound / 1024:.1f} GiB/rank (batch x one-sample footprint / P)"
            rows.append(row)
            continue
        common = ["--model", model, "--ranks", str(P), "--batch", str(batch), "--machine", machine]
        code, text, wall = tessera_plan(build, *common, "--explain")
        row["wall_s"] = wall
        if code != 0:
            reason = text.strip().splitlines()[-1] if text.strip() else f"exit {code}"
            row["skip"] = reason.replace("tessera: error: ", "")
            rows.append(row)
            continue
        row.update(parse(text))
        if "pure batch" not in row["refs"]:
            if P > batch:
                row["batch_why"] = f"P > batch"
            else:
                # Why not: ask for the pure batch plan itself (its refusal names the memory).
                code2, text2, _ = tessera_plan(build, *common, "--no-spatial", "--no-model")
                m = re.search(r"the least memory the planner found is ([0-9.]+) MiB", text2)
                row["batch_why"] = (f"does not fit ({float(m.group(1)) / 1024:.1f} GiB/rank)" if m
                                    else "not possible" if code2 != 0 else "not listed")
        rows.append(row)
    return rows


def print_curve(title, rows):
    print(f"\n{title}")
    header = (f"{'P':>5} {'batch':>5} | {'planner ms':>10} {'samples/s':>9} | {'batch ms':>9} {'samples/s':>9} | "
              f"{'vs batch':>8} {'vs best':>7} | {'conv1 split':<46} {'plan uses':<20} {'MiB/rank':>8} {'search s':>8}")
    print(header)
    print("-" * len(header))
    best_batch = max((r["batch"] / (r["refs"]["pure batch"][0] / 1e3) for r in rows
                      if "refs" in r and "pure batch" in r["refs"]), default=None)
    for r in rows:
        if "skip" in r:
            print(f"{r['P']:>5} {r['batch']:>5} | {'-':>10} {'-':>9} | {'-':>9} {'-':>9} | {'':>8} {'':>7} | "
                  f"{r['skip']}" + (f"  ({r['wall_s']:.1f} s)" if "wall_s" in r else ""))
            continue
        rate = r["batch"] / (r["step_ms"] / 1e3)
        if "pure batch" in r["refs"]:
            b_ms = r["refs"]["pure batch"][0]
            b_rate = r["batch"] / (b_ms / 1e3)
            b_cols = f"{b_ms:>9.2f} {b_rate:>9.1f}"
            vs = f"{b_ms / r['step_ms']:>7.2f}x"
        else:
            b_cols = f"{'-':>9} {'-':>9}"
            vs = f"{'-':>8}"
        vs_best = f"{rate / best_batch:>6.2f}x" if best_batch else f"{'-':>7}"
        mark = "  <<" if best_batch and rate > 1.01 * best_batch else ""
        note = f"  pure batch: {r['batch_why']}" if "batch_why" in r else ""
        print(f"{r['P']:>5} {r['batch']:>5} | {r['step_ms']:>10.2f} {rate:>9.1f} | {b_cols} | {vs} {vs_best} | "
              f"{r['conv1']:<46} {r['kinds']:<20} {r['mem_mib']:>8.0f} {r['search_s']:>8.3f}"
              f"{'' if r['exact'] else ' (capped)'}{note}{mark}")
    if best_batch is None:
        print("(pure batch parallelism runs at no rank count of this curve)")
    else:
        print(f"(best pure-batch rate of this curve: {best_batch:.1f} samples/s; << = the planner's plan beats it by > 1%)")


def hundred_layer_model(path, size):
    """A 100-layer CosmoFlow-like chain: 46 conv3d + leaky ReLU pairs in four stages of 12, 12, 11, 11,
    each followed by a max-pool 2 (96 layers), then flatten, linear, leaky ReLU, linear."""
    lines = ["# 100 layers, generated by bench/planner_scaling.py for the planner's search time.",
             "name: deep100", f"input: {{shape: [1, {size}, {size}, {size}]}}", "layers:"]
    n = 0
    for stage, convs in enumerate((12, 12, 11, 11)):
        filters = 16 * 2 ** min(stage, 1)
        for _ in range(convs):
            n += 1
            lines.append(f"  - {{name: conv{n}, type: conv, filters: {filters}, kernel: 3, padding: 1}}")
            lines.append(f"  - {{name: act{n}, type: leaky_relu, slope: 0.01}}")
        lines.append(f"  - {{name: pool{stage + 1}, type: maxpool, kernel: 2}}")
    lines += ["  - {name: flatten, type: flatten}", "  - {name: fc1, type: linear, out: 128}",
              "  - {name: fcact, type: leaky_relu, slope: 0.01}", "  - {name: fc2, type: linear, out: 4}", "loss: mse"]
    layers = sum(1 for l in lines if l.startswith("  - "))
    assert layers == 100, layers
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--machine", default=os.path.join(ROOT, "machines", "summit_class.yaml"))
    parser.add_argument("--max-ranks", type=int, default=4096)
    parser.add_argument("--strong-128", type=int, default=256, help="global batch of the 128^3 strong-scaling curve")
    parser.add_argument("--strong-512", type=int, default=16, help="global batch of the 512^3 strong-scaling curve")
    parser.add_argument("--weak-128", type=int, default=2, help="samples per rank of the 128^3 weak-scaling curve")
    parser.add_argument("--weak-512-ranks", type=int, default=8,
                        help="ranks per sample of the 512^3 weak-scaling curve (batch = P / this)")
    parser.add_argument("--deep-batch", type=int, default=256, help="global batch of the 100-layer model")
    parser.add_argument("--curves", default="128,512", help="which models to plan (128, 512)")
    args = parser.parse_args()
    start = time.monotonic()
    ranks = [1 << i for i in range(args.max_ranks.bit_length()) if 1 << i <= args.max_ranks]
    limit = machine_memory_mib(args.machine)
    print(f"Planner scaling on machine {os.path.relpath(args.machine, ROOT)} ({limit:.0f} MiB per rank); "
          "predicted by the cost model from public specifications, not measured.")

    for size in (128, 512):
        if str(size) not in args.curves.split(","):
            continue
        model = os.path.join(ROOT, "models", f"cosmoflow_{size}.yaml")
        footprint = one_rank_footprint(args.build, model, args.machine)
        print(f"\n=== CosmoFlow {size}^3 ({os.path.relpath(model, ROOT)}): one sample at one rank needs "
              f"{footprint / 1024:.1f} GiB ({'fits' if footprint <= limit else 'does NOT fit'} one rank)")
        strong = args.strong_128 if size == 128 else args.strong_512
        if size == 128:
            weak = [(P, P * args.weak_128) for P in ranks]
            weak_title = f"weak scaling, {args.weak_128} samples per rank"
        else:
            weak = [(P, P // args.weak_512_ranks) for P in ranks]
            weak_title = f"weak scaling, one sample per {args.weak_512_ranks} ranks"
        print_curve(f"CosmoFlow {size}^3, strong scaling, global batch {strong}",
                    curve(args.build, args.machine, model, [(P, strong) for P in ranks], footprint, limit))
        print_curve(f"CosmoFlow {size}^3, {weak_title}", curve(args.build, args.machine, model, weak, footprint, limit))

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "deep100.yaml")
        hundred_layer_model(path, 128)
        P = args.max_ranks
        code, text, wall = tessera_plan(args.build, "--model", path, "--ranks", str(P), "--batch", str(args.deep_batch),
                                        "--machine", args.machine)
        print(f"\n=== Search time: a 100-layer 3-D CNN (46 conv3d + leaky ReLU pairs, 4 max-pools, flatten, 2 linear + "
              f"activation; 128^3 input), batch {args.deep_batch}, {P} ranks")
        if code != 0:
            print(f"tessera plan failed after {wall:.1f} s: {text.strip().splitlines()[-1]}")
        else:
            r = parse(text)
            m = re.search(r"^search: .*$", text, re.M)
            print(m.group(0))
            print(f"predicted step {r['step_ms']:.2f} ms, memory per rank {r['mem_mib']:.0f} MiB, plan uses {r['kinds']}; "
                  f"whole command {wall:.2f} s")
    print(f"\n(this script: {time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
