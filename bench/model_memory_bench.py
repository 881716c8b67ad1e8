#!/usr/bin/python3
"""A model whose weights and Adam state fill 4 GiB (models/wide_mlp_4gib.yaml) trained under batch,
filter, filter + channel and 2-D plans at 1, 2 and 4 ranks: step time, each rank's peak resident
size against its share of the whole state (weights, gradients and Adam's two moments over the
ranks), and the bytes sent per step against the SPAA'18 formulas. Prints one markdown table.

    python3 bench/model_memory_bench.py [--cases 1:batch,2:batch,2:filter,...] [--steps 3]

Each (ranks, plan) runs in its own `mpirun ... bench_model_parallel --plans PLAN --optimizer adam`,
so that a peak resident size (VmHWM) is that plan's alone. Every rank allocates and initialises
only its blocks (tessera train's way). The target (issue: models larger than a rank): a 4-rank 2-D
plan's peak per rank at most a quarter of the state + 15 % + a fixed overhead of --overhead-mib
(the process with MPI, oneDNN and the runtime, the activations and the gradient buckets of the
replicated classifier; 256 MiB). Batch at 4 ranks (four whole copies, 21 GiB and the gradient
buckets) does not fit this machine's 23 GiB, so it is not in the default cases.
"""
import argparse
import os
import subprocess
import sys

from driver_common import last_json, mpirun

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_CASES = "1:batch,2:batch,2:filter,2:filter+channel,4:filter,4:filter+channel,4:2-D"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(ROOT, "models", "wide_mlp_4gib.yaml"))
    p.add_argument("--cases", default=DEFAULT_CASES, help=f"RANKS:PLAN, comma-separated ({DEFAULT_CASES})")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--overhead-mib", type=float, default=256, help="the fixed overhead the target allows (256)")
    p.add_argument("--bench", default=os.path.join(ROOT, "build", "bin", "bench_model_parallel"))
    args = p.parse_args()
    rows = []
    for case in args.cases.split(","):
        ranks, plan = case.split(":", 1)
        command = mpirun(int(ranks)) + [args.bench, "--model", args.model, "--plans", plan, "--optimizer", "adam",
                                         "--batch", str(args.batch), "--steps", str(args.steps), "--warmup",
                                         str(args.warmup)]
        print("$", " ".join(command), file=sys.stderr, flush=True)
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:
            rows.append((ranks, plan, None, f"failed ({result.returncode})"))
            print(result.stdout[-2000:], file=sys.stderr)
            continue
        rows.append((ranks, plan, last_json(result.stdout), None))
    lines = [f"# {os.path.basename(args.model)}, Adam, global batch {args.batch}: per rank, per step", "",
             "| ranks | plan | step ms | state share MiB | peak RSS MiB | peak / share | weights + Adam state MiB | "
             "sent MiB | SPAA'18 MiB | sent / SPAA'18 |", "|" + "---|" * 10]
    verdicts = []
    for ranks, plan, r, error in rows:
        if r is None:
            lines.append(f"| {ranks} | {plan} | {error} |" + " |" * 7)
            continue
        sent, analytic = r["measured_mib"], r["spaa18_mib"]
        lines.append(f"| {ranks} | {plan} | {r['step_ms']:.0f} | {r['state_share_mib']:.0f} | {r['peak_rss_mib']:.0f} | "
                     f"{r['peak_rss_mib'] / r['state_share_mib']:.2f} | {r['weights_and_state_mib']:.0f} | {sent:.1f} | "
                     f"{analytic:.1f} | {sent / analytic if analytic else float('nan'):.2f} |")
        if ranks == "4" and plan == "2-D":
            allowed = 1.15 * r["state_share_mib"] + args.overhead_mib
            verdicts.append(f"4-rank 2-D: peak {r['peak_rss_mib']:.0f} MiB per rank against 1.15 x "
                            f"{r['state_share_mib']:.0f} + {args.overhead_mib:.0f} = {allowed:.0f} MiB allowed: "
                            + ("met" if r["peak_rss_mib"] <= allowed else "missed"))
    lines.append("")
    lines.append("state share: the whole model's weights, gradients and Adam moments (4 copies) over the ranks; peak "
                 "RSS: the largest rank's VmHWM; weights + Adam state: what the largest rank holds after the step "
                 "(its blocks and their moments); sent: the executor's exchanges plus the gradient all-reduces as a "
                 "ring sends them; SPAA'18: Gholami et al.'s volumes for the linear layers.")
    lines.extend(verdicts)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
