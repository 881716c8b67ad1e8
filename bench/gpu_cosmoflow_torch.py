#!/usr/bin/python3
"""PyTorch peer for Tessera's single-GPU CosmoFlow benchmark.

Times training steps of the MLPerf HPC CosmoFlow reference network on one device, so that Tessera's
GPU path can be compared with PyTorch (cuDNN) on the same machine with the same FLOP count:
    input N x C x S^3 (default 4 x 4 x 128^3);
    5 x [conv3d 3x3x3 (pad 1, bias), leaky ReLU 0.3, max-pool 2], base*2^i filters (32..512);
    flatten (512 * 4^3 = 32768), linear 128, leaky ReLU, linear 64, leaky ReLU, linear 4;
    mean squared error against fixed random targets; plain SGD (lr 1e-3, no momentum).
A step (forward, loss, backward, optimizer step, zero_grad) is timed with CUDA events (perf_counter
on cpu) after warm-up steps. fp32 is strict fp32 (no TF32 in cuBLAS or cuDNN); bf16 is autocast
around forward and loss with fp32 master weights. step_flops() is the analytic FLOP count that
Tessera's C++ benchmark uses too.

    python3 bench/gpu_cosmoflow_torch.py --matmul --json runs/gpu_cosmoflow.jsonl
    /usr/bin/python3 bench/gpu_cosmoflow_torch.py --device cpu --size 16 --base-filters 4 \\
        --batch 1 --steps 2 --warmup 1
"""
import argparse
import json
import statistics
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

