#!/usr/bin/python3
"""CosmoFlow (3-D CNN) training step: spatial against sample parallelism and against PyTorch,
side by side in one run, interleaved so all see the same machine. Prints two tables.

    /usr/bin/python3 bench/cosmo_bench.py [--build build] [--repeats 1] [--steps 3]

1. models/cosmoflow_128.yaml (128^3 volumes), global batch --batch-128 (default 1: one sample):
   one rank against the ceiling of two (two 1-rank jobs at once, the pair's step halved: what the
   machine's shared caches and memory leave two ranks that exchange nothing), two ranks splitting
   the first three conv blocks along D (plans/cosmoflow_spatial2.yaml; the small dense tail is
   split by sample, so with one sample one rank idles there; plans/cosmoflow_spatial2_deep.yaml
   splits every conv block and the first two dense layers by feature, so neither idles),
   four ranks over D x H (plans/cosmoflow_spatial4.yaml, plans/cosmoflow_spatial4_deep.yaml;
   oversubscribed on a 2-core machine: their times say nothing about speed, only the exchange
   share), and with a batch of 2 or more also two ranks splitting by sample; the deep plans also
   with their halos overlapped as if each rank were a node of its own (--ranks-per-node 1: the
   default `auto` overlaps only halos from other nodes, and here all ranks share one). Columns:
   step time, speed-up over one rank, peak activation memory per rank (activations, their
   gradients, halo windows), the conv layers whose halo exchange overlaps their compute, the
   exposed halo time (halo exchanges outside compute: starting, waiting, finishing; what overlaps
   a layer's interior or weight gradients is not counted) on the critical rank (the one the
   others wait for: what halos add to the step) and the most of any rank (which adds waiting for
   a slower rank: imbalance, on this VM mostly the two vCPUs' differing speeds, and with 4 ranks
   on 2 cores a partner not scheduled), then all exposed exchanges on the critical rank (halos and
   the redistributions between differing splits, e.g. spatial to sample before the dense tail).
2. models/cosmoflow.yaml (64^3), global batch 4, 2 processes x 1 thread: Tessera (spatial and
   sample plans) against PyTorch 1.13 DDP over gloo on the same model and batch.

Every configuration is one process per rank with 1 thread (OMP_NUM_THREADS=1), on in-memory data.
"""
import argparse
import os
import statistics
import subprocess
import sys

from driver_common import last_json, mpirun, peer_pythons, run

ONE_THREAD = dict(os.environ, OMP_NUM_THREADS="1")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def tessera_command(build, model, procs, plan, batch, steps, overlap="auto"):
    # "as-if-remote": auto, with every rank treated as a node of its own (auto overlaps only halos
    # from other nodes; here all ranks share one).
    command = mpirun(procs, "-x", "OMP_NUM_THREADS=1") + [os.path.join(build, "bin", "bench_train"), "--model", os.path.join(ROOT, "models", model),
                     "--batch", str(batch), "--steps", str(steps), "--warmup", "1", "--threads", "1", "--lr", "0.0001",
                     "--halo-overlap", "auto" if overlap == "as-if-remote" else overlap]
    if overlap == "as-if-remote":
        command += ["--ranks-per-node", "1"]
    if plan:
        command += ["--plan", os.path.join(ROOT, "plans", plan)]
    return command


def tessera(build, model, procs, plan, batch, steps, overlap="auto"):
    return run(tessera_command(build, model, procs, plan, batch, steps, overlap), ONE_THREAD)


def tessera_pair(build, model, batch, steps):
    """Two 1-rank jobs at once, one per core: what the machine gives two ranks that exchange
    nothing (its cores' shared caches and memory), the ceiling of a 2-rank speed-up. The result is
    one job's, with step_ms the pair's mean halved (the step of one rank's half of the work)."""
    command = tessera_command(build, model, 1, None, batch, steps)
    jobs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ONE_THREAD)
            for _ in range(2)]
    outputs = [job.communicate()[0] for job in jobs]
    for job, output in zip(jobs, outputs):
        if job.returncode != 0:
            sys.exit(f"failed ({job.returncode}): {' '.join(command)}\n{output}")
    results = [last_json(output) for output in outputs]
    result = dict(results[0])
    result["step_ms"] = (results[0]["step_ms"] + results[1]["step_ms"]) / 4
    return result


def pytorch(python, procs, threads, batch, steps, size, channels_last):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    return run([python, os.path.join(HERE, "peer_pytorch_cosmo.py"), "--procs", str(procs), "--threads", str(threads),
                "--steps", str(steps), "--warmup", "1", "--batch", str(batch), "--size", str(size), "--windows", "1"] +
               (["--channels-last"] if channels_last else []), env)


