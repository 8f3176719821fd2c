#!/usr/bin/env bash
# The README's test command (make test): builds and runs every test in the
# plain build, then in the ASan+UBSan build and the TSan build. Each build
# directory is incremental. MRD_SANITIZERS=0 skips the sanitizer builds.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
jobs=$(nproc)

configure() {  # dir, extra cmake args...
  local dir=$1
  shift
  if [ ! -f "$dir/build.ninja" ]; then
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DMRD_WERROR=ON "$@"
  fi
  cmake --build "$dir" -j "$jobs"
}

total_passed=0
total_failed=0
run() {  # name, dir
  local name=$1 dir=$2 status=0
  echo "== $name tests ($dir)"
  scripts/run-tests.sh "$dir" || status=$?
  local line
  line=$(grep -E 'tests passed, [0-9]+ tests? failed out of [0-9]+' "$dir/ctest.log" | tail -1)
  local failed total
  failed=$(sed -E 's/.* ([0-9]+) tests? failed out of ([0-9]+).*/\1/' <<<"$line")
  total=$(sed -E 's/.* failed out of ([0-9]+).*/\1/' <<<"$line")
  total_failed=$((total_failed + ${failed:-0}))
  total_passed=$((total_passed + ${total:-0} - ${failed:-0}))
  return $status
}

status=0
configure build
run plain build || status=1
if [ "${MRD_SANITIZERS:-1}" != 0 ]; then
  configure build-asan -DMRD_SANITIZE=address
  run "asan+ubsan" build-asan || status=1
  configure build-tsan -DMRD_SANITIZE=thread
  run tsan build-tsan || status=1
fi
echo "all builds: ${total_passed} passed, ${total_failed} failed"
exit $status
