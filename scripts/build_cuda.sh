#!/usr/bin/env bash
# Builds the CUDA configuration (TESSERA_ENABLE_CUDA=ON, sm_90 unless CMAKE_CUDA_ARCHITECTURES
# says otherwise) in build-cuda/: the libraries with their CUDA sources, the GPU tests and the
# GPU benchmark. Compiles and links only: no GPU is needed (CI runs it; jobs/device_check.sh
# runs the result on a GPU machine, packed by scripts/pack_device_check.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${TESSERA_CUDA_BUILD_DIR:-$ROOT/build-cuda}"
JOBS="${TESSERA_JOBS:-$(nproc)}"
TARGETS=(gpu_kernels gpu_nccl gpu_train gpu_train_nccl gpu_unavailable gpu_step_bench bench_train tessera)
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ] && [ -z "${CUDACXX:-}" ]; then
  echo "build_cuda: no CUDA toolkit (nvcc not on PATH, not in /usr/local/cuda/bin, CUDACXX unset)" >&2
  exit 2
fi
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
cmake -S "$ROOT" -B "$BUILD" -DTESSERA_ENABLE_CUDA=ON -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" >/dev/null
cmake --build "$BUILD" -j"$JOBS" --target "${TARGETS[@]}"
echo "build_cuda: built ${TARGETS[*]} in $BUILD"
