#!/usr/bin/env python3
"""Validation does not depend on how the validation set is cut into batches: the validation rows
(loss, accuracy) of two runs that differ only in --eval-batch agree (loss within a relative
tolerance: the per-sample losses are summed in another order; accuracy exactly)."""
import json
import sys

first, second = sys.argv[1], sys.argv[2]
tolerance = float(sys.argv[3]) if len(sys.argv) > 3 else 1e-5


def rows(path):
    found = [json.loads(line) for line in open(path + "/metrics.jsonl")]
    return [(r["step"], r["loss"], r["accuracy"]) for r in found if r["kind"] == "validation"]


a, b = rows(first), rows(second)
if not a or len(a) != len(b):
    sys.exit(f"FAIL: {len(a)} validation rows in {first}, {len(b)} in {second}")
for (step_a, loss_a, acc_a), (step_b, loss_b, acc_b) in zip(a, b):
    if step_a != step_b:
        sys.exit(f"FAIL: validation at step {step_a} in one run, {step_b} in the other")
    if abs(loss_a - loss_b) > tolerance * abs(loss_a):
        sys.exit(f"FAIL: step {step_a}: validation loss {loss_a} vs {loss_b}")
    if acc_a != acc_b:
        sys.exit(f"FAIL: step {step_a}: validation accuracy {acc_a} vs {acc_b}")
    print(f"step {step_a}: validation loss {loss_a:.6g} / {loss_b:.6g}, accuracy {acc_a}")
print("OK")
