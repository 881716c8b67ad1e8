#!/bin/bash
# A small strong-scaling study end to end under a real Slurm: jobs/scale.py submits 1- and 2-rank
# points with `tessera job --submit`, waits for them, and writes study.csv and the plots.
# Checks: one CSV row per point, each COMPLETED with a positive time per step, speed-up 1 at the
# smallest point, every PNG present, > 10 kB and not a blank picture. Also: a bad study config
# ends with exit 2 and submits nothing; a study with a failing point exits 1 and records the point
# as FAILED with tessera's error line.
#
#   test_scale.sh TESSERA_BINARY DATA.h5 SLURM_ENV WORK_DIR
# SLURM_ENV is the file the slurm fixture writes (export SLURM_CONF=...). $TESSERA_PYTHON (default
# /usr/bin/python3) needs matplotlib and numpy.
set -euo pipefail
TESSERA=$1 DATA=$2 SLURM_ENV=$3 WORK=$4
PYTHON=${TESSERA_PYTHON:-/usr/bin/python3}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SCALE="$ROOT/jobs/scale.py"

fail() { echo "test_scale: FAIL: $*" >&2; exit 1; }
[ -f "$SLURM_ENV" ] || fail "$SLURM_ENV missing: the slurm fixture did not start"
# shellcheck disable=SC1090
source "$SLURM_ENV"
[ -f "$DATA" ] || fail "$DATA missing: the h5py_data fixture did not run"
rm -rf "$WORK"
mkdir -p "$WORK"

# 1. A bad config: exit 2, a message naming the problem, nothing submitted.
cat > "$WORK/bad.json" <<EOF
{"name": "ctest_bad", "kind": "strong", "model": "models/fashion_cnn.yaml", "data": "$DATA", "ranks": [1, 0],
 "global_batch": 32, "tasks_per_node": 2, "steps": 4}
EOF
set +e
"$PYTHON" "$SCALE" --config "$WORK/bad.json" --tessera "$TESSERA" --out "$WORK/bad" 2> "$WORK/bad.err"
rc=$?
set -e
[ "$rc" -eq 2 ] || fail "bad config: exit $rc, expected 2 ($(cat "$WORK/bad.err"))"
grep -q "'ranks' must be positive" "$WORK/bad.err" || fail "bad config: unexpected message: $(cat "$WORK/bad.err")"
[ -z "$(squeue -h -t all -n tessera-ctest_bad -o %i)" ] || fail "bad config: a job was submitted"
[ ! -e "$WORK/bad" ] || fail "bad config: the study directory was created"

# 2. A point that fails (rank 1 throws at step 2: only the 2-rank point has a rank 1): the study
#    still ends, exits 1, and keeps the point in the CSV as FAILED with tessera's error line.
#    The points run the planner's plans ("plan": "auto"), written per point before submission.
cat > "$WORK/failing.json" <<EOF
{"name": "ctest_failing", "kind": "weak", "model": "models/fashion_cnn.yaml", "data": "$DATA",
 "ranks": [1, 2], "batch_per_rank": 8, "tasks_per_node": 2, "steps": 4, "time": "00:05:00",
 "plan": "auto", "machine": "tests/cli/plans/model_favouring_machine.yaml",
 "train_args": ["--inject-failure", "1:2"]}
EOF
set +e
"$PYTHON" "$SCALE" --config "$WORK/failing.json" --tessera "$TESSERA" --out "$WORK/failing" --poll 0.5 --timeout 120
rc=$?
set -e
[ "$rc" -eq 1 ] || fail "failing study: exit $rc, expected 1"
"$PYTHON" - "$WORK/failing/study.csv" <<'EOF'
import csv, sys
rows = {r["ranks"]: r for r in csv.DictReader(open(sys.argv[1]))}
assert sorted(rows) == ["1", "2"], f"failing study: rows {sorted(rows)}"
assert rows["1"]["state"] == "COMPLETED" and float(rows["1"]["step_s"]) > 0, f"failing study: 1 rank: {rows['1']}"
assert rows["2"]["state"] == "FAILED", f"failing study: 2 ranks: {rows['2']}"
assert "injected failure at step 2" in rows["2"]["error"], f"failing study: error {rows['2']['error']!r}"
assert rows["2"]["step_s"] == "" and rows["2"]["speedup"] == "", f"failing study: 2 ranks has numbers: {rows['2']}"
EOF
for n in 0001 0002; do
  head -1 "$WORK/failing/p$n/plan.yaml" | grep -q "Written by tessera plan" || fail "p$n/plan.yaml is not the planner's"
