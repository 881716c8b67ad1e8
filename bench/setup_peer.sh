#!/usr/bin/env bash
# Installs the current PyTorch from PyPI into bench/.peer-venv, the second peer of the benchmark
# drivers (beside Debian's python3-torch). For benchmarks only: the build and the tests never need
# it. PyPI's torch brings its CUDA libraries (about 5 GB); the CPU path is what the drivers time.
#   bash bench/setup_peer.sh [TORCH_VERSION]      # default: the newest
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.peer-venv"
SPEC="torch${1:+==$1}"
/usr/bin/python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --no-cache-dir "$SPEC" numpy h5py
"$VENV/bin/python3" -c "import torch; print('peer ready: PyTorch', torch.__version__, 'in', '$VENV')"
