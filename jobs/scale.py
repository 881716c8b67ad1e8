#!/usr/bin/python3
"""Strong- and weak-scaling studies of Tessera under Slurm.

    jobs/scale.py --config jobs/studies/fashion_strong.yaml [--tessera PATH] [--out DIR] [--dry-run]
    jobs/scale.py --collect DIR          # wait for / re-collect a study submitted earlier

For every rank count of the study it writes a sample-parallel plan file, generates a batch script
with `tessera job` and submits it (`--submit`), waits for all jobs (squeue, then scontrol for the
final JobState), collects each run's summary.json into one CSV (study.csv) with speed-up and
parallel efficiency against the smallest point, and draws the usual scaling plots as PNG files.
A point whose job did not complete is kept in the CSV with its state and the last error line of
its output; the driver then exits 1. A bad study config ends with a message and exit 2 before
anything is submitted. See jobs/README.md for the config keys and the definitions.
"""
import argparse
import csv
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository: relative paths in configs start here

REQUIRED = ("model", "data", "kind", "ranks", "tasks_per_node", "steps")
OPTIONAL = ("name", "val_data", "global_batch", "batch_per_rank", "cpus_per_task", "time", "partition", "account",
            "train_args", "sbatch_lines", "exclusive", "one_at_a_time", "plan", "machine")
CSV_COLUMNS = ("kind", "ranks", "nodes", "global_batch", "steps", "seconds", "step_s", "samples_per_s", "comm_share",
               "speedup", "efficiency", "job_id", "state",
               # beyond the core columns: for reading the results, not for the plots
               "tasks_per_node", "comm_wait_s", "step_s_median", "final_loss", "output", "error")
TIME_RE = re.compile(r"^(\d+-)?\d{1,3}:\d{2}:\d{2}$")
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING",
                 "STAGE_OUT", "SIGNALING", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "STOPPED"}
# Pending reasons that no amount of waiting clears (the job asks for more than the partition has).
NEVER_RUNS = {"PartitionNodeLimit", "PartitionTimeLimit", "PartitionConfig", "BadConstraints",
              "DependencyNeverSatisfied", "InvalidAccount", "InvalidQOS"}


class ConfigError(Exception):
    pass


def log(msg):
    print(f"scale: {msg}", flush=True)


# ----------------------------------------------------------------------------------------- config

def load_config(path):
    path = Path(path)
    if not path.is_file():
        raise ConfigError("no such study config")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError("reading YAML needs PyYAML (Debian: python3-yaml); or write the study as JSON")
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"not valid YAML: {e}")
    elif path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"not valid JSON: {e}")
    else:
        raise ConfigError("a study config is .yaml, .yml or .json")
    if not isinstance(data, dict):
        raise ConfigError("expected a mapping of keys (model, data, kind, ranks, ...)")
    return data


def resolve_path(value, key):
    if not isinstance(value, str) or not value:
        raise ConfigError(f"'{key}' must be a file path")
    p = Path(value)
    if not p.is_absolute():
        p = ROOT / p
    if not p.is_file():
        raise ConfigError(f"'{key}': {p} does not exist")
    return str(p.resolve())


def positive_int(value, key):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"'{key}' must be a positive integer, got {value!r}")
    return value


