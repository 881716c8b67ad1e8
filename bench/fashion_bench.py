#!/usr/bin/python3
"""Fashion-MNIST CNN training throughput: Tessera against PyTorch (DDP over gloo), side by side
in one run, interleaved so both see the same machine. Prints a table with the ratio.

    /usr/bin/python3 bench/fashion_bench.py [--build build] [--repeats 3] [--steps 200]

The peer is every PyTorch found (Debian's python3-torch, and the current one from PyPI that
bench/setup_peer.sh installs; or --peer-python), each with contiguous and channels-last
activations; each row compares with the fastest of them in that configuration, and the last line
compares the fastest configurations of both.

Both train the same network (conv3x3-32, max-pool, conv3x3-64, max-pool, linear-128, linear-10,
ReLU; SGD with momentum) with global batch 64 on in-memory data: no reading is timed. Each
configuration "PxT" is P ranks (processes) x T threads each.
"""
import argparse
import os
import statistics

from driver_common import mpirun, peer_pythons, run

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def tessera(build, procs, threads, steps, batch):
    return run(mpirun(procs) + [os.path.join(build, "bin", "bench_train"), "--model", os.path.join(ROOT, "models", "fashion_cnn.yaml"),
                      "--batch", str(batch), "--steps", str(steps), "--warmup", "20", "--threads", str(threads)])


def pytorch(python, procs, threads, steps, batch, channels_last):
    return run([python, os.path.join(HERE, "peer_pytorch_fmnist.py"), "--procs", str(procs),
                "--threads", str(threads), "--steps", str(steps), "--batch", str(batch), "--warmup", "20"] +
               (["--channels-last"] if channels_last else []))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--configs", default="2x1,1x2", help="comma-separated PROCSxTHREADS")
    parser.add_argument("--peer-python", action="append", help="a PyTorch peer's interpreter (repeatable)")
    args = parser.parse_args()
    peers = [(label, python, layout) for label, python in peer_pythons(args.peer_python)
             for layout in ("contiguous", "channels-last")]

    rows = []
    for config in args.configs.split(","):
        procs, threads = (int(x) for x in config.split("x"))
        ours, theirs = [], {peer: [] for peer in peers}
        for _ in range(args.repeats):
            ours.append(tessera(args.build, procs, threads, args.steps, args.batch))
            for peer in peers:
                theirs[peer].append(pytorch(peer[1], procs, threads, args.steps, args.batch, peer[2] == "channels-last"))
        rate = {peer: statistics.median(r["samples_per_s"] for r in runs) for peer, runs in theirs.items()}
        best = max(rate, key=rate.get)
        t = statistics.median(r["samples_per_s"] for r in ours)
        rows.append((config, t, min(r["samples_per_s"] for r in ours), max(r["samples_per_s"] for r in ours),
                     statistics.median(r["gflops"] for r in ours), max(r["peak_rss_mib"] for r in ours),
                     best, rate, theirs))

    print(f"Fashion-MNIST CNN, global batch {args.batch}, {args.steps} timed steps, median of {args.repeats} "
          f"interleaved runs each")
    print(f"{'ranks x threads':>15} | {'Tessera samples/s':>19} | {'fastest peer':>30} | {'its samples/s':>19} | "
          f"{'ratio':>5} | {'Tessera GFLOP/s':>15} | {'peak MiB T / P':>14}")
    print("-" * 135)
    for config, t, tmin, tmax, gflops, mem_t, best, rate, theirs in rows:
        runs = theirs[best]
        print(f"{config:>15} | {t:>7.0f} ({tmin:.0f}-{tmax:.0f}) | {best[0] + ', ' + best[2]:>30} | "
              f"{rate[best]:>7.0f} ({min(r['samples_per_s'] for r in runs):.0f}-"
              f"{max(r['samples_per_s'] for r in runs):.0f}) | {t / rate[best]:>5.2f} | {gflops:>15.1f} | "
              f"{mem_t:>6.0f} / {max(r['peak_rss_mib'] for r in runs):.0f}")
    print("\nevery peer (median samples/s): " + "; ".join(
        f"{config} {peer[0]} {peer[2]} {rate[peer]:.0f}" for config, _, _, _, _, _, _, rate, _ in rows for peer in rate))
    ours_best = max(rows, key=lambda r: r[1])
    theirs_best = max(((row[0], peer, row[7][peer]) for row in rows for peer in row[7]), key=lambda x: x[2])
    print(f"fastest configurations: Tessera {ours_best[0]} {ours_best[1]:.0f} samples/s; peer {theirs_best[1][0]} "
          f"{theirs_best[1][2]} {theirs_best[0]} {theirs_best[2]:.0f}: ratio {ours_best[1] / theirs_best[2]:.2f}")


if __name__ == "__main__":
    main()