BLOCKS = 5          # conv blocks; each halves the side (128^3 -> 4^3)
SLOPE = 0.3         # leaky ReLU negative slope of the reference model
WIDTHS = (128, 64, 4)  # output widths of the linear layers (4 regression targets)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def layer_flops(size, in_channels, base_filters, batch):
    """(name, forward FLOPs, backward FLOPs) of every conv and linear layer of one step.

    Conv: forward 2*N*Cout*Cin*27*voxels (same padding: output voxels = input voxels); backward
    gives data and weight gradients (2 x forward), except the first conv, whose input needs no
    gradient (1 x forward). Linear: forward 2*N*in*out, backward 2 x forward. Element-wise work,
    pooling and biases are not counted."""
    layers, previous, side = [], in_channels, size
    for block in range(BLOCKS):
        filters = base_filters * 2**block
        forward = 2 * batch * filters * previous * 27 * side**3
        layers.append((f"conv{block + 1}", forward, forward if block == 0 else 2 * forward))
        previous, side = filters, -(-side // 2)  # pooling rounds up, as in CosmoFlow below
    features = previous * side**3
    for index, width in enumerate(WIDTHS):
        layers.append((f"linear{index + 1}", 2 * batch * features * width, 4 * batch * features * width))
        features = width
    return layers


def step_flops(size, in_channels, base_filters, batch):
    """Analytic FLOPs of one training step (forward + backward of the conv and linear layers)."""
    return sum(f + b for _, f, b in layer_flops(size, in_channels, base_filters, batch))


class CosmoFlow(nn.Module):
    def __init__(self, size, in_channels, base_filters):
        super().__init__()
        filters = [base_filters * 2**block for block in range(BLOCKS)]
        inputs = [in_channels] + filters
        self.convs = nn.ModuleList(nn.Conv3d(i, o, 3, padding=1) for i, o in zip(inputs, filters))
        features = filters[-1] * (-(-size // 2**BLOCKS)) ** 3
        self.linears = nn.ModuleList(nn.Linear(i, o) for i, o in zip((features,) + WIDTHS, WIDTHS))

    def forward(self, x):
        for conv in self.convs:
            # ceil_mode changes nothing when the side divides by 32; it lets tiny smoke-test sizes run
            x = F.max_pool3d(F.leaky_relu(conv(x), SLOPE), 2, ceil_mode=True)
        x = torch.flatten(x, 1)
        for linear in self.linears[:-1]:
            x = F.leaky_relu(linear(x), SLOPE)
        return self.linears[-1](x)


def disable_tf32():
    """Strict fp32 in cuBLAS and cuDNN; returns the settings as text. The allow_tf32 flags keep the
    legacy and the per-backend fp32_precision state of PyTorch >= 2.9 consistent (setting only the
    new cuDNN flags would leave the legacy one on, which PyTorch reports as a mix). Should a future
    release drop them, the fp32_precision flags are used instead."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    try:
        with warnings.catch_warnings():  # PyTorch >= 2.9 warns that these flags will be deprecated
            warnings.simplefilter("ignore")
            matmul.allow_tf32 = cudnn.allow_tf32 = False
            return f"cuda.matmul.allow_tf32={matmul.allow_tf32} cudnn.allow_tf32={cudnn.allow_tf32}"
    except (AttributeError, AssertionError, RuntimeError):
        matmul.fp32_precision = cudnn.conv.fp32_precision = cudnn.rnn.fp32_precision = "ieee"
        return (f"cuda.matmul.fp32_precision={matmul.fp32_precision} "
                f"cudnn.conv.fp32_precision={cudnn.conv.fp32_precision}")


def time_runs(work, count, device):
    """Milliseconds of each of `count` calls of work(): CUDA events on a GPU, perf_counter on cpu."""
    if device.type != "cuda":
        times = []
        for _ in range(count):
            start = time.perf_counter()
            work()
            times.append((time.perf_counter() - start) * 1e3)
        return times
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(count)]
    for start, end in events:
        start.record()
        work()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def train_steps(args, device, precision, x, y):
    """Builds the seeded model; returns median ms, min ms and peak GiB (None on cpu) of the timed steps."""
    torch.manual_seed(0)
    model = CosmoFlow(args.size, args.in_channels, args.base_filters).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last_3d)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(args.warmup):  # also lets cudnn.benchmark pick its algorithms
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = time_runs(step, args.steps, device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return statistics.median(times), min(times), peak


def matmul_tflops(device, dtype, n):
    """TFLOP/s of an n^3 torch.mm: 3 warm-ups, then the median of 10 timed calls."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        torch.mm(a, b)
    return 2 * n**3 / (statistics.median(time_runs(lambda: torch.mm(a, b), 10, device)) * 1e-3) / 1e12


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", type=int, default=128, help="input side (a multiple of 32)")
    parser.add_argument("--in-channels", type=int, default=4)
    parser.add_argument("--base-filters", type=int, default=32, help="first conv's filters")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    parser.add_argument("--precision", choices=("fp32", "bf16", "both"), default="both")
    parser.add_argument("--json", metavar="PATH", help="also append one JSON line per result to PATH")
    parser.add_argument("--channels-last", action="store_true", help="use torch.channels_last_3d")
    parser.add_argument("--matmul", action="store_true", help="also time fp32 and bf16 torch.mm")
    args = parser.parse_args()
    if min(args.size, args.in_channels, args.base_filters, args.batch, args.steps) < 1 or args.warmup < 0:
        parser.error("--size, --in-channels, --base-filters, --batch, --steps must be >= 1, --warmup >= 0")
    return args


def main():
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but PyTorch sees no CUDA GPU (use --device cpu)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    tf32 = disable_tf32()
    torch.backends.cudnn.benchmark = True
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, device {name}, cudnn {torch.backends.cudnn.version()}")
    print(f"{tf32} cudnn.benchmark={torch.backends.cudnn.benchmark} channels_last={args.channels_last}")

    flops = step_flops(args.size, args.in_channels, args.base_filters, args.batch)
    print(f"input {args.batch} x {args.in_channels} x {args.size}^3, base filters {args.base_filters}; "
          "FLOPs per step:")
    for layer, forward, backward in layer_flops(args.size, args.in_channels, args.base_filters, args.batch):
        print(f"  {layer:8s} forward {forward:14d}  backward {backward:14d}")
    print(f"  total    {flops} ({flops / 1e9:.3f} GFLOP)")

    torch.manual_seed(0)  # fixed input and targets, made once on the device
    x = torch.randn(args.batch, args.in_channels, args.size, args.size, args.size, device=device)
    y = torch.randn(args.batch, WIDTHS[-1], device=device)
    if args.channels_last:
        x = x.contiguous(memory_format=torch.channels_last_3d)

    results = []
    for precision in DTYPES if args.precision == "both" else (args.precision,):
        try:
            median, fastest, peak = train_steps(args, device, precision, x, y)
        except RuntimeError as error:  # out of memory, or an op without a bf16 kernel on this device
            message = (str(error).strip().splitlines() or [type(error).__name__])[0]
            if device.type == "cpu" and precision == "bf16" and args.precision == "both":
                print(f"note: bf16 skipped, autocast failed on cpu: {message}")
                continue
            print(f"error: {precision} run failed: {message}", file=sys.stderr)
            return 1
        results.append({"record": "step", "precision": precision, "batch": args.batch, "step_ms": median,
                        "step_ms_min": fastest, "samples_per_s": args.batch / (median * 1e-3),
                        "tflops": flops / (median * 1e-3) / 1e12, "peak_gib": peak})
        if device.type == "cuda":
            torch.cuda.empty_cache()

    matmul, n = {}, 8192 if device.type == "cuda" else 1024
    if args.matmul:
        matmul = {p: matmul_tflops(device, dtype, n) for p, dtype in DTYPES.items()}
        for r in results:
            r["matmul_tflops"] = matmul[r["precision"]]
            r["fraction_of_matmul"] = r["tflops"] / r["matmul_tflops"]

    print(f"\n{'precision':9s} {'batch':>5s} {'median ms':>10s} {'min ms':>10s} {'samples/s':>10s} "
          f"{'TFLOP/s':>8s} {'peak GiB':>8s}" + (f" {'of mm':>6s}" if matmul else ""))
    for r in results:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"{r['precision']:9s} {r['batch']:5d} {r['step_ms']:10.3f} {r['step_ms_min']:10.3f} "
              f"{r['samples_per_s']:10.2f} {r['tflops']:8.3f} {peak:>8s}"
              + (f" {r['fraction_of_matmul']:6.1%}" if matmul else ""))
    if matmul:
        print(f"matmul {n}^3 TFLOP/s: fp32 (no TF32) {matmul['fp32']:.2f}, bf16 {matmul['bf16']:.2f}"
              " ('of mm': each precision's TFLOP/s over the matmul rate of that precision)")

    if args.json:
        common = {"bench": "gpu_cosmoflow", "peer": "pytorch", "torch": torch.__version__, "device": name,
                  "cudnn": torch.backends.cudnn.version(), "size": args.size, "in_channels": args.in_channels,
                  "base_filters": args.base_filters, "steps": args.steps, "warmup": args.warmup,
                  "channels_last": args.channels_last, "tf32": tf32,
                  "cudnn_benchmark": torch.backends.cudnn.benchmark, "step_flops": flops}
        records = results + [{"record": "matmul", "precision": p, "n": n, "tflops": t}
                             for p, t in matmul.items()]
        with open(args.json, "a") as out:
            for record in records:
                out.write(json.dumps({**common, **record}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
