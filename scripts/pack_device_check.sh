#!/usr/bin/env bash
# Prepares, on a build machine with the CUDA toolkit, what a lent GPU machine needs to run
# jobs/device_check.sh: builds the CUDA configuration's GPU tests and benchmark, and collects
# them with the Debian runtime libraries they load (as .deb files, unpacked there into a prefix)
# into device_pack/ (ignored by git; the device tool carries it: carry ["device_pack"]).
#   bash scripts/pack_device_check.sh        # then, on the GPU machine: bash jobs/device_check.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${TESSERA_CUDA_BUILD_DIR:-$ROOT/build-cuda}"
PACK="$ROOT/device_pack"
TARGETS=(gpu_kernels gpu_nccl gpu_train gpu_train_nccl gpu_unavailable gpu_step_bench bench_train tessera)

TESSERA_CUDA_BUILD_DIR="$BUILD" bash "$ROOT/scripts/build_cuda.sh"

rm -rf "$PACK"
mkdir -p "$PACK/bin" "$PACK/debs"
binaries=()
for target in "${TARGETS[@]}"; do
  path="$(find "$BUILD" -type f -name "$target" -perm -u+x | head -1)"
  [ -n "$path" ] || { echo "pack: $target was not built" >&2; exit 1; }
  cp "$path" "$PACK/bin/"
  strip "$PACK/bin/$target"
  binaries+=("$PACK/bin/$target")
done

# The Debian packages of every library the binaries load, except the C/C++ runtime (there on
# any Linux) and the CUDA libraries (cuDNN, cuBLAS, NCCL: the GPU machine has its own); and
# Open MPI's launcher with the libraries of its plugins, for the multi-rank GPU tests.
declare -A packages=([openmpi-bin]=1 [openmpi-common]=1)
ompi_plugins=(/usr/lib/x86_64-linux-gnu/openmpi/lib/openmpi3/*.so /usr/bin/orterun /usr/bin/orted)
while read -r lib; do
  case "$lib" in /usr/local/cuda*|*/libc.so.*|*/libm.so.*|*/libstdc++.so.*|*/libgcc_s.so.*|*/ld-linux*|*/libdl.so.*|*/librt.so.*|*/libpthread.so.*) continue ;; esac
  real="$(readlink -f "$lib")"
  owner="$(dpkg -S "$real" 2>/dev/null || dpkg -S "${real/#\/lib\//\/usr\/lib\/}" 2>/dev/null || dpkg -S "${real/#\/usr\/lib\//\/lib\/}" 2>/dev/null || true)"
  [ -n "$owner" ] || { echo "pack: no Debian package owns $real" >&2; exit 1; }
  # The C library's own packages stay behind: the GPU machine's newer glibc serves them.
  case "${owner%%:*}" in libc6|libgcc-s1|libstdc++6) continue ;; esac
  packages["${owner%%:*}"]=1
done < <(ldd "${binaries[@]}" "${ompi_plugins[@]}" 2>/dev/null | awk '/=>/ && $3 ~ /^\// {print $3}' | sort -u)
(cd "$PACK/debs" && apt-get download -qq "${!packages[@]}")
echo "$(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet || echo +changes)" > "$PACK/commit"
echo "device_pack: ${TARGETS[*]} + ${!packages[*]}"
du -sh "$PACK"
