#!/usr/bin/python3
"""Tessera's GPU training step beside PyTorch's, in the same run, on the same GPU.

Runs gpu_step_bench (the step composed from Tessera's CUDA kernels), with --executor also
bench_train on the GPU (the whole framework: the model file, the executor, the optimizer), and
bench/gpu_cosmoflow_torch.py (PyTorch, cuDNN) on the CosmoFlow reference network with the same
input, batch and FLOP count, and prints one table with the ratio of Tessera's throughput to
PyTorch's at the same precision (strict fp32: no TF32 on either side; bf16: Tessera's
`precision: bf16`, convolutions on bf16 tensors with bf16 results, beside PyTorch's autocast to
bf16; bf16-exact: Tessera's bf16 convolutions with fp32 results on TF32 tensor cores, against the
same peer) and each one's TFLOP/s against the GPU's measured matmul rate at that precision. With
--executor, last and bounded (45 s), the executor's bf16 step once more with the leaky ReLUs apart
(`bf16-apart`: not in place, not fused into the convolutions and poolings) to show what those save.

    python3 bench/gpu_compare.py --tessera build-cuda/bin/gpu_step_bench [--executor build-cuda/bin/bench_train]
                                 [--batch 4] [--size 128]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(command, log, env=None):
    print("$ " + " ".join(command), flush=True)
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    print(result.stdout, flush=True)
    log.write(result.stdout)
    return result.returncode


def reference_model(size, in_channels, base_filters):
    """The reference network as a Tessera model file (models/cosmoflow_reference.yaml at 128^3 x 4)."""
    lines = [f"name: cosmoflow_reference", f"input: {{shape: [{in_channels}, {size}, {size}, {size}]}}", "layers:"]
    for block in range(5):
        lines += [f"  - {{name: conv{block + 1}, type: conv, filters: {base_filters << block}, kernel: 3, padding: 1}}",
                  f"  - {{name: act{block + 1}, type: leaky_relu, slope: 0.3}}",
                  f"  - {{name: pool{block + 1}, type: maxpool, kernel: 2}}"]
    lines += ["  - {name: flatten, type: flatten}", "  - {name: fc1, type: linear, out: 128}",
              "  - {name: act6, type: leaky_relu, slope: 0.3}", "  - {name: fc2, type: linear, out: 64}",
              "  - {name: act7, type: leaky_relu, slope: 0.3}", "  - {name: fc3, type: linear, out: 4}", "loss: mse"]
    return "\n".join(lines) + "\n"


def last_json(text):
    for line in reversed(text.splitlines()):
        if line.strip().startswith("{"):
            return json.loads(line)
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tessera", required=True, help="the gpu_step_bench binary")
    parser.add_argument("--executor", help="the bench_train binary (built with CUDA): the executor's step too")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--in-channels", type=int, default=4)
    parser.add_argument("--base-filters", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--log", default=os.devnull, help="also write both programs' output here")
    parser.add_argument("--library-path", help="LD_LIBRARY_PATH for Tessera's program only (PyTorch keeps its own)")
    args = parser.parse_args()
    shape = ["--size", str(args.size), "--in-channels", str(args.in_channels), "--base-filters",
             str(args.base_filters), "--batch", str(args.batch), "--steps", str(args.steps), "--warmup",
             str(args.warmup)]
    with tempfile.TemporaryDirectory() as tmp, open(args.log, "w") as log:
        records = os.path.join(tmp, "records.jsonl")
        env = dict(os.environ)
        if args.library_path:
            env["LD_LIBRARY_PATH"] = args.library_path + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        failed = run([args.tessera, *shape, "--matmul", "--verbose", "--json", records], log, env)
        failed |= run([args.tessera, *shape, "--bf16", "--matmul", "--json", records], log, env)
        failed |= run([args.tessera, *shape, "--bf16", "--bf16-exact", "--json", records], log, env)
        executor = {}
        if args.executor:
            model = os.path.join(tmp, "cosmoflow_reference.yaml")
            with open(model, "w") as f:
                f.write(reference_model(args.size, args.in_channels, args.base_filters))

            def executor_row(row, precision, extra=(), limit=None):
                print(f"$ {args.executor} ... --precision {precision} {' '.join(extra)} (the executor on the GPU)",
                      flush=True)
                try:
                    result = subprocess.run([args.executor, "--model", model, "--batch", str(args.batch), "--steps",
                                             str(args.steps), "--warmup", str(args.warmup), "--device", "cuda",
                                             "--precision", precision, "--momentum", "0", "--lr", "1e-3", *extra],
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                            timeout=limit)
                except subprocess.TimeoutExpired as timeout:
                    output = timeout.output or ""
                    output = output.decode(errors="replace") if isinstance(output, bytes) else output
                    print(output + f"(the {row} row ran past {limit} s: left out)", flush=True)
                    log.write(output)
                    return 0
                print(result.stdout, flush=True)
                log.write(result.stdout)
                if result.returncode == 0 and last_json(result.stdout):
                    executor[row] = last_json(result.stdout)
                return result.returncode

            for precision in ("fp32", "bf16"):
                failed |= executor_row(precision, precision)
        failed |= run([sys.executable, os.path.join(HERE, "gpu_cosmoflow_torch.py"), *shape, "--matmul",
                       "--json", records], log)
        if args.executor:
            # Last, bounded and optional (its failure fails nothing): the leaky ReLUs neither in
            # place nor fused into the convolutions and poolings (what those save on the GPU).
            if executor_row("bf16-apart", "bf16", ("--in-place", "off", "--fuse", "off"), limit=45):
                print("(the bf16-apart row failed: left out)", flush=True)
        rows = [json.loads(line) for line in open(records)] if os.path.exists(records) else []
    flops = next((r["step_flops"] for r in rows if r["record"] == "step" and "step_flops" in r), None)
    for precision, result in executor.items():
        rows.append({"record": "step", "framework": "tessera-executor", "precision": precision,
                     "mean_ms": result["step_ms"],
                     "tflops": flops / (result["step_ms"] * 1e-3) / 1e12 if flops else result["gflops"] / 1e3})
    steps = {(r.get("framework", "pytorch"), r["precision"]): r for r in rows if r["record"] == "step"}
    matmul = {(r.get("framework", "pytorch"), r["precision"]): r["tflops"] for r in rows if r["record"] == "matmul"}
    print(f"CosmoFlow {args.batch} x {args.in_channels} x {args.size}^3, base filters {args.base_filters}: "
          "training step on one GPU")
    print(f"{'framework':16s} {'precision':9s} {'ms/step':>9s} {'samples/s':>10s} {'TFLOP/s':>8s} "
          f"{'of matmul':>9s} {'vs PyTorch':>10s}")
    for (framework, precision), r in sorted(steps.items()):
        ms = r.get("mean_ms", r.get("step_ms"))
        base = precision.split("-")[0]  # bf16-exact: bf16's matmul rate and peer
        rate = matmul.get(("tessera" if framework.startswith("tessera") else framework, base))
        peer = steps.get(("pytorch", base))
        peer_ms = peer.get("step_ms") if peer else None
        ratio = f"{peer_ms / ms:9.2f}x" if peer_ms and framework.startswith("tessera") else "-"
        of = f"{r['tflops'] / rate:9.1%}" if rate else "-"
        print(f"{framework:16s} {precision:9s} {ms:9.2f} {args.batch / (ms * 1e-3):10.2f} {r['tflops']:8.2f} "
              f"{of:>9s} {ratio:>10s}")
    for (framework, precision), tflops in sorted(matmul.items()):
        print(f"matmul 8192^3 {framework} {precision}: {tflops:.1f} TFLOP/s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
