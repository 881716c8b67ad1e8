"""What the PyTorch peers of Tessera's benchmarks share: the timed DDP training loop (gloo, one
process per rank, started here: torchrun crashes on Python 3.11), the worker processes, the
summary JSON line and the common command-line options. Each peer provides its model, loss and
data through a `setup(rank, args, local_batch, pool)` function at module level (picklable for the
spawned workers) returning (model, loss_fn, lr, batches)."""
import os
import resource
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def train(rank, args, results, setup):
    """One process: trains and reports its timings (into `results` when there are several)."""
    torch.set_num_threads(args.threads)
    procs = args.procs
    if procs > 1:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=procs)
    total_steps = args.warmup + args.steps
    torch.manual_seed(args.seed)
    model, loss_fn, lr, batches = setup(rank, args, args.batch // procs, min(args.pool, total_steps))
    if args.channels_last:  # NHWC (NDHWC for 3-D) activations: oneDNN's fast path on CPUs
        fmt = torch.channels_last if batches[0][0].dim() == 4 else torch.channels_last_3d
        model = model.to(memory_format=fmt)
        batches = [(x.contiguous(memory_format=fmt), y) for x, y in batches]
    if procs > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    def step(i):
        x, y = batches[i % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        # Mean over the local batch; DDP averages gradients over processes -> mean over the global batch.
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    for i in range(args.warmup):
        step(i)
    if procs > 1:
        dist.barrier()
    step_s = []
    loss = None
    start = time.perf_counter()
    for i in range(args.warmup, total_steps):
        t0 = time.perf_counter()
        loss = step(i)
        step_s.append(time.perf_counter() - t0)
    total_s = time.perf_counter() - start
    result = {
        "rank": rank,
        "step_s": step_s,
        "total_s": total_s,
        "final_loss": float(loss.item()) if loss is not None else float("nan"),
        "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,  # KiB on Linux
    }
    if procs > 1:
        dist.barrier()
        dist.destroy_process_group()
    if results is not None:
        results.put(result)
    return result


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(args, setup):
    if args.procs == 1:
        return [train(0, args, None, setup)]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    context = mp.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=train, args=(rank, args, results, setup)) for rank in range(args.procs)]
    for w in workers:
        w.start()
    collected = []
    try:
        while len(collected) < args.procs:
            try:
                collected.append(results.get(timeout=5))
            except Exception:  # queue.Empty: check that nobody died
                dead = [w for w in workers if w.exitcode not in (None, 0)]
                if dead:
                    sys.exit(f"peer: worker exited with code {dead[0].exitcode}")
    finally:
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.terminate()
    return sorted(collected, key=lambda r: r["rank"])


def summarize(args, results, model_name, extra=None):
    """The JSON result; `extra(total_s)` may add peer-specific fields (shapes, GFLOP/s)."""
    steps = args.steps
    windows = max(1, min(args.windows, steps))
    per_window = steps // windows
    # The slowest process sets the pace (DDP keeps them in lock step anyway).
    window_s = []
    for k in range(windows):
        lo, hi = k * per_window, (k + 1) * per_window
        window_s.append(max(sum(r["step_s"][lo:hi]) for r in results))
    total_s = max(r["total_s"] for r in results)
    step_ms = statistics.median(max(r["step_s"][i] for r in results) for i in range(steps)) * 1e3
    window_rates = [args.batch * per_window / s for s in window_s]
    summary = {
        "peer": "pytorch",
        "torch": torch.__version__,
        "model": model_name,
        "data": args.data or "synthetic",
        "procs": args.procs,
        "threads": args.threads,
        "channels_last": bool(args.channels_last),
        "global_batch": args.batch,
        "warmup_steps": args.warmup,
        "timed_steps": steps,
        "windows": windows,
        "samples_per_s": round(statistics.median(window_rates), 2),
        "samples_per_s_min": round(min(window_rates), 2),
        "samples_per_s_max": round(max(window_rates), 2),
        "samples_per_s_total": round(args.batch * steps / total_s, 2),
        "step_ms": round(step_ms, 3),
        "step_ms_mean": round(total_s / steps * 1e3, 3),
    }
    if extra:
        summary.update(extra(total_s))
    summary.update({
        "peak_rss_mib": round(max(r["max_rss_kib"] for r in results) / 1024.0, 1),
        "peak_rss_mib_per_proc": [round(r["max_rss_kib"] / 1024.0, 1) for r in results],
        "final_loss": round(results[0]["final_loss"], 5),
    })
    return summary


def add_common_arguments(parser, steps, warmup, batch, pool):
    parser.add_argument("--procs", type=int, default=1, help="processes (DDP over gloo when > 1)")
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads per process (default: cores / procs, at least 1)")
    parser.add_argument("--steps", type=int, default=steps, help="timed steps")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps before timing")
    parser.add_argument("--batch", type=int, default=batch, help="global batch size")
    parser.add_argument("--windows", type=int, default=5, help="timed windows (samples_per_s: their median)")
    parser.add_argument("--pool", type=int, default=pool, help="distinct batches pre-loaded per process")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--channels-last", action="store_true",
                        help="channels-last memory format for the model and its inputs")


def check_common_arguments(parser, args):
    if args.threads <= 0:
        args.threads = max(1, (os.cpu_count() or 1) // max(1, args.procs))
    if args.procs < 1 or args.steps < 1 or args.warmup < 0 or args.pool < 1:
        parser.error("--procs, --steps and --pool must be >= 1, --warmup >= 0")
    if args.batch % args.procs != 0:
        parser.error(f"--batch {args.batch} is not divisible by --procs {args.procs}")
    if args.data and not os.path.exists(args.data):
        parser.error(f"--data {args.data}: no such file")