def validate(cfg, source):
    """Checks a study config and returns it completed with defaults; raises ConfigError."""
    missing = [k for k in REQUIRED if k not in cfg]
    if missing:
        raise ConfigError(f"missing key(s): {', '.join(missing)} (required: {', '.join(REQUIRED)})")
    unknown = sorted(set(cfg) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ConfigError(f"unknown key(s): {', '.join(unknown)} (known: {', '.join(REQUIRED + OPTIONAL)})")
    out = dict(cfg)
    out["name"] = str(cfg.get("name") or Path(source).stem)
    if not re.match(r"^[A-Za-z0-9_.-]+$", out["name"]):
        raise ConfigError(f"'name' may use letters, digits, '_', '.' and '-' only, got {out['name']!r}")
    kind = cfg["kind"]
    if kind not in ("strong", "weak"):
        raise ConfigError(f"unknown kind {kind!r}: 'strong' (fixed global batch) or 'weak' (fixed batch per rank)")
    ranks = cfg["ranks"]
    if not isinstance(ranks, list) or not ranks:
        raise ConfigError(f"'ranks' must be a non-empty list of rank counts, e.g. [1, 2, 4]; got {ranks!r}")
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise ConfigError(f"'ranks' must be positive integers, got {r!r}")
    if len(set(ranks)) != len(ranks):
        raise ConfigError(f"'ranks' lists a rank count twice: {ranks}")
    out["ranks"] = sorted(ranks)
    tpn = positive_int(cfg["tasks_per_node"], "tasks_per_node")
    for r in out["ranks"]:
        if r > tpn and r % tpn:
            raise ConfigError(f"{r} ranks do not fill whole nodes of tasks_per_node={tpn}: "
                              f"points above one node must be multiples of it")
    out["cpus_per_task"] = positive_int(cfg.get("cpus_per_task", 1), "cpus_per_task")
    out["steps"] = positive_int(cfg["steps"], "steps")
    if kind == "strong":
        if "global_batch" not in cfg:
            raise ConfigError("a strong-scaling study needs 'global_batch' (the same on every point)")
        if "batch_per_rank" in cfg:
            raise ConfigError("'batch_per_rank' is for weak scaling; a strong study fixes 'global_batch'")
        gb = positive_int(cfg["global_batch"], "global_batch")
        if gb < out["ranks"][-1]:
            raise ConfigError(f"global_batch {gb} is smaller than {out['ranks'][-1]} ranks: every rank needs a sample")
    else:
        if "batch_per_rank" not in cfg:
            raise ConfigError("a weak-scaling study needs 'batch_per_rank' (global batch = batch_per_rank x ranks)")
        if "global_batch" in cfg:
            raise ConfigError("'global_batch' is for strong scaling; a weak study fixes 'batch_per_rank'")
        positive_int(cfg["batch_per_rank"], "batch_per_rank")
    out["time"] = str(cfg.get("time", "00:10:00"))
    if not TIME_RE.match(out["time"]):
        raise ConfigError(f"'time' must be HH:MM:SS (or D-HH:MM:SS), got {out['time']!r}")
    for key in ("partition", "account"):
        if key in cfg and (not isinstance(cfg[key], str) or not cfg[key]):
            raise ConfigError(f"'{key}' must be a non-empty string")
    args = cfg.get("train_args", [])
    if isinstance(args, str):
        args = shlex.split(args)
    if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) for a in args):
        raise ConfigError("'train_args' must be a list of strings (or one string) passed to tessera train")
    args = [str(a) for a in args]
    for fixed in ("--steps", "--batch", "--plan", "--data", "--model", "--metrics-dir", "--val-data"):
        if any(a == fixed or a.startswith(fixed + "=") for a in args):
            raise ConfigError(f"'train_args' may not set {fixed}: the study sets it per point")
    out["train_args"] = args
    lines = cfg.get("sbatch_lines", [])
    if not isinstance(lines, list) or not all(isinstance(x, str) and x.startswith("#SBATCH") for x in lines):
        raise ConfigError("'sbatch_lines' must be a list of lines starting with '#SBATCH'")
    for key in ("exclusive", "one_at_a_time"):
        out[key] = cfg.get(key, True)
        if not isinstance(out[key], bool):
            raise ConfigError(f"'{key}' must be true or false")
    out["plan"] = cfg.get("plan", "sample")
    if out["plan"] not in ("sample", "auto"):
        raise ConfigError(f"plan {out['plan']!r}: 'sample' (every layer split by sample) or 'auto' (the planner's "
                          "plan for each point on 'machine')")
    if out["plan"] == "auto":
        if not cfg.get("machine"):
            raise ConfigError("plan 'auto' needs 'machine': a machine file (tessera calibrate, or machines/)")
        out["machine"] = resolve_path(cfg["machine"], "machine")
    elif cfg.get("machine"):
        raise ConfigError("'machine' is for plan 'auto'")
    out["model"] = resolve_path(cfg["model"], "model")
    out["data"] = resolve_path(cfg["data"], "data")
    if cfg.get("val_data"):
        out["val_data"] = resolve_path(cfg["val_data"], "val_data")
    return out