done
grep -q "filter: 2" "$WORK/failing/p0002/plan.yaml" || fail "the planner's 2-rank plan splits no layer by filter"

# 3. The study itself.
cat > "$WORK/strong.json" <<EOF
{"name": "ctest_strong", "kind": "strong", "model": "models/fashion_cnn.yaml", "data": "$DATA",
 "ranks": [1, 2], "global_batch": 32, "tasks_per_node": 2, "cpus_per_task": 1, "steps": 6,
 "time": "00:05:00", "train_args": ["--lr", "0.05", "--seed", "1", "--progress-every", "3"]}
EOF
set +e
"$PYTHON" "$SCALE" --config "$WORK/strong.json" --tessera "$TESSERA" --out "$WORK/study" --poll 0.5 --timeout 240
rc=$?
set -e
[ -f "$WORK/study/study.csv" ] && cat "$WORK/study/study.csv"
if [ "$rc" -ne 0 ]; then
  for f in "$WORK"/study/p*/*.out; do [ -f "$f" ] && { echo "== $f"; tail -20 "$f"; }; done
  fail "scale.py exited $rc"
fi

"$PYTHON" - "$WORK/study" <<'EOF'
import csv, sys
from pathlib import Path
import numpy as np
import matplotlib.image as mpimg

out = Path(sys.argv[1])
errors = []
rows = list(csv.DictReader(open(out / "study.csv")))
if sorted(int(r["ranks"]) for r in rows) != [1, 2]:
    errors.append(f"expected one row per point (ranks 1 and 2), got {[r['ranks'] for r in rows]}")
for r in rows:
    if r["state"] != "COMPLETED":
        errors.append(f"{r['ranks']} ranks: state {r['state']} ({r['error']})")
        continue
    for key in ("step_s", "seconds", "samples_per_s", "speedup", "efficiency"):
        try:
            ok = float(r[key]) > 0
        except ValueError:
            ok = False
        if not ok:
            errors.append(f"{r['ranks']} ranks: {key} = {r[key]!r}, expected a positive number")
    if r["kind"] != "strong" or int(r["global_batch"]) != 32 or int(r["steps"]) != 6 or not r["job_id"]:
        errors.append(f"{r['ranks']} ranks: unexpected row {r}")
base = [r for r in rows if r["ranks"] == "1" and r["state"] == "COMPLETED"]
if base and abs(float(base[0]["speedup"]) - 1) > 1e-9:
    errors.append(f"the smallest point's speed-up is {base[0]['speedup']}, expected 1")
for name in ("step_time", "speedup", "efficiency", "comm_share", "scaling"):
    png = out / f"{name}.png"
    if not png.is_file():
        errors.append(f"{png} missing")
        continue
    size = png.stat().st_size
    img = mpimg.imread(png)[..., :3]
    colours = len(np.unique((img.reshape(-1, 3) * 255).astype(np.uint8), axis=0))
    if size <= 10_000 or img.std() == 0 or colours < 4:
        errors.append(f"{png}: looks blank ({size} bytes, {colours} colours)")
for p in sorted(out.glob("p*/plan.yaml")):
    n = int(p.parent.name[1:])
    if p.read_text() != f"ranks: {n}\ndefault: {{sample: {n}}}\n":
        errors.append(f"{p}: unexpected plan {p.read_text()!r}")
if errors:
    print("test_scale: FAIL:\n  " + "\n  ".join(errors), file=sys.stderr)
    sys.exit(1)
print("test_scale: OK:", ", ".join(f"{r['ranks']} ranks {1e3 * float(r['step_s']):.1f} ms/step" for r in rows))
EOF
