#!/usr/bin/env bash
# Runs the plain build's tests that start mrd (labels integration and
# device_suite, on the software device) against the TSan build's mrd: the
# test binaries stay uninstrumented (they link Debian's gRPC, which TSan
# cannot see synchronize), the server is instrumented. Every test's
# MrdProcess::Stop fails on a ThreadSanitizer report in mrd unless every frame
# of it is inside Debian's uninstrumented libraries (tests/integration/
# mrd_process.h, tests/support/tsan_server.supp). Prints ctest's summary.
#   scripts/run-integration-vs-tsan.sh PLAIN_BUILD_DIR TSAN_BUILD_DIR [ctest args]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
plain=$(cd "$1" && pwd)
tsan=$(cd "$2" && pwd)
shift 2
if [ "$(sed -n 's/^MRD_SANITIZE:STRING=//p' "$tsan/CMakeCache.txt")" != thread ]; then
  echo "$tsan is not a TSan build (MRD_SANITIZE=thread)" >&2
  exit 2
fi
export MRD_TEST_MRD_BINARY=$tsan/server/mrd
# halt_on_error=0: a library-only report must not stop mrd; MrdProcess::Stop
# judges each report (exit code 66 after reports). MrdProcess appends
# log_path=<runtime dir>/sanitizer for each mrd it starts.
export TSAN_OPTIONS="suppressions=$root/tests/support/tsan_server.supp:halt_on_error=0:second_deadlock_stack=1:history_size=4"
unset MRD_TEST_DEVICE  # the software device: the verbs device runs in the VM
cd "$plain"
ctest --output-on-failure -j "$(nproc)" --timeout 300 \
  -L 'integration|device_suite' -LE verbs "$@" | tee ctest-tsan-mrd.log
