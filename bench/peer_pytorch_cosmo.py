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
import sys

import peer_common
import torch
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


def setup(rank, args, local_batch, pool):
    return CosmoFlow(args.channels, args.size), F.mse_loss, 0.001, load_pool(args, rank, local_batch, pool)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    peer_common.add_common_arguments(parser, steps=20, warmup=3, batch=4, pool=8)
    parser.add_argument("--size", type=int, default=64, help="grid points per side S (divisible by 32)")
    parser.add_argument("--channels", type=int, default=1, help="input channels C")
    parser.add_argument("--data", default=None, help="HDF5 file with float32 `data` and `targets` (tessera generate cosmo)")
    args = parser.parse_args()
    peer_common.check_common_arguments(parser, args)
    if args.size < 32 or args.size % 32 != 0 or args.channels < 1:
        parser.error("--size must be a positive multiple of 32 and --channels at least 1")
    flops = forward_flops(CosmoFlow(args.channels, args.size), args.channels, args.size, args.batch)
    extra = lambda total_s: {"sample_shape": [args.channels, args.size, args.size, args.size],  # noqa: E731
                             "gflops": round(3.0 * flops * args.steps / total_s / 1e9, 2)}
    results = peer_common.run_workers(args, setup)
    print(json.dumps(peer_common.summarize(args, results, f"cosmoflow_{args.size}", extra)), flush=True)


if __name__ == "__main__":
    main()
