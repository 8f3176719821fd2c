#!/usr/bin/env bash
# Runs the tests of one build directory with ctest, in parallel, with the
# sanitizer runtime options that build needs, and prints ctest's summary.
#   scripts/run-tests.sh [--quick] BUILD_DIR [extra ctest args]
# --quick (make check): the unit, integration and device-suite tests only,
# leaving out the lint and the slow whole-system tests (model, adversary,
# image, deploy, install, Python, docs) that make test runs.
set -euo pipefail
quick=0
if [ "${1:-}" = --quick ]; then
  quick=1
  shift
fi
build_dir=$1
shift
root=$(cd "$(dirname "$0")/.." && pwd)
sanitize=$(sed -n 's/^MRD_SANITIZE:STRING=//p' "$build_dir/CMakeCache.txt")
# Tests labelled verbs need an RDMA device: they run inside the Soft-RoCE VM
# (scripts/vm-suite.sh), never on the host.
args=(-LE verbs)
case "$sanitize" in
  address)
    # deploy/, the README's recipes, the install, the Python client, the
    # image and the lint are checked once, in the plain build.
    args=(-LE "verbs|deploy|docs|install|python|image|lint")
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1
    export LSAN_OPTIONS="suppressions=$root/tests/support/lsan.supp"
    export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    ;;
  thread)
    export TSAN_OPTIONS="suppressions=$root/tests/support/tsan.supp:halt_on_error=1:second_deadlock_stack=1"
    # Integration tests run gRPC end to end; Debian's gRPC is not built for
    # TSan and its inline header code races on paper with its uninstrumented
    # core (see tests/support/tsan.supp). The unit tests exercise every lock
    # and thread of our own code (core, cache, device, fd server, stress).
    args=(-LE "integration|device_suite|verbs|deploy|docs|install|python|image|lint")
    ;;
esac
if [ "$quick" = 1 ]; then
  args=(-LE "verbs|lint|model|adversary|image|deploy|install|python|docs")
fi
cd "$build_dir"
ctest --output-on-failure -j "$(nproc)" --timeout 300 "${args[@]}" "$@" | tee ctest.log
