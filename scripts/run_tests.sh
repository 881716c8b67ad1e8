#!/usr/bin/env bash
# The whole test suite: install what is missing, build, run every test (unit, MPI at 1-4 ranks,
# command-line end to end). Every test has a timeout.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
install_missing
build
cd "$BUILD"
ctest --output-on-failure -j"$JOBS" "$@"
