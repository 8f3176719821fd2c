#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) in build-fuzz with clang-14,
# ASan+UBSan and libFuzzer's coverage (incrementally), then runs each target
# for a bounded time on a working copy of its seed corpus, as many targets
# at once as there are cores.
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
# SECONDS_PER_TARGET defaults to $FUZZ_SECONDS or 45. The seed corpora in
# tests/fuzz/corpus/<target> are copied to build-fuzz/corpus/<target> (the
# repository is never written); what the fuzzer finds stays there for the
# next run. A crash, leak, timeout or violated invariant fails the run: the
# reproducer is kept under build-fuzz/artifacts/ and its path printed
# (reproduce with: build-fuzz/tests/fuzz/<target> <reproducer>).
# Prints the executions of each target and, last,
#   fuzz: N passed, M failed
# FUZZ_PARALLEL=N runs N targets at once (default: one per core).
# For long runs: FUZZ_RUNS=N stops each target after N executions (or at
# SECONDS, whichever comes first) and FUZZ_JOBS=J runs each target in
# libFuzzer's fork mode with J worker processes (one run, one corpus; the
# executions reported are the sum over the workers), e.g.
#   FUZZ_RUNS=10000000 FUZZ_JOBS=2 scripts/fuzz.sh 14400
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
seconds=${1:-${FUZZ_SECONDS:-45}}
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(fd_socket_fuzzer peer_fuzzer import_path_fuzzer core_fuzzer
    cgroup_fuzzer)
fi
# MRD_FUZZ_BUILD names another build directory configured with MRD_FUZZ=ON
# (make test: its ASan build, build-asan, which builds the fuzz targets with
# everything else); that directory is built as it is, never configured here.
dir=${MRD_FUZZ_BUILD:-build-fuzz}
jobs=$(nproc)
runs=${FUZZ_RUNS:-}
fork=${FUZZ_JOBS:-}

if [ ! -f "$dir/build.ninja" ] && [ "$dir" != build-fuzz ]; then
  echo "fuzz: $dir is not configured (MRD_FUZZ=ON)" >&2
  exit 1
fi
if [ ! -f "$dir/build.ninja" ]; then
  launcher=()
  if command -v ccache >/dev/null; then
    launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
  fi
  CC=clang-14 CXX=clang++-14 cmake -S . -B "$dir" -G Ninja \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMRD_WERROR=ON -DMRD_FUZZ=ON \
    -DMRD_BUILD_BENCH=OFF "${launcher[@]}"
fi
cmake --build "$dir" -j "$jobs" --target "${targets[@]}"

mkdir -p "$dir/artifacts" "$dir/corpus"
# Leaks are checked at the end of each run (and by libFuzzer after an input
# whose allocations do not balance, except where noted below).
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1:symbolize=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# One target: its output (the lines below, plus its whole log on failure)
# goes to $dir/artifacts/<target>.out and its summary line to
# $dir/artifacts/<target>.result, "ok ..." or "FAILED ...".
fuzz_one() {
  local t=$1 corpus log status started execs repro why extra
  corpus="$dir/corpus/$t"
  mkdir -p "$corpus"
  if [ -d "tests/fuzz/corpus/$t" ]; then
    cp -n "tests/fuzz/corpus/$t"/* "$corpus"/ 2>/dev/null || true
  fi
  extra=()
  case "$t" in
    # The device's connection threads allocate while libFuzzer counts
    # mallocs, so its per-input leak check would run LSan after nearly every
    # input (4x slower); leaks are still checked when the run ends.
    peer_fuzzer | core_fuzzer) extra=(-detect_leaks=0) ;;
  esac
  # libFuzzer's entropic schedule spends most of core_fuzzer's time on its
  # own feature bookkeeping (measured: 3x fewer executions with it on).
  [ "$t" = core_fuzzer ] && extra+=(-entropic=0)
  [ -n "$runs" ] && extra+=(-runs="$runs")
  [ -n "$fork" ] && extra+=(-fork="$fork")
  log="$dir/artifacts/$t.log"
  echo "== fuzz $t for ${seconds}s (corpus $corpus)"
  status=0
  started=$SECONDS
  # Inputs and timing are libFuzzer's; -timeout: an input running 30 s is a
  # hang (every harness wait is bounded at 10 s). -rss_limit_mb: ASan plus
  # the device's mappings stay far below it unless something grows.
  "$dir/tests/fuzz/$t" -max_total_time="$seconds" -print_final_stats=1 \
    -use_value_profile=1 -timeout=30 -rss_limit_mb=4096 -max_len=4096 \
    -artifact_prefix="$dir/artifacts/$t-" "${extra[@]}" "$corpus" \
    >"$log" 2>&1 || status=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  if [ -n "$fork" ]; then
    # Fork mode prints running totals as "#N: cov: ...".
    execs=$(sed -n 's/^#\([0-9]*\): cov:.*/\1/p' "$log" | tail -1)
  fi
  if [ "$status" -eq 0 ]; then
    echo "$t: ok, ${execs:-?} executions in $((SECONDS - started))s" \
      >"$dir/artifacts/$t.result"
    echo "$t: ok, ${execs:-?} executions"
  else
    repro=$(grep -oE "Test unit written to [^ ]+" "$log" | tail -1 |
      sed 's/Test unit written to //')
    # The first line that says why, repeated in the summary (the end of a
    # CI log may be all that is kept).
    why=$(grep -m1 -E "invariant violated|ERROR:|runtime error|deadly signal" "$log" || true)
    echo "$t: FAILED (exit $status) after ${execs:-?} executions: ${why:-see the log}; reproducer: ${repro:-none written}; log: $log" \
      >"$dir/artifacts/$t.result"
    echo "$t: FAILED (exit $status); last lines of $log:"
    grep -E "invariant violated|ERROR:|SUMMARY:|runtime error" "$log" | head -5 || true
    tail -n 20 "$log"
    echo "reproducer: ${repro:-none written}"
  fi
}

# As many targets at once as there are cores (each libFuzzer process is one
# thread; fork mode's workers count), or FUZZ_PARALLEL at once (make test:
# every target, so that no core idles while an odd one out runs alone; each
# then gets cores x SECONDS / targets of CPU), each target's output printed
# whole when it ends.
parallel=${FUZZ_PARALLEL:-$((jobs / ${fork:-1}))}
[ "$parallel" -ge 1 ] || parallel=1
running=0
for t in "${targets[@]}"; do
  rm -f "$dir/artifacts/$t.result"
  if [ "$running" -ge "$parallel" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  { fuzz_one "$t" >"$dir/artifacts/$t.out" 2>&1; cat "$dir/artifacts/$t.out"; } &
  running=$((running + 1))
done
wait || true
passed=0
failed=0
summary=()
for t in "${targets[@]}"; do
  line=$(cat "$dir/artifacts/$t.result" 2>/dev/null || echo "$t: FAILED: the run ended without a result")
  summary+=("$line")
  case "$line" in
    "$t: ok"*) passed=$((passed + 1)) ;;
    *) failed=$((failed + 1)) ;;
  esac
done
echo "== fuzz summary"
printf '%s\n' "${summary[@]}"
echo "fuzz: ${passed} passed, ${failed} failed"
[ "$failed" -eq 0 ]
