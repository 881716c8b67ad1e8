"""What Tessera's side-by-side benchmark drivers share: running a benchmark program and reading
its JSON result line, the mpirun prefix for bench_train, and the check that PyTorch is there."""
import json
import os
import subprocess
import sys


def last_json(text):
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("no JSON result in:\n" + text)


def run(command, env=None):
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"failed ({result.returncode}): {' '.join(command)}\n{result.stdout}")
    return last_json(result.stdout)


def mpirun(procs, *extra):
    """mpirun for `procs` local ranks, unbound, oversubscription allowed (and root, when root)."""
    command = ["mpirun", "-n", str(procs), "--bind-to", "none", "--oversubscribe", *extra]
    if os.geteuid() == 0:
        command.append("--allow-run-as-root")
    return command


def require_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("the peer needs Debian's PyTorch: apt-get install python3-torch (run with /usr/bin/python3)")
