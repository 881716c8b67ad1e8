#!/usr/bin/env bash
# The sanitizer stage of CI (after run_tests.sh), in ONE build (clang, build-sanitize/) to keep CI
# short: Tessera's own code is compiled with AddressSanitizer + UndefinedBehaviorSanitizer and
# libFuzzer coverage (-DTESSERA_FUZZ=ON implies the sanitizers; dependencies stay uninstrumented).
#  1. The unit tests and the MPI tests at 1 and 2 ranks run under the sanitizers. Any report fails
#     the test (-fno-sanitize-recover=all, halt_on_error). Leaks are not checked (detect_leaks=0):
#     Open MPI keeps thousands of small blocks until exit and unloads its plugins in MPI_Finalize,
#     so the leaks' stacks end in "<unknown module>" and no suppressions file can name them.
#  2. libFuzzer on the model-file and plan-file parsers, TESSERA_FUZZ_SECONDS (default 30) each,
#     seeded with models/, plans/ and tests/cli/bad/. Anything but an InputError for a bad file is
#     a failure; the crashing input is kept in build-sanitize/findings/.
# TESSERA_SANITIZE_STAGES="tests fuzz" (default) picks the stages.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_missing
SAN_BUILD="${TESSERA_SANITIZE_BUILD_DIR:-$ROOT/build-sanitize}"
FUZZ_SECONDS="${TESSERA_FUZZ_SECONDS:-30}"
STAGES="${TESSERA_SANITIZE_STAGES:-tests fuzz}"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)

export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"

start=$SECONDS
cmake -S "$ROOT" -B "$SAN_BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTESSERA_FUZZ=ON \
  -DTESSERA_BUILD_BENCH=OFF -DTESSERA_WERROR=OFF -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  "${launcher[@]}" >/dev/null
# Only the binaries of the tests that run here (not the command, not the header checks).
mapfile -t targets < <(ctest --test-dir "$SAN_BUILD" -N -L '^(unit|mpi)$' -E '\.np[34]$' |
  sed -n 's/^ *Test *#[0-9]*: \([^ ]*\)$/\1/p' | sed 's/\.np[0-9]*$//' | sort -u)
cmake --build "$SAN_BUILD" -j"$JOBS" --target "${targets[@]}" fuzz_model fuzz_plan fuzz_onnx
echo "tessera: sanitizer build took $((SECONDS - start)) s"

if [[ " $STAGES " == *" tests "* ]]; then
  start=$SECONDS
  # Unit tests, and the MPI tests at 1 and 2 ranks (mpiexec hands the *SAN_OPTIONS to its ranks).
  ctest --test-dir "$SAN_BUILD" --output-on-failure -j"$JOBS" -L '^(unit|mpi)$' -E '\.np[34]$'
  echo "tessera: sanitizer tests took $((SECONDS - start)) s"
fi

if [[ " $STAGES " == *" fuzz "* ]]; then
  start=$SECONDS
  mkdir -p "$SAN_BUILD/findings"
  for target in model plan onnx; do
    corpus="$SAN_BUILD/corpus/$target"  # grows across runs in one build folder
    mkdir -p "$corpus"
    if [ "$target" = onnx ]; then cp "$ROOT"/tests/fuzz/onnx_seeds/*.onnx "$corpus/"
    else cp "$ROOT"/models/*.yaml "$ROOT"/plans/*.yaml "$ROOT"/tests/cli/bad/*.yaml "$corpus/"; fi
    "$SAN_BUILD/bin/fuzz_$target" -max_total_time="$FUZZ_SECONDS" -timeout=10 -rss_limit_mb=4096 \
      -print_final_stats=1 -artifact_prefix="$SAN_BUILD/findings/$target-" "$corpus"
  done
  echo "tessera: fuzzing took $((SECONDS - start)) s"
fi
