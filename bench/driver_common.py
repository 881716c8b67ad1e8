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


# The PyTorch peers: Debian's (python3-torch) and a current one from PyPI in a virtual environment
# that bench/setup_peer.sh makes. The drivers run every peer found, each in every configuration,
# and compare with the fastest.
PEER_VENV = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".peer-venv", "bin", "python3")


def peer_pythons(requested=None):
    """[(label, interpreter)] of the peers to run: --peer-python if given, else Debian's and the
    venv's where they exist."""
    candidates = requested or ["/usr/bin/python3", PEER_VENV]
    found = []
    for python in candidates:
        if not os.path.exists(python):
            continue
        probe = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
        if probe.returncode == 0:
            found.append((f"PyTorch {probe.stdout.strip()}", python))
    if not found:
        sys.exit("no PyTorch peer: apt-get install python3-torch, or bash bench/setup_peer.sh")
    return found


def require_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("the peer needs Debian's PyTorch: apt-get install python3-torch (run with /usr/bin/python3)")
