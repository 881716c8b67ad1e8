# Shared by run_main.sh and run_tests.sh: install what is missing (as root) and build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${TESSERA_BUILD_DIR:-$ROOT/build}"
JOBS="${TESSERA_JOBS:-$(nproc)}"

PACKAGES=(g++ cmake make pkg-config ccache
  libopenmpi-dev openmpi-bin libhdf5-openmpi-dev hdf5-tools zlib1g-dev
  libtrilinos-kokkos-dev libdnnl-dev ocl-icd-opencl-dev libfftw3-dev
  libgloo-dev libonnx-dev libprotobuf-dev libgtest-dev libbenchmark-dev libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libfmt-dev libspdlog-dev
  python3 python3-numpy python3-h5py-mpi python3-yaml python3-matplotlib dataset-fashion-mnist
  python3-torch python3-onnx  # the ONNX tests' numerical oracle (PyTorch 1.13)
  slurm-wlm munge iproute2
  clang libclang-rt-14-dev libomp-dev)  # the sanitizer stage: libFuzzer, ASan/UBSan runtimes, clang's OpenMP

install_missing() {
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -eq 0 ]; then
    echo "tessera: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y --no-install-recommends "${missing[@]}"
  else
    echo "tessera: missing Debian packages. Run:" >&2
    echo "  sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
    exit 1
  fi
}

build() {
  local launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" >/dev/null
  cmake --build "$BUILD" -j"$JOBS"
}

# Open MPI refuses to run as root unless told; these are its documented switches.
mpi_flags() {
  local flags=(--oversubscribe --bind-to none --mca mpi_yield_when_idle 1)
  [ "$(id -u)" -eq 0 ] && flags+=(--allow-run-as-root)
  echo "${flags[@]}"
}