def median(results, key):
    return statistics.median(r[key] for r in results)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-128", type=int, default=1)
    parser.add_argument("--skip-128", action="store_true", help="only the 64^3 comparison with PyTorch")
    parser.add_argument("--peer-python", action="append", help="a PyTorch peer's interpreter (repeatable)")
    args = parser.parse_args()
    peers = [(f"{label}, {procs} x {3 - procs}, {layout}", python, procs, layout)
             for label, python in peer_pythons(args.peer_python) for procs in (2, 1)
             for layout in ("contiguous", "channels-last")]

    if not args.skip_128:
        configs = [("1 rank", 1, None, args.batch_128, "auto"),
                   ("2 ranks, spatial D", 2, "cosmoflow_spatial2.yaml", args.batch_128, "auto"),
                   ("2 ranks, spatial D, every conv block", 2, "cosmoflow_spatial2_deep.yaml", args.batch_128, "auto"),
                   ("2 ranks, the same, halos overlapped", 2, "cosmoflow_spatial2_deep.yaml", args.batch_128, "as-if-remote"),
                   ("4 ranks, spatial DxH (oversubscribed)", 4, "cosmoflow_spatial4.yaml", args.batch_128, "auto"),
                   ("4 ranks, DxH, every conv block", 4, "cosmoflow_spatial4_deep.yaml", args.batch_128, "auto"),
                   ("4 ranks, the same, halos overlapped", 4, "cosmoflow_spatial4_deep.yaml", args.batch_128, "as-if-remote")]
        if args.batch_128 >= 2:
            configs.insert(2, ("2 ranks, sample", 2, None, args.batch_128, "auto"))
        ceiling = "2 x 1 rank at once: the ceiling"
        configs.insert(1, (ceiling, 2, None, args.batch_128, "auto"))
        results = {name: [] for name, *_ in configs}
        for _ in range(args.repeats):
            for name, procs, plan, batch, overlap in configs:
                results[name].append(tessera_pair(args.build, "cosmoflow_128.yaml", batch, args.steps) if name == ceiling
                                     else tessera(args.build, "cosmoflow_128.yaml", procs, plan, batch, args.steps, overlap))
        bases = {args.batch_128: median(results["1 rank"], "step_ms")}
        print(f"CosmoFlow 128^3, global batch {args.batch_128}, {args.steps} timed steps, median of {args.repeats}; "
              "1 thread per rank")
        print(f"{'plan':>40} | {'step ms':>8} | {'speed-up':>8} | {'activation MiB/rank':>19} | "
              f"{'overlapped':>10} | {'exposed halo, critical rank':>27} | {'most of any rank':>16} | "
              f"{'all exchanges, critical':>23} | {'exchanged MiB/rank':>18}")
        print("-" * 194)
        for name, _, _, batch, _ in configs:
            r = results[name]
            step = median(r, "step_ms")
            base = bases[batch]
            halo = median(r, "halo_critical_ms")
            most = median(r, "halo_ms")
            exchange = median(r, "exchange_critical_ms")
            print(f"{name:>40} | {step:>8.0f} | {base / step:>7.2f}x | {median(r, 'activation_mib'):>19.0f} | "
                  f"{median(r, 'overlapped_layers'):>10.0f} | {halo:>11.1f} ms {100 * halo / step:>11.1f}% | "
                  f"{100 * most / step:>15.1f}% | {exchange:>11.1f} ms {100 * exchange / step:>7.1f}% | "
                  f"{median(r, 'exchanged_mib'):>18.1f}")
        print()

    configs = [("Tessera 2 ranks, spatial D", lambda: tessera(args.build, "cosmoflow.yaml", 2, "cosmoflow_spatial2.yaml", 4,
                                                               args.steps * 3)),
               ("Tessera 2 ranks, sample", lambda: tessera(args.build, "cosmoflow.yaml", 2, None, 4, args.steps * 3)),
               *[(name, lambda python=python, procs=procs, layout=layout: pytorch(
                   python, procs, 3 - procs, 4, args.steps * 3, 64, layout == "channels-last"))
                 for name, python, procs, layout in peers]]
    results = {name: [] for name, _ in configs}
    for _ in range(args.repeats):
        for name, fn in configs:
            results[name].append(fn())
    fastest = max((name for name, *_ in peers), key=lambda name: median(results[name], "samples_per_s"))
    peer = median(results[fastest], "samples_per_s")
    print(f"CosmoFlow 64^3, global batch 4, 2 cores, {args.steps * 3} timed steps, median of {args.repeats}; "
          f"the peer: the fastest of PyTorch's configurations ({fastest})")
    print(f"{'run':>45} | {'samples/s':>9} | {'vs fastest peer':>15} | {'peak RSS MiB/proc':>17}")
    print("-" * 96)
    for name, _ in configs:
        r = results[name]
        rate = median(r, "samples_per_s")
        print(f"{name:>45} | {rate:>9.2f} | {rate / peer:>14.2f}x | {max(x['peak_rss_mib'] for x in r):>17.0f}")


if __name__ == "__main__":
    main()
