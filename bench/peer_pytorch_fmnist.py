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
import sys

import peer_common
import torch
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


def setup(rank, args, local_batch, pool):
    return FashionCnn(), F.cross_entropy, 0.05, load_pool(args, rank, local_batch, pool)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    peer_common.add_common_arguments(parser, steps=100, warmup=10, batch=64, pool=32)
    parser.add_argument("--data", default=None, help="HDF5 file with uint8 `images` and `labels`")
    args = parser.parse_args()
    peer_common.check_common_arguments(parser, args)
    results = peer_common.run_workers(args, setup)
    print(json.dumps(peer_common.summarize(args, results, "fmnist_cnn")), flush=True)


if __name__ == "__main__":
    main()
