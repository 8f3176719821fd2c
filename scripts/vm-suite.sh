#!/usr/bin/env bash
# Runs INSIDE the Soft-RoCE VM (started by tests/vm/run.sh from test-all.sh):
# the device suite (ctest label device_suite: tests/conformance) and the verbs
# device's own tests (label verbs) against rxe0, with mrd on --device=verbs.
#   scripts/vm-suite.sh BUILD_DIR
set -euo pipefail
build_dir=$1
[ -n "${MRD_VERBS_DEVICE:-}" ] || {
  echo "vm-suite: MRD_VERBS_DEVICE is not set: run me through tests/vm/run.sh" >&2
  exit 2
}
ibv_devices | grep -qw "$MRD_VERBS_DEVICE" || {
  echo "vm-suite: device $MRD_VERBS_DEVICE is missing:" >&2
  ibv_devices >&2 || true
  exit 2
}
export MRD_TEST_DEVICE=verbs
cd "$build_dir"
# Emulated CPU (TCG): generous per-test timeout; two tests at a time.
ctest --output-on-failure -j 2 --timeout 900 -L 'device_suite|verbs' \
  | tee ctest-vm.log
exit "${PIPESTATUS[0]}"