def points_of(cfg):
    points = []
    tpn = cfg["tasks_per_node"]
    for r in cfg["ranks"]:
        nodes = max(1, r // tpn) if r > tpn else 1
        per_node = tpn if r > tpn else r
        batch = cfg["global_batch"] if cfg["kind"] == "strong" else cfg["batch_per_rank"] * r
        points.append({"ranks": r, "nodes": nodes, "tasks_per_node": per_node, "global_batch": batch})
    return points


# ------------------------------------------------------------------------------------------ slurm

def run(cmd, **kw):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def job_command(tessera, cfg, point, submit):
    """The `tessera job` command line of one point."""
    cmd = [tessera, "job", "--model", cfg["model"], "--data", cfg["data"]]
    if cfg.get("val_data"):
        cmd += ["--val-data", cfg["val_data"]]
    cmd += ["--plan", point["plan"], "--nodes", str(point["nodes"]), "--tasks-per-node", str(point["tasks_per_node"]),
            "--cpus-per-task", str(cfg["cpus_per_task"]), "--time", cfg["time"]]
    for key in ("partition", "account"):
        if cfg.get(key):
            cmd += [f"--{key}", cfg[key]]
    # One job name for the whole study: with one_at_a_time, Slurm's singleton dependency runs the
    # points one after another, so they never compete for the same cores.
    cmd += ["--job-name", f"tessera-{cfg['name']}"]
    lines = []
    if cfg["exclusive"]:
        lines.append("#SBATCH --exclusive")
    if cfg["one_at_a_time"]:
        lines.append("#SBATCH --dependency=singleton")
    lines += cfg.get("sbatch_lines", [])
    for line in lines:
        cmd += ["--sbatch-line", line]
    cmd += ["--workdir", point["dir"], "--metrics-dir", point["metrics_dir"], "--output", point["script"]]
    # Timing runs: no checkpoint at the end (it would count in the time) and no resume from an
    # earlier study's checkpoints in the same folder.
    cmd.append("--no-checkpoints")
    if submit:
        cmd.append("--submit")
    cmd += ["--", "--steps", str(cfg["steps"]), "--batch", str(point["global_batch"])] + cfg["train_args"]
    return cmd


def last_line(text):
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    return lines[-1] if lines else ""


def scontrol_job(job_id):
    """JobState, StdOut, ExitCode, Reason of a job Slurm still remembers; None if it does not."""
    r = run(["scontrol", "show", "job", "-o", str(job_id)])
    if r.returncode != 0 or "JobState=" not in r.stdout:
        return None
    fields = {}
    for token in r.stdout.split():
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def sacct_state(job_id):
    if not shutil.which("sacct"):
        return None
    r = run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State"])
    state = r.stdout.split()[0] if r.returncode == 0 and r.stdout.split() else None
    return state.rstrip("+") if state else None


def wait_for(points, poll, timeout):
    """Polls squeue until every submitted job has left the queue, then records its final state."""
    waiting = {p["job_id"]: p for p in points
               if p.get("job_id") and (p.get("state") in (None, "SUBMITTED", "UNKNOWN") or p["state"] in ACTIVE_STATES)}
    for p in waiting.values():
        p.pop("error", None)
    start = time.monotonic()
    last_report = ""
    while waiting:
        ids = ",".join(waiting)
        r = run(["squeue", "-h", "-j", ids, "-o", "%i %T %r"])
        active = {}
        for line in r.stdout.splitlines() if r.returncode == 0 else []:
            parts = line.split(None, 2)
            if len(parts) >= 2 and parts[0] in waiting and parts[1] in ACTIVE_STATES:
                active[parts[0]] = parts[1]
                reason = parts[2].strip() if len(parts) > 2 else ""
                if parts[1] == "PENDING" and reason in NEVER_RUNS and not waiting[parts[0]].get("error"):
                    # Slurm keeps such a job pending forever; it is ours, so end it and say why.
                    point = waiting[parts[0]]
                    run(["scancel", parts[0]])
                    point["error"] = f"Slurm cannot run this job here (pending, reason {reason}); cancelled it"
                    log(f"{point['ranks']} rank(s): job {parts[0]}: {point['error']}")
        if r.returncode != 0 and "Invalid job id" not in r.stderr:  # squeue's answer once all are purged
            log(f"squeue failed ({last_line(r.stderr)}); retrying")
            time.sleep(poll)
            continue
        for job_id in list(waiting):
            point = waiting[job_id]
            info = scontrol_job(job_id)
            if info and info.get("StdOut"):
                point["output"] = info["StdOut"]
            if job_id in active and (not info or info.get("JobState") in ACTIVE_STATES):
                continue
            if info:
                point["state"] = info.get("JobState", "UNKNOWN")
                point["exit_code"] = info.get("ExitCode", "")
            else:
                point["state"] = sacct_state(job_id) or "UNKNOWN"
            log(f"{point['ranks']} rank(s): job {job_id} {point['state']}")
            del waiting[job_id]
        report = ", ".join(f"{waiting[j]['ranks']}:{active.get(j, '?')}" for j in waiting)
        if report and report != last_report:
            log(f"waiting (ranks:state) {report}")
            last_report = report
        if not waiting:
            break
        if timeout and time.monotonic() - start > timeout:
            for job_id, point in waiting.items():
                point["state"] = active.get(job_id, "UNKNOWN")
                point["error"] = f"still {point['state']} after --timeout {timeout:g} s (not cancelled)"
            log(f"gave up waiting after {timeout:g} s; the jobs keep running: collect later with --collect")
            break
        time.sleep(poll)


# ---------------------------------------------------------------------------------------- results

ERROR_RE = re.compile(r"error|exception|abort|killed|cancelled|time limit|out of memory|segmentation|"
                      r"no such file|not found|refused|failed", re.IGNORECASE)


def output_file(point):
    out = point.get("output")
    if out and Path(out).is_file():
        return Path(out)
    if point.get("job_id"):  # Slurm's default name, in the job's working directory
        for cand in sorted(Path(point["dir"]).glob(f"*{point['job_id']}*.out")):
            return cand
    return None


def last_error_line(point):
    path = output_file(point)
    if not path:
        return "no output file found"
    try:
        lines = [l.strip() for l in path.read_text(errors="replace").splitlines() if l.strip()]
    except OSError as e:
        return f"cannot read {path}: {e}"
    # Tessera's own message first, then Slurm's verdict (*** ... CANCELLED ... DUE TO TIME LIMIT ***),
    # then anything that looks like an error.
    for pattern in (re.compile(r"^tessera: error"), re.compile(r"\*\*\*.*\*\*\*"), ERROR_RE):
        for line in reversed(lines):
            if pattern.search(line):
                return line[:300]
    return (lines[-1][:300] if lines else f"{path} is empty")


def median_step(metrics_dir):
    """Median time of one step without the first (warm-up) step, from metrics.jsonl; None if unknown."""
    path = Path(metrics_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    elapsed = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("kind", "train") == "train" and "elapsed_s" in row:
            elapsed.append(float(row["elapsed_s"]))
    steps = [b - a for a, b in zip(elapsed, elapsed[1:])]
    return statistics.median(steps) if steps else None


def collect(cfg, points):
    """Reads each point's summary.json; fills speed-up and efficiency. Returns the CSV rows."""
    for p in points:
        summary = Path(p["metrics_dir"]) / "summary.json"
        p["ok"] = False
        if p.get("state") == "COMPLETED" and summary.is_file():
            try:
                s = json.loads(summary.read_text())
                p["summary"] = s
                p["ok"] = s.get("step_s", 0) > 0
                if not p["ok"]:
                    p["error"] = f"{summary}: step_s is not positive"
            except (json.JSONDecodeError, OSError) as e:
                p["error"] = f"{summary}: {e}"
        elif p.get("state") == "COMPLETED":
            p["error"] = f"job completed but wrote no {summary}"
        elif not p.get("error"):
            p["error"] = last_error_line(p)
    done = [p for p in points if p["ok"]]
    base = min(done, key=lambda p: p["ranks"]) if done else None
    rows = []
    for p in points:
        s = p.get("summary", {})
        row = {"kind": cfg["kind"], "ranks": p["ranks"], "nodes": p["nodes"], "global_batch": p["global_batch"],
               "steps": s.get("steps", cfg["steps"]), "job_id": p.get("job_id", ""), "state": p.get("state", ""),
               "tasks_per_node": p["tasks_per_node"], "output": str(output_file(p) or ""),
               "error": "" if p["ok"] else p.get("error", "")}
        if p["ok"]:
            row.update({k: s.get(k, "") for k in ("seconds", "step_s", "samples_per_s", "comm_share", "comm_wait_s",
                                                   "final_loss")})
            med = median_step(p["metrics_dir"])
            row["step_s_median"] = f"{med:.6g}" if med is not None else ""
            # speed-up = throughput ratio to the smallest point; efficiency = speed-up / rank ratio.
            rate = p["global_batch"] / s["step_s"]
            base_rate = base["global_batch"] / base["summary"]["step_s"]
            p["speedup"] = rate / base_rate
            p["efficiency"] = p["speedup"] * base["ranks"] / p["ranks"]
            row["speedup"] = f"{p['speedup']:.6g}"
            row["efficiency"] = f"{p['efficiency']:.6g}"
        rows.append(row)
    return rows, base


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow({k: row.get(k, "") for k in CSV_COLUMNS})


# ------------------------------------------------------------------------------------------ plots

def plot(cfg, points, base, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    done = [p for p in points if p["ok"]]
    failed = [p for p in points if not p["ok"]]
    P = [p["ranks"] for p in done]
    T = [p["summary"]["step_s"] for p in done]
    batch = (f"global batch {cfg['global_batch']}" if cfg["kind"] == "strong"
             else f"batch {cfg['batch_per_rank']} per rank")
    title = f"{cfg['name']}: {cfg['kind']} scaling, {Path(cfg['model']).stem}, {batch}"
    note = ("\nnot completed: " + ", ".join(f"{p['ranks']} ranks ({p.get('state') or 'not run'})" for p in failed)
            if failed else "")
    P0, T0 = base["ranks"], base["summary"]["step_s"]
    xs = [p["ranks"] for p in points]
    grid = sorted(set(xs))

    def rank_axis(ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(grid)
        ax.set_xticklabels([str(x) for x in grid])
        ax.set_xlabel("ranks (MPI processes)")
        ax.grid(True, which="both", alpha=0.3)

    def step_time(ax):
        ideal = [T0 * P0 / r if cfg["kind"] == "strong" else T0 for r in grid]
        ax.plot(grid, [1e3 * t for t in ideal], "--", color="gray", label="ideal")
        ax.plot(P, [1e3 * t for t in T], "o-", color="C0", label="measured")
        for x, y in zip(P, T):
            ax.annotate(f"{y * 1e3:.3g} ms", (x, 1e3 * y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_ylabel("time per step (ms, log scale)")
        ax.set_title("time per step" + (" (fixed global batch)" if cfg["kind"] == "strong" else " (fixed batch/rank)"))
        rank_axis(ax)
        ax.legend()

    def speedup(ax):
        ax.plot(grid, [r / P0 for r in grid], "--", color="gray", label="ideal")
        ax.plot(P, [p["speedup"] for p in done], "o-", color="C1", label="measured")
        ax.set_ylabel(f"speed-up vs {P0} rank{'s' if P0 > 1 else ''}" +
                      (" (throughput ratio)" if cfg["kind"] == "weak" else ""))
        ax.set_title("speed-up" if cfg["kind"] == "strong" else "scaled speed-up")
        rank_axis(ax)
        ax.set_yscale("log", base=2)  # log-log: the ideal is a straight line
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.legend()

    def efficiency(ax):
        eff = [100 * p["efficiency"] for p in done]
        ax.axhline(100, linestyle="--", color="gray", label="ideal")
        ax.plot(P, eff, "o-", color="C2", label="measured")
        for x, y in zip(P, eff):
            ax.annotate(f"{y:.0f}%", (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
        ax.set_ylim(0, max([110] + [e * 1.1 for e in eff]))
        ax.set_ylabel("parallel efficiency (%)")
        ax.set_title("parallel efficiency")
        rank_axis(ax)
        ax.legend(loc="lower left")

    def comm_share(ax):
        labels = [str(p["ranks"]) for p in points]
        comm = [p["summary"]["comm_wait_s"] * 1e3 if p["ok"] else 0 for p in points]
        total = [p["summary"]["step_s"] * 1e3 if p["ok"] else 0 for p in points]
        compute = [max(t - c, 0) for t, c in zip(total, comm)]
        x = range(len(points))
        ax.bar(x, compute, color="C0", label="compute (and everything else)")
        ax.bar(x, comm, bottom=compute, color="C3", label="waiting for communication")
        top = max(total) if any(total) else 1
        for i, p in enumerate(points):
            text = f"{100 * p['summary']['comm_share']:.0f}% comm" if p["ok"] else (p.get("state") or "not run")
            ax.text(i, (total[i] if p["ok"] else 0) + 0.02 * top, text, ha="center", fontsize=8)
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels)
        ax.set_xlabel("ranks (MPI processes)")
        ax.set_ylabel("time per step (ms)")
        ax.set_ylim(0, top * 1.35)
        ax.set_title("where a step's time goes")
        ax.legend(fontsize=8, loc="upper center", ncol=2)
        ax.grid(True, axis="y", alpha=0.3)

    files = []
    for name, draw in (("step_time", step_time), ("speedup", speedup), ("efficiency", efficiency),
                       ("comm_share", comm_share)):
        fig, ax = plt.subplots(figsize=(6.4, 4.8))
        draw(ax)
        fig.suptitle(title + note, fontsize=9)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        files.append(path)
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for ax, draw in zip(axes.flat, (step_time, speedup, efficiency, comm_share)):
        draw(ax)
    fig.suptitle(title + note, fontsize=11)
    fig.tight_layout()
    path = out / "scaling.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    files.append(path)
    return files


# ------------------------------------------------------------------------------------------- main

def save_state(out, cfg, points):
    keep = ("ranks", "nodes", "tasks_per_node", "global_batch", "dir", "plan", "script", "metrics_dir", "job_id",
            "state", "output", "error", "exit_code")
    state = {"config": cfg, "points": [{k: p[k] for k in keep if k in p} for p in points]}
    (out / "study.json").write_text(json.dumps(state, indent=2) + "\n")


def finish(cfg, points, out):
    rows, base = collect(cfg, points)
    save_state(out, cfg, points)
    write_csv(out / "study.csv", rows)
    log(f"wrote {out / 'study.csv'}")
    for r in rows:
        if r["error"]:
            log(f"  {r['ranks']:>4} ranks  {r['state'] or 'not run':<12} {r['error']}")
        else:
            log(f"  {r['ranks']:>4} ranks  {r['state']:<12} step {float(r['step_s']) * 1e3:8.2f} ms  "
                f"speed-up {float(r['speedup']):5.2f}  efficiency {100 * float(r['efficiency']):5.1f}%  "
                f"comm {100 * float(r['comm_share']):4.1f}%")
    if base:
        for path in plot(cfg, points, base, out):
            log(f"wrote {path}")
    else:
        log("no point completed: no plots")
    failed = [p for p in points if not p["ok"]]
    if failed:
        log(f"{len(failed)} of {len(points)} point(s) did not complete")
        return 1
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="study config (.yaml or .json); see jobs/README.md")
    src.add_argument("--collect", metavar="DIR", help="a study directory submitted earlier: wait for its jobs and collect")
    ap.add_argument("--tessera", help="the tessera binary (default: $TESSERA_BIN, else build/bin/tessera)")
    ap.add_argument("--out", help="study directory (default: runs/scale/NAME)")
    ap.add_argument("--dry-run", action="store_true", help="write plans and batch scripts, submit nothing")
    ap.add_argument("--poll", type=float, default=2.0, help="seconds between squeue polls (default 2)")
    ap.add_argument("--timeout", type=float, default=0, help="stop waiting after this many seconds (0: no limit)")
    a = ap.parse_args()

    if a.collect:
        out = Path(a.collect).resolve()
        try:
            state = json.loads((out / "study.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"scale: error: {out}/study.json: {e}", file=sys.stderr)
            return 2
        cfg, points = state["config"], state["points"]
        wait_for(points, a.poll, a.timeout)
        return finish(cfg, points, out)

    try:
        cfg = validate(load_config(a.config), a.config)
        tessera = a.tessera or os.environ.get("TESSERA_BIN") or str(ROOT / "build" / "bin" / "tessera")
        tessera = shutil.which(tessera) or tessera
        if not (os.path.isfile(tessera) and os.access(tessera, os.X_OK)):
            raise ConfigError(f"tessera binary {tessera} not found or not executable (build it, or pass --tessera)")
        tessera = str(Path(tessera).resolve())
        if not a.dry_run:
            for tool in ("squeue", "scontrol"):
                if not shutil.which(tool):
                    raise ConfigError(f"'{tool}' is not on PATH: is Slurm installed here? (--dry-run needs no Slurm)")
            try:
                import matplotlib  # noqa: F401  (checked now, not after hours of jobs)
            except ImportError:
                raise ConfigError("the plots need matplotlib (Debian: python3-matplotlib)")
    except ConfigError as e:
        print(f"scale: error: {a.config}: {e}", file=sys.stderr)
        return 2

    out = Path(a.out).resolve() if a.out else ROOT / "runs" / "scale" / cfg["name"]
    out.mkdir(parents=True, exist_ok=True)
    points = points_of(cfg)
    for p in points:
        d = out / f"p{p['ranks']:04d}"
        d.mkdir(exist_ok=True)
        p.update(dir=str(d), plan=str(d / "plan.yaml"), script=str(d / "job.sbatch"), metrics_dir=str(d / "metrics"))
        # Written out so the study records what ran: every layer split by sample, or the planner's
        # plan for this point (rank count and global batch) on the machine file.
        if cfg["plan"] == "auto":
            r = run([tessera, "plan", "--model", cfg["model"], "--ranks", str(p["ranks"]), "--batch",
                     str(p["global_batch"]), "--machine", cfg["machine"], "-o", p["plan"]])
            if r.returncode != 0:
                print(f"scale: error: planning {p['ranks']} rank(s): {last_line(r.stderr) or last_line(r.stdout)}",
                      file=sys.stderr)
                return 2
        else:
            Path(p["plan"]).write_text(f"ranks: {p['ranks']}\ndefault: {{sample: {p['ranks']}}}\n")
        stale = Path(p["metrics_dir"]) / "summary.json"
        if stale.exists():
            stale.unlink()  # never collect an earlier study's result
    log(f"{cfg['kind']} scaling study '{cfg['name']}': ranks {cfg['ranks']}, {cfg['steps']} steps, out {out}")

    failed_submit = False
    for p in points:
        cmd = job_command(tessera, cfg, p, submit=not a.dry_run)
        r = run(cmd)
        if r.returncode != 0:
            p["state"] = "SUBMIT_FAILED" if not a.dry_run else "SCRIPT_FAILED"
            p["error"] = last_line(r.stderr) or last_line(r.stdout) or f"tessera job exited {r.returncode}"
            log(f"{p['ranks']} rank(s): tessera job failed ({r.returncode}): {p['error']}")
            failed_submit = True
            continue
        if a.dry_run:
            log(f"{p['ranks']} rank(s): {p['script']}  ({p['nodes']} node(s) x {p['tasks_per_node']} tasks)")
            log("    " + " ".join(shlex.quote(c) for c in cmd))
            continue
        m = re.fullmatch(r"job_id=(\S+)", last_line(r.stdout))
        if not m:
            p["state"] = "SUBMIT_FAILED"
            p["error"] = f"tessera job printed no 'job_id=' line: {last_line(r.stdout)!r}"
            log(f"{p['ranks']} rank(s): {p['error']}")
            failed_submit = True
            continue
        p["job_id"], p["state"] = m.group(1), "SUBMITTED"
        log(f"{p['ranks']} rank(s): submitted job {p['job_id']} ({p['nodes']} node(s) x {p['tasks_per_node']} tasks, "
            f"global batch {p['global_batch']})")
    save_state(out, cfg, points)
    if a.dry_run:
        log(f"dry run: plans and scripts under {out}; nothing submitted")
        return 1 if failed_submit else 0
    try:
        wait_for(points, a.poll, a.timeout)
    except KeyboardInterrupt:
        log(f"interrupted; the jobs keep running: collect later with  jobs/scale.py --collect {out}")
        return 130
    return finish(cfg, points, out)


if __name__ == "__main__":
    sys.exit(main())
