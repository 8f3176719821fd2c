#!/usr/bin/env bash
# deploy/systemd/mrd.service against systemd's own checks (Debian's
# systemd-analyze; no running systemd needed):
# - `systemd-analyze verify` finds nothing (the unit's ExecStart pointed at
#   the mrd just built, since /usr/local/bin/mrd is not installed here);
# - it is Type=notify with NotifyAccess=all and reloads by SIGHUP (a live
#   handover, tests/integration/reload_test.cc runs it);
# - `systemd-analyze security --offline` rates its exposure at most 2.0;
# - it keeps the promises its comments make (not root, CAP_IPC_LOCK alone,
#   no memlock limit, /run/mrd);
# - every flag its ExecStart passes is one mrd has.
#   tests/deploy/systemd_test.sh SOURCE_DIR MRD_BINARY
set -uo pipefail
src=$1
mrd=$2
unit=$src/deploy/systemd/mrd.service
. "$src/tests/support/check.sh"
command -v systemd-analyze >/dev/null || {
  echo "FAIL systemd-analyze is missing (scripts/install-deps.sh installs systemd)"
  exit 1
}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sed "s|/usr/local/bin/mrd|$mrd|" "$unit" >"$work/mrd.service"

out=$(systemd-analyze verify --man=no "$work/mrd.service" 2>&1)
rc=$?
[ -z "$out" ] || echo "$out"
check "systemd-analyze verify: clean" test "$rc" -eq 0 -a -z "$out"

rating=$(systemd-analyze security --offline=yes --no-pager "$work/mrd.service" 2>&1 |
  sed -n 's/.*Overall exposure level for mrd.service: \([0-9.]*\).*/\1/p')
echo "exposure: ${rating:-none}"
check "systemd-analyze security: exposure at most 2.0" \
  awk -v r="${rating:-99}" 'BEGIN { exit !(r <= 2.0) }'

has() { grep -qx "$1" "$unit"; }
check "runs as user mrd, not root" has "User=mrd"
check "CAP_IPC_LOCK is its only capability" has "CapabilityBoundingSet=CAP_IPC_LOCK"
check "ambient CAP_IPC_LOCK (pinning without root)" has "AmbientCapabilities=CAP_IPC_LOCK"
check "no memlock limit" has "LimitMEMLOCK=infinity"
check "RuntimeDirectory=mrd" has "RuntimeDirectory=mrd"
check "no new privileges" has "NoNewPrivileges=yes"
# Reload is a live handover: mrd notifies, its successor (a child of the
# main process) says MAINPID and READY=1, and SIGHUP starts it.
check "Type=notify" has "Type=notify"
check "NotifyAccess=all (the successor notifies)" has "NotifyAccess=all"
check "reload sends SIGHUP to the main process" has 'ExecReload=/bin/kill -HUP $MAINPID'

help=$("$mrd" --helpfull 2>&1)
exec_start=$(sed -n 's/^ExecStart=//p' "$unit")
for word in $exec_start; do
  case "$word" in
    --*)
      flag=${word%%=*}
      check "mrd knows $flag" grep -q -- "^ *$flag\b" <<<"$help"
      ;;
  esac
done

echo "$failures failure(s)"
[ "$failures" -eq 0 ]
