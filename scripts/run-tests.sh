#!/usr/bin/env bash
# Runs every registered test of one build directory with ctest, in parallel,
# and prints ctest's summary line.
set -euo pipefail
build_dir=${1:-build}
jobs=$(nproc)
cd "$build_dir"
ctest --output-on-failure -j "$jobs" --timeout 300
