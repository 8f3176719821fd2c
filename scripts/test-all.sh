#!/usr/bin/env bash
# The README's test command (make test): builds and runs every test in the
# plain build, then the device suite on the verbs device inside the Soft-RoCE
# VM (tests/vm), then every test in the ASan+UBSan build and the TSan build
# (both clang-14), then the plain build's integration tests and device suite
# against the TSan build's mrd (see docs/RELIABILITY.md "Sanitizers"), then
# each libFuzzer target for a short while (scripts/fuzz.sh; the targets are
# built by the ASan build; each target counts as one test). Each build directory is
# incremental. MRD_SANITIZERS=0 skips the sanitizer builds and the fuzzers;
# MRD_FUZZ_SECONDS sets the fuzz stage's seconds (default 60: every target
# at once, MRD_FUZZ_PARALLEL of them, default 5). The summary
# gives each stage's time (build and tests) and the total.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
jobs=$(nproc)

# Every build is clang's: it compiles mrd in about 60 % of g++'s time (the
# plain build: 4m08s against 6m58s on 2 cores), it can leave gRPC's header
# code uninstrumented for TSan like the libgrpc behind it
# (tests/support/tsan_ignorelist.txt), and it checks the thread-safety
# annotations. A build directory another compiler configured before is
# configured afresh.
configure() {  # dir, extra cmake args...
  local dir=$1
  shift
  if [ -f "$dir/CMakeCache.txt" ] &&
    ! grep -q '^CMAKE_CXX_COMPILER:FILEPATH=.*clang' "$dir/CMakeCache.txt"; then
    rm -rf "$dir"
  fi
  if [ ! -f "$dir/build.ninja" ]; then
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DMRD_WERROR=ON -DCMAKE_C_COMPILER=clang-14 \
      -DCMAKE_CXX_COMPILER=clang++-14 "$@"
  elif [ $# -gt 0 ]; then
    cmake -B "$dir" "$@" >/dev/null  # options added since it was configured
  fi
  cmake --build "$dir" -j "$jobs"
}

total_passed=0
total_failed=0
# One line per stage and the name of every test that failed, repeated at the
# end: a CI that keeps only the tail of the log still says what failed where.
summary=()
why_failed() {  # test name, ctest log: the first lines of its failure
  # gRPC's own log lines (E1128 23:28:48.79 ...) are skipped: their "ERROR"
  # is rarely the cause. With no gtest failure, sanitizer report, check or
  # timeout to show, the test's last lines are (an abort's last words).
  awk -v name="$1" '
    index($0, ": " name " ") && $0 ~ /Test +#[0-9]+: / { mine = 1; next }
    mine && $0 ~ /^ *[0-9]+\/[0-9]+ Test +#[0-9]+: / { exit }
    !mine { next }
    /^[EWID][0-9][0-9][0-9][0-9] [0-9:.]+ +[0-9]+ / || /^ +Start +[0-9]+: / { next }
    { last[n++ % 4] = substr($0, 1, 200) }
    !found && ($0 ~ /: Failure$/ || $0 ~ /Sanitizer/ || $0 ~ /ERROR/ ||
               $0 ~ /Check failed|[Aa]ssertion|terminate/ ||
               $0 ~ /Timeout|Exception/) { found = 1 }
    found && shown < 4 { print substr($0, 1, 200); shown++ }
    END {
      if (!found) for (i = (n > 4 ? n - 4 : 0); i < n; i++) print last[i % 4]
    }
  ' "$2"
}
count() {  # stage name, ctest log: adds its summary to the totals
  local stage=$1 line
  line=$(grep -E 'tests passed, [0-9]+ tests? failed out of [0-9]+' "$2" | tail -1)
  local failed total
  failed=$(sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\1/' <<<"$line")
  total=$(sed -E 's/.* failed out of ([0-9]+).*/\1/' <<<"$line")
  total_failed=$((total_failed + ${failed:-0}))
  total_passed=$((total_passed + ${total:-0} - ${failed:-0}))
  summary+=("$stage: $((${total:-0} - ${failed:-0})) passed, ${failed:-0} failed")
  local name line
  while IFS= read -r name; do
    summary+=("  failed: $name")
    # The first lines of what the test said about why (its gtest failure or
    # a sanitizer's report), from the output ctest printed for it.
    while IFS= read -r line; do
      summary+=("    $line")
    done < <(why_failed "${name% (*}" "$2")
  done < <(sed -n '/^The following tests FAILED:/,/^[^[:space:]]/p' "$2" |
    grep -E '^[[:space:]]+[0-9]+ - ' | sed -E 's/^[[:space:]]+[0-9]+ - //')
}
run() {  # name, dir
  local name=$1 dir=$2 status=0
  echo "== $name tests ($dir)"
  # ctest starts the tests it knows to be long first, from the times of the
  # last run in that build directory. A fresh sanitizer build has none: it
  # takes the plain build's (the same test names), so that a 30 s test does
  # not start last and run alone on one core at the end.
  local costs=Testing/Temporary/CTestCostData.txt
  if [ ! -f "$dir/$costs" ] && [ -f "build/$costs" ]; then
    mkdir -p "$dir/Testing/Temporary"
    cp "build/$costs" "$dir/$costs"
  fi
  scripts/run-tests.sh "$dir" || status=$?
  count "$name" "$dir/ctest.log"
  return $status
}

# The plain build's tests that start mrd, against the TSan build's mrd.
run_tsan_mrd() {
  local status=0
  echo "== integration vs tsan mrd tests (build, build-tsan/server/mrd)"
  rm -f build/ctest-tsan-mrd.log
  scripts/run-integration-vs-tsan.sh build build-tsan || status=$?
  if ! grep -qsE "tests passed, [0-9]+ tests? failed out of" build/ctest-tsan-mrd.log; then
    echo "integration vs tsan mrd: no ctest summary (status $status)"
    summary+=("integration vs tsan mrd: no ctest summary (status $status)")
    total_failed=$((total_failed + 1))
    return 1
  fi
  count "integration vs tsan mrd" build/ctest-tsan-mrd.log
  return $status
}

# The device suite and the verbs tests on rxe0 inside the Soft-RoCE VM, with
# the plain build.
run_vm() {
  local dir=$root/build status=0
  echo "== verbs device in the Soft-RoCE VM ($dir)"
  # Prepared beside the plain build; run.sh prepares again (at once when
  # that went through, or says why it did not).
  wait "$vm_prepare_pid" || true
  cat "$vm_prepare_log"
  rm -f "$vm_prepare_log"
  rm -f "$dir/ctest-vm.log"
  # The whole checkout is shared writable: the VM then sees the scripts and
  # the build wherever the checkout is (even under /tmp, which is a fresh
  # tmpfs inside the VM), and ctest can write its logs.
  tests/vm/run.sh --rw "$root" --cwd "$root" --timeout "${MRD_VM_TIMEOUT:-2400}" -- \
    "$root/scripts/vm-suite.sh" "$dir" || status=$?
  if ! grep -qsE 'tests passed, [0-9]+ tests? failed out of [0-9]+' \
    "$dir/ctest-vm.log"; then
    echo "verbs device suite: no ctest summary came back from the VM (status $status)"
    summary+=("verbs device in the VM: no ctest summary (status $status)")
    total_failed=$((total_failed + 1))
    return 1
  fi
  count "verbs device in the VM" "$dir/ctest-vm.log"
  return $status
}

# The fuzz targets, each for a bounded time; each target is one test.
run_fuzz() {
  local status=0 line log
  echo "== fuzz targets (build-asan)"
  log=$(mktemp)
  # All five targets at once for 60 s: 24 s of CPU each on 2 cores, in the
  # wall time of two rounds of two targets for 30 s (three rounds, the last
  # one a target alone, took 90 s).
  FUZZ_PARALLEL=${MRD_FUZZ_PARALLEL:-5} MRD_FUZZ_BUILD=build-asan \
    scripts/fuzz.sh "${MRD_FUZZ_SECONDS:-60}" 2>&1 |
    tee "$log" || status=$?
  line=$(grep -E '^fuzz: [0-9]+ passed, [0-9]+ failed' "$log" | tail -1)
  rm -f "$log"
  if [ -z "$line" ]; then
    echo "fuzz: the fuzz build or run failed before any target ran"
    summary+=("fuzz: the fuzz build or run failed before any target ran")
    total_failed=$((total_failed + 1))
    return 1
  fi
  summary+=("$line")
  total_passed=$((total_passed + $(sed -E 's/fuzz: ([0-9]+) passed.*/\1/' <<<"$line")))
  total_failed=$((total_failed + $(sed -E 's/.* ([0-9]+) failed.*/\1/' <<<"$line")))
  return $status
}

status=0
# Each stage's time (its build and its tests) and how busy the machine's
# cores were meanwhile (from /proc/stat, guest time counted once: a stage
# well below 100 % leaves cores idle), printed in the summary.
times=()
cpu_jiffies() {  # prints "busy total" of all cores so far
  awk '/^cpu / { t = 0; for (i = 2; i <= 9; i++) t += $i;
                 print t - $5 - $6, t; exit }' /proc/stat
}
read -r stage_busy stage_total < <(cpu_jiffies)
stage_start=$SECONDS
stage_done() {  # stage name
  local took=$((SECONDS - stage_start)) busy total
  read -r busy total < <(cpu_jiffies)
  local dt=$((total - stage_total))
  times+=("$(printf '%-28s %2dm%02ds  cores busy %3d%%' "$1:" $((took / 60)) \
    $((took % 60)) $((dt > 0 ? 100 * (busy - stage_busy) / dt : 0)))")
  stage_busy=$busy
  stage_total=$total
  stage_start=$SECONDS
}
# Style: every C++ file as clang-format (.clang-format, Google style) has it.
echo "== clang-format"
if ! git ls-files -z '*.cc' '*.h' | xargs -0 clang-format --dry-run --Werror; then
  echo "clang-format: files above need 'make format'"
  summary+=("clang-format: files need 'make format'")
  status=1
fi
# The VM's kernel and initramfs (tests/vm/prepare.sh: a download, dpkg -x,
# depmod and cpio, about 40 s on a fresh clone and mostly waiting) are
# prepared beside the plain build, which keeps both cores busy meanwhile;
# the VM stage waits for it and prints what it said.
vm_prepare_log=$(mktemp)
tests/vm/prepare.sh >"$vm_prepare_log" 2>&1 &
vm_prepare_pid=$!
configure build
stage_done "plain build"
run plain build || status=1
stage_done "plain tests"
run_vm || status=1
stage_done "verbs device in the VM"
if [ "${MRD_SANITIZERS:-1}" != 0 ]; then
  # Benchmarks are not built with sanitizers: they are not tests. The
  # sanitizer builds are unity builds (CMake compiles up to 8 sources of a
  # target as one, so their common headers are parsed once): measured on
  # 2 cores, a fifth less CPU time for the ASan build (1,037 s against
  # 1,300-1,390 s) and two fifths less for the TSan build (463 s against
  # about 800 s). The plain build is not: clang-tidy reads its compile
  # commands source by source, and a name two sources of one target both
  # define fails here first.
  unity=(-DCMAKE_UNITY_BUILD=ON)
  # The ASan build also builds the fuzz targets (MRD_FUZZ: libFuzzer's
  # coverage instrumentation on top of ASan+UBSan), which run last: one
  # build fewer than a fuzz build of their own (398 s of CPU on 2 cores).
  configure build-asan -DMRD_SANITIZE=address -DMRD_BUILD_BENCH=OFF \
    -DMRD_FUZZ=ON "${unity[@]}"
  stage_done "asan+ubsan build"
  run "asan+ubsan" build-asan || status=1
  stage_done "asan+ubsan tests"
  # The TSan build's own tests are the unit, model and stress tests; the
  # system tests run from the plain build against its mrd (run_tsan_mrd).
  configure build-tsan -DMRD_SANITIZE=thread -DMRD_BUILD_BENCH=OFF \
    -DMRD_SYSTEM_TESTS=OFF "${unity[@]}"
  stage_done "tsan build"
  run tsan build-tsan || status=1
  stage_done "tsan tests"
  run_tsan_mrd || status=1
  stage_done "integration vs tsan mrd"
  run_fuzz || status=1
  stage_done "fuzz"
fi
echo "== stage times"
printf '%s\n' "${times[@]}"
printf '%-28s %2dm%02ds\n' "all stages:" $((SECONDS / 60)) $((SECONDS % 60))
echo "== summary"
printf '%s\n' "${summary[@]}"
echo "all builds: ${total_passed} passed, ${total_failed} failed"
exit $status
