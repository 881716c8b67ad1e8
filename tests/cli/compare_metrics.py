#!/usr/bin/env python3
"""The invariant through the whole command: the training loss at every step of a run on N ranks
equals the 1-rank run's (same model, seed and global batch), within a relative tolerance."""
import json
import sys

reference, other = sys.argv[1], sys.argv[2]
tolerance = float(sys.argv[3]) if len(sys.argv) > 3 else 1e-5


def losses(path):
    rows = [json.loads(line) for line in open(path + "/metrics.jsonl")]
    return [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]


a, b = losses(reference), losses(other)
if len(a) != len(b) or not a:
    sys.exit(f"FAIL: {len(a)} steps in {reference}, {len(b)} in {other}")
worst = max(abs(x[1] - y[1]) / abs(x[1]) for x, y in zip(a, b))
if a[0][1] == a[-1][1]:
    sys.exit("FAIL: the loss did not move")
print(f"{len(a)} steps, largest relative loss difference {worst:.3g}")
if worst > tolerance:
    sys.exit(f"FAIL: above {tolerance}")
print("OK")
