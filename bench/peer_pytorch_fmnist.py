#!/usr/bin/python3
"""PyTorch peer for Tessera's Fashion-MNIST benchmark.

Trains the Fashion-MNIST CNN
    conv3x3-32 (pad 1), ReLU, max-pool 2, conv3x3-64 (pad 1), ReLU, max-pool 2, flatten,
    linear 3136->128, ReLU, linear 128->10; softmax cross-entropy; SGD lr 0.05 momentum 0.9
with a fixed global batch (default 64) on P processes (DDP over gloo, started here: torchrun
crashes on Python 3.11) with T intra-op threads each, and prints one JSON line:

    {"peer": "pytorch", "torch": ..., "procs": P, "threads": T, "global_batch": 64,
     "samples_per_s": median over timed windows, "samples_per_s_total": over all timed steps,
     "step_ms": median step time, "peak_rss_mib": max over processes of ru_maxrss, ...}

Data: --data FILE.h5 (uint8 `images` N x 1 x 28 x 28 and `labels`, scaled by 1/255), or random
tensors of the same shape. Batches are built in memory before timing (a pool of at most
--pool batches, cycled), so no data loading or conversion is timed.

Usage (Debian's torch 1.13, CPU):
    /usr/bin/python3 bench/peer_pytorch_fmnist.py --procs 2 --threads 1 --steps 100
    /usr/bin/python3 bench/peer_pytorch_fmnist.py --procs 1 --threads 2 --steps 100
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


class FashionCnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


def load_pool(args, rank, local_batch, pool):
    """`pool` batches of this rank's slice of consecutive global batches, as float tensors."""
    global_batch = args.batch
    if args.data:
        import h5py  # only needed for real data

        with h5py.File(args.data, "r") as f:
            count = min(f["images"].shape[0], pool * global_batch)
            images = torch.from_numpy(f["images"][:count]).reshape(count, 1, 28, 28)
            labels = torch.from_numpy(f["labels"][:count].astype("int64")).reshape(count)
        if count < global_batch:
            sys.exit(f"peer: {args.data} holds {count} samples, fewer than one batch of {global_batch}")
    else:
        generator = torch.Generator().manual_seed(args.seed + 1)
        count = pool * global_batch
        images = torch.randint(0, 256, (count, 1, 28, 28), dtype=torch.uint8, generator=generator)
        labels = torch.randint(0, 10, (count,), dtype=torch.int64, generator=generator)
    batches = []
    for b in range(count // global_batch):
        begin = b * global_batch + rank * local_batch
        x = images[begin:begin + local_batch].float().div_(255.0).contiguous()
        y = labels[begin:begin + local_batch].clone()
        batches.append((x, y))
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
    model = FashionCnn()
    if procs > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(i):
        x, y = batches[i % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        # Mean over the local batch; DDP averages gradients over processes -> mean over the global batch.
        loss = F.cross_entropy(model(x), y)
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
        "model": "fmnist_cnn",
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
        "peak_rss_mib": round(max(r["max_rss_kib"] for r in results) / 1024.0, 1),
        "peak_rss_mib_per_proc": [round(r["max_rss_kib"] / 1024.0, 1) for r in results],
        "final_loss": round(results[0]["final_loss"], 5),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=1, help="processes (DDP over gloo when > 1)")
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads per process (default: cores / procs, at least 1)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps before timing")
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--windows", type=int, default=5, help="timed windows (samples_per_s: their median)")
    parser.add_argument("--pool", type=int, default=32, help="distinct batches pre-loaded per process")
    parser.add_argument("--data", default=None, help="HDF5 file with uint8 `images` and `labels`")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    if args.threads <= 0:
        args.threads = max(1, (os.cpu_count() or 1) // max(1, args.procs))
    if args.procs < 1 or args.steps < 1 or args.warmup < 0 or args.pool < 1:
        parser.error("--procs, --steps and --pool must be >= 1, --warmup >= 0")
    if args.batch % args.procs != 0:
        parser.error(f"--batch {args.batch} is not divisible by --procs {args.procs}")
    if args.data and not os.path.exists(args.data):
        parser.error(f"--data {args.data}: no such file")
    print(json.dumps(summarize(args, run_workers(args))), flush=True)


if __name__ == "__main__":
    main()
