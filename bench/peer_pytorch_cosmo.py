#!/usr/bin/python3
"""PyTorch peer for Tessera's CosmoFlow benchmark (models/cosmoflow.yaml, models/cosmoflow_128.yaml).

Trains the CosmoFlow-style 3-D CNN on C x S^3 volumes (S divisible by 32):
    5 x [conv3d 3x3x3 (pad 1), leaky ReLU 0.01, max-pool 2] with 16-32-64-64-64 filters, flatten,
    linear -> 128, leaky ReLU, linear 128 -> 64, leaky ReLU, linear 64 -> 4; mean squared error;
    SGD lr 0.001 momentum 0.9
with a fixed global batch (default 4) on P processes (DDP over gloo, started here: torchrun
crashes on Python 3.11) with T intra-op threads each, and prints one JSON line:

    {"peer": "pytorch", "torch": ..., "model": "cosmoflow_64", "procs": P, "threads": T, "global_batch": 4,
     "samples_per_s": median over timed windows, "samples_per_s_total": over all timed steps,
     "step_ms": median step time, "gflops": ..., "peak_rss_mib": max over processes of ru_maxrss, ...}

"gflops" counts forward + backward of the convolution and linear layers (3 x forward multiply-adds
x 2), as bench/bench_train.cpp does for Tessera.

Data: --data FILE.h5 (float32 `data` N x C x S x S x S and `targets` N x 4, as written by
`tessera generate cosmo`), or random tensors of the same shape. Batches are built in memory before
timing (a pool of at most --pool batches, cycled), so no data loading or conversion is timed.

Usage (Debian's torch 1.13, CPU):
    /usr/bin/python3 bench/peer_pytorch_cosmo.py --procs 2 --threads 1 --batch 4 --steps 20
    /usr/bin/python3 bench/peer_pytorch_cosmo.py --procs 1 --threads 2 --size 128 --data data/cosmo128/train.h5
"""
import argparse
import json
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
import torch.nn.functional as F


FILTERS = (16, 32, 64, 64, 64)


class CosmoFlow(nn.Module):
    def __init__(self, channels, size):
        super().__init__()
        convs, previous = [], channels
        for filters in FILTERS:
            convs.append(nn.Conv3d(previous, filters, 3, padding=1))
            previous = filters
        self.convs = nn.ModuleList(convs)
        side = size // 2 ** len(FILTERS)
        self.fc1 = nn.Linear(previous * side**3, 128)
        self.fc2 = nn.Linear(128, 64)
        self.fc3 = nn.Linear(64, 4)

    def forward(self, x):
        for conv in self.convs:
            x = F.max_pool3d(F.leaky_relu(conv(x), 0.01), 2)
        x = torch.flatten(x, 1)
        x = F.leaky_relu(self.fc1(x), 0.01)
        x = F.leaky_relu(self.fc2(x), 0.01)
        return self.fc3(x)


def forward_flops(model, channels, size, batch):
    """Multiply-adds x 2 of one forward pass of the conv and linear layers over `batch` samples."""
    flops, side = 0.0, size
    for conv in model.convs:
        flops += 2.0 * batch * conv.weight.numel() * side**3  # padding 1: output size = input size
        side //= 2
    for fc in (model.fc1, model.fc2, model.fc3):
        flops += 2.0 * batch * fc.weight.numel()
    return flops


def load_pool(args, rank, local_batch, pool):
    """`pool` batches of this rank's slice of consecutive global batches."""
    global_batch, c, s = args.batch, args.channels, args.size
    if args.data:
        import h5py  # only needed for real data

        with h5py.File(args.data, "r") as f:
            shape = f["data"].shape
            if len(shape) != 5 or shape[1:] != (c, s, s, s):
                sys.exit(f"peer: {args.data} holds data of shape {shape}, expected N x {c} x {s}^3 "
                         "(--channels, --size)")
            count = min(shape[0], pool * global_batch)
            data = torch.from_numpy(f["data"][:count])
            targets = torch.from_numpy(f["targets"][:count]).float()
        if count < global_batch:
            sys.exit(f"peer: {args.data} holds {count} samples, fewer than one batch of {global_batch}")
    else:
        generator = torch.Generator().manual_seed(args.seed + 1)
        count = pool * global_batch
        data = torch.randn((count, c, s, s, s), generator=generator)
        targets = torch.rand((count, 4), generator=generator) * 2 - 1
    batches = []
    for b in range(count // global_batch):
        begin = b * global_batch + rank * local_batch
        batches.append((data[begin:begin + local_batch].contiguous(), targets[begin:begin + local_batch].clone()))
    return batches


def train(rank, args, results):
    """One process: trains and reports its timings (into `results` when there are several)."""
    torch.set_num_threads(args.threads)
    procs = args.procs
    if procs > 1:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=procs)
    local_batch = args.batch // procs
    total_steps = args.warmup + args.steps
    batches = load_pool(args, rank, local_batch, min(args.pool, total_steps))

    torch.manual_seed(args.seed)
    model = CosmoFlow(args.channels, args.size)
    if procs > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)

    def step(i):
        x, y = batches[i % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        # Mean over the local batch; DDP averages gradients over processes -> mean over the global batch.
        loss = F.mse_loss(model(x), y)
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


def run_workers(args):
    if args.procs == 1:
        return [train(0, args, None)]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    context = mp.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=train, args=(rank, args, results)) for rank in range(args.procs)]
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


def summarize(args, results):
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
    return {
        "peer": "pytorch",
        "torch": torch.__version__,
        "model": f"cosmoflow_{args.size}",
        "sample_shape": [args.channels, args.size, args.size, args.size],
        "data": args.data or "synthetic",
        "procs": args.procs,
        "threads": args.threads,
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
        "gflops": round(3.0 * forward_flops(CosmoFlow(args.channels, args.size), args.channels, args.size,
                                            args.batch) * steps / total_s / 1e9, 2),
        "peak_rss_mib": round(max(r["max_rss_kib"] for r in results) / 1024.0, 1),
        "peak_rss_mib_per_proc": [round(r["max_rss_kib"] / 1024.0, 1) for r in results],
        "final_loss": round(results[0]["final_loss"], 5),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=1, help="processes (DDP over gloo when > 1)")
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads per process (default: cores / procs, at least 1)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    parser.add_argument("--batch", type=int, default=4, help="global batch size")
    parser.add_argument("--size", type=int, default=64, help="grid points per side S (divisible by 32)")
    parser.add_argument("--channels", type=int, default=1, help="input channels C")
    parser.add_argument("--windows", type=int, default=5, help="timed windows (samples_per_s: their median)")
    parser.add_argument("--pool", type=int, default=8, help="distinct batches pre-loaded per process")
    parser.add_argument("--data", default=None, help="HDF5 file with float32 `data` and `targets` (tessera generate cosmo)")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    if args.threads <= 0:
        args.threads = max(1, (os.cpu_count() or 1) // max(1, args.procs))
    if args.procs < 1 or args.steps < 1 or args.warmup < 0 or args.pool < 1:
        parser.error("--procs, --steps and --pool must be >= 1, --warmup >= 0")
    if args.size < 32 or args.size % 32 != 0 or args.channels < 1:
        parser.error("--size must be a positive multiple of 32 and --channels at least 1")
    if args.batch % args.procs != 0:
        parser.error(f"--batch {args.batch} is not divisible by --procs {args.procs}")
    if args.data and not os.path.exists(args.data):
        parser.error(f"--data {args.data}: no such file")
    print(json.dumps(summarize(args, run_workers(args))), flush=True)


if __name__ == "__main__":
    main()
