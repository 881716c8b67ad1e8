#!/usr/bin/env bash
# The GPU check, for a lent machine with one NVIDIA GPU (the device tool): it has the CUDA
# toolkit and Python with PyTorch, but no MPI, HDF5, Kokkos or oneDNN and no package registry.
# What it runs comes prepared in device_pack/ (bash scripts/pack_device_check.sh on a build
# machine; carry ["device_pack"]): the GPU tests and benchmark, and the Debian runtime libraries
# they load, unpacked here into a prefix (never into /). cuDNN and cuBLAS are the machine's own:
# the toolkit's, else those of PyTorch's wheels. Prints the test results and the benchmark table
# (Tessera beside PyTorch on the same GPU) in well under 8 minutes; copies the logs to $OUT.
#   run: bash jobs/device_check.sh          (timeout_s 540, carry ["device_pack"])
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PACK="${TESSERA_DEVICE_PACK:-$ROOT/device_pack}"
LOGS="${OUT:-$ROOT/runs/device_check}"
PREFIX="${TMPDIR:-/tmp}/tessera-runtime"
mkdir -p "$LOGS" "$PREFIX"
started=$SECONDS
say() { echo "== [$((SECONDS - started)) s] $*"; }

[ -x "$PACK/bin/gpu_kernels" ] || { echo "device_check: $PACK/bin is missing: run scripts/pack_device_check.sh on a build machine and carry device_pack" >&2; exit 2; }
say "pack of commit $(cat "$PACK/commit" 2>/dev/null || echo '?'); GPU: $(nvidia-smi -L 2>&1 | head -1)"
for deb in "$PACK"/debs/*.deb; do dpkg -x "$deb" "$PREFIX" || { echo "device_check: cannot unpack $deb" >&2; exit 2; }; done

# Library folders: the unpacked Debian runtime, the CUDA toolkit, PyTorch's NVIDIA wheels.
dirs="$PREFIX/usr/lib/x86_64-linux-gnu:$PREFIX/lib/x86_64-linux-gnu"
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && dirs="$dirs:$d"
done
wheel_dirs="$(python3 - <<'PY' 2>/dev/null
import os, sys
try:
    import nvidia
except ImportError:
    sys.exit(0)
wanted = ("libcudnn.so.9", "libcublas.so.13", "libcublasLt.so.13", "libnccl.so.2")
found = set()
for base in nvidia.__path__:
    for folder, _, files in os.walk(base):
        if any(f in wanted for f in files):
            found.add(folder)
print(":".join(sorted(found)))
PY
)"
[ -n "$wheel_dirs" ] && dirs="$dirs:$wheel_dirs"
export LD_LIBRARY_PATH="$dirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
missing="$(ldd "$PACK"/bin/* | grep 'not found' | sort -u)"
if [ -n "$missing" ]; then
  echo "device_check: libraries not found:"; echo "$missing"; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; exit 2
fi
ldd "$PACK/bin/gpu_kernels" | grep -E 'cudnn|cublas' | sed 's/^/   /'

status=0
say "GPU tests: every kernel family against the host backend (fp32: 1e-5)"
timeout 240 "$PACK/bin/gpu_kernels" 2>&1 | tee "$LOGS/gpu_tests.log"
tests=${PIPESTATUS[0]}
timeout 60 "$PACK/bin/gpu_unavailable" 2>&1 | tail -3 | tee -a "$LOGS/gpu_tests.log"
unavailable=${PIPESTATUS[0]}
[ "$tests" -eq 0 ] && [ "$unavailable" -eq 0 ] || status=1

say "NCCL communicator against MPI's (one GPU per rank: 1 rank here, 2 ranks skip on one GPU)"
# Open MPI unpacked into the prefix: OPAL_PREFIX relocates it (plugins, help files, orted).
export OPAL_PREFIX="$PREFIX/usr" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi=("$PREFIX/usr/bin/orterun" --oversubscribe --bind-to none --mca mpi_yield_when_idle 1)
nccl=0
for np in 1 2; do
  timeout 120 "${mpi[@]}" -n $np "$PACK/bin/gpu_nccl" 2>&1 | tee -a "$LOGS/gpu_tests.log"
  code=${PIPESTATUS[0]}
  echo "   gpu_nccl at $np rank(s): exit $code$([ "$code" -eq 77 ] && echo ' (skipped)')"
  [ "$code" -eq 0 ] || [ "$code" -eq 77 ] || nccl=$code
done
[ "$nccl" -eq 0 ] || status=1

say "benchmark: CosmoFlow reference network, 128^3 x 4 channels, batch 4, one training step"
timeout 300 python3 "$ROOT/bench/gpu_compare.py" --tessera "$PACK/bin/gpu_step_bench" --log "$LOGS/bench.log" \
  | tee "$LOGS/summary.txt"
bench=${PIPESTATUS[0]}
[ "$bench" -eq 0 ] || status=1
say "done: gpu tests exit $tests, gpu_unavailable exit $unavailable, nccl exit $nccl, benchmark exit $bench"
exit $status
