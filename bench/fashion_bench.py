#!/usr/bin/python3
"""Fashion-MNIST CNN training throughput: Tessera against PyTorch (DDP over gloo), side by side
in one run, interleaved so both see the same machine. Prints a table with the ratio.

    /usr/bin/python3 bench/fashion_bench.py [--build build] [--repeats 3] [--steps 200]

Both train the same network (conv3x3-32, max-pool, conv3x3-64, max-pool, linear-128, linear-10,
ReLU; SGD with momentum) with global batch 64 on in-memory data: no reading is timed. Each
configuration "PxT" is P ranks (processes) x T threads each.
"""
import argparse
import os
import statistics

from driver_common import mpirun, require_torch, run

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def tessera(build, procs, threads, steps, batch):
    return run(mpirun(procs) + [os.path.join(build, "bin", "bench_train"), "--model", os.path.join(ROOT, "models", "fashion_cnn.yaml"),
                      "--batch", str(batch), "--steps", str(steps), "--warmup", "20", "--threads", str(threads)])


def pytorch(procs, threads, steps, batch):
    return run(["/usr/bin/python3", os.path.join(HERE, "peer_pytorch_fmnist.py"), "--procs", str(procs),
                "--threads", str(threads), "--steps", str(steps), "--batch", str(batch), "--warmup", "20"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--configs", default="2x1,1x2", help="comma-separated PROCSxTHREADS")
    args = parser.parse_args()
    require_torch()

    rows = []
    for config in args.configs.split(","):
        procs, threads = (int(x) for x in config.split("x"))
        ours, theirs = [], []
        for _ in range(args.repeats):
            ours.append(tessera(args.build, procs, threads, args.steps, args.batch))
            theirs.append(pytorch(procs, threads, args.steps, args.batch))
        t = statistics.median(r["samples_per_s"] for r in ours)
        p = statistics.median(r["samples_per_s"] for r in theirs)
        rows.append((config, t, p, t / p,
                     statistics.median(r["gflops"] for r in ours),
                     max(r["peak_rss_mib"] for r in ours), max(r["peak_rss_mib"] for r in theirs),
                     min(r["samples_per_s"] for r in ours), max(r["samples_per_s"] for r in ours),
                     min(r["samples_per_s"] for r in theirs), max(r["samples_per_s"] for r in theirs)))

    print(f"Fashion-MNIST CNN, global batch {args.batch}, {args.steps} timed steps, median of {args.repeats} runs each")
    print(f"{'ranks x threads':>15} | {'Tessera samples/s':>17} | {'PyTorch samples/s':>17} | {'ratio':>5} | "
          f"{'Tessera GFLOP/s':>15} | {'peak MiB/rank T':>15} | {'peak MiB/proc P':>15}")
    print("-" * 118)
    for c, t, p, ratio, gflops, mem_t, mem_p, tmin, tmax, pmin, pmax in rows:
        print(f"{c:>15} | {t:>8.0f} ({tmin:.0f}-{tmax:.0f}) | {p:>8.0f} ({pmin:.0f}-{pmax:.0f}) | {ratio:>5.2f} | "
              f"{gflops:>15.1f} | {mem_t:>15.0f} | {mem_p:>15.0f}")


if __name__ == "__main__":
    main()
