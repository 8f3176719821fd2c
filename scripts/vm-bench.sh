#!/usr/bin/env bash
# The verbs registration benchmark, run inside the Soft-RoCE VM. Builds
# bench/verbs_bench in BUILD_DIR (default build) on the host, boots the VM and
# runs it there against rxe0; prints Google Benchmark's table.
#   scripts/vm-bench.sh [BUILD_DIR] [benchmark flags...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_dir=$(cd "${1:-$root/build}" && pwd)
shift || true
cmake --build "$build_dir" -j "$(nproc)" --target verbs_bench mrd
rw=(--rw "$root")
case "$build_dir/" in
  "$root"/*) ;;  # inside the checkout: already shared
  *) rw+=(--rw "$build_dir") ;;
esac
exec "$root/tests/vm/run.sh" "${rw[@]}" --cwd "$root" --mem 6144 --timeout 3000 -- \
  env MRD_TEST_DEVICE=verbs "$build_dir/bench/verbs_bench" \
  --benchmark_counters_tabular=true "$@"
