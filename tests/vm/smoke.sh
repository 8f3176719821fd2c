#!/usr/bin/env bash
# Smoke test of the Soft-RoCE VM: runs inside it (tests/vm/run.sh -- tests/vm/smoke.sh;
# run from the host it starts the VM itself). Checks that rxe0 exists and is
# active, moves data with perftest's ib_write_bw and with rping (rdma_cm)
# between two processes, and runs verbs_probe.c (memfd + mlock + ibv_reg_mr
# as RDMA WRITE/READ target, bad and stale rkeys rejected).
# Exits non-zero on any failure.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ ${MRD_VM:-} != 1 ]]; then
  exec "$HERE/run.sh" --timeout "${MRD_VM_TIMEOUT:-900}" -- "$HERE/smoke.sh" "$@"
fi

DEV="${MRD_VERBS_DEVICE:-rxe0}"
ADDR="${MRD_VERBS_ADDRESS:-10.77.0.1}"
WORK="$(mktemp -d /tmp/mrd-vm-smoke-XXXXXX)"
PIDS=()
cleanup() {
  local p
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

passed=0
fail() {
  echo "smoke: FAIL: $*" >&2
  exit 1
}
step_start() {
  STEP_T0=$SECONDS
  echo "smoke: --- $*"
}
step_ok() {
  passed=$((passed + 1))
  echo "smoke: ok ($((SECONDS - STEP_T0)) s): $*"
}

# Waits until a TCP port is listened on (perftest's out-of-band exchange).
wait_tcp_listen() {
  local port="$1" pid="$2" _
  for _ in $(seq 300); do
    ss -Hltn "sport = :$port" 2>/dev/null | grep -q . && return 0
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.2
  done
  return 1
}

step_start "ibv_devices lists $DEV"
ibv_devices | tee "$WORK/devices.txt"
awk -v d="$DEV" '$1 == d { found = 1 } END { exit !found }' "$WORK/devices.txt" ||
  fail "ibv_devices does not list $DEV"
step_ok "ibv_devices lists $DEV"

step_start "ibv_devinfo shows $DEV port active"
ibv_devinfo -d "$DEV" | tee "$WORK/devinfo.txt"
grep -q 'state:[[:space:]]*PORT_ACTIVE' "$WORK/devinfo.txt" ||
  fail "ibv_devinfo -d $DEV does not show PORT_ACTIVE"
grep -q 'link_layer:[[:space:]]*Ethernet' "$WORK/devinfo.txt" ||
  fail "$DEV is not a RoCE (Ethernet link layer) device"
step_ok "$DEV port 1 PORT_ACTIVE, link layer Ethernet"

step_start "ib_write_bw server + client over $DEV"
PORT=18515
ITERS=200
timeout 180 ib_write_bw -d "$DEV" -F -n "$ITERS" -s 65536 -p "$PORT" \
  >"$WORK/bw-server.txt" 2>&1 &
SRV=$!
PIDS+=("$SRV")
wait_tcp_listen "$PORT" "$SRV" || {
  cat "$WORK/bw-server.txt"
  fail "ib_write_bw server did not start listening on port $PORT"
}
if ! timeout 180 ib_write_bw -d "$DEV" -F -n "$ITERS" -s 65536 -p "$PORT" "$ADDR" \
  >"$WORK/bw-client.txt" 2>&1; then
  echo "client:"; cat "$WORK/bw-client.txt"
  echo "server:"; cat "$WORK/bw-server.txt"
  fail "ib_write_bw client failed"
fi
wait "$SRV" || {
  cat "$WORK/bw-server.txt"
  fail "ib_write_bw server failed"
}
cat "$WORK/bw-client.txt"
# The result row: "#bytes #iterations BW peak BW average MsgRate".
awk -v n="$ITERS" '$1 == 65536 && $2 == n && $4 > 0 { ok = 1 } END { exit !ok }' \
  "$WORK/bw-client.txt" || fail "ib_write_bw client printed no result row for 65536 bytes x $ITERS"
step_ok "ib_write_bw 65536 B x $ITERS: $(awk -v n="$ITERS" '$1 == 65536 && $2 == n { print $4 " MB/s avg" }' "$WORK/bw-client.txt")"

step_start "rping (rdma_cm) client/server on $ADDR"
COUNT=5
timeout 120 rping -s -a "$ADDR" -C "$COUNT" -v >"$WORK/rping-server.txt" 2>&1 &
SRV=$!
PIDS+=("$SRV")
ok=0
for attempt in 1 2 3 4 5 6 7 8 9 10; do
  sleep 1
  kill -0 "$SRV" 2>/dev/null || break
  if timeout 120 rping -c -a "$ADDR" -C "$COUNT" -v >"$WORK/rping-client.txt" 2>&1; then
    ok=1
    break
  fi
  echo "smoke: rping client attempt $attempt failed:"
  cat "$WORK/rping-client.txt"
done
((ok)) || { cat "$WORK/rping-server.txt"; fail "rping client failed"; }
wait "$SRV" || { cat "$WORK/rping-server.txt"; fail "rping server failed"; }
cat "$WORK/rping-client.txt"
got=$(grep -c '^ping data: rdma-ping-' "$WORK/rping-client.txt" || true)
((got == COUNT)) || fail "rping client printed $got ping lines, expected $COUNT"
got=$(grep -c '^server ping data: rdma-ping-' "$WORK/rping-server.txt" || true)
((got == COUNT)) || { cat "$WORK/rping-server.txt"; fail "rping server printed $got ping lines, expected $COUNT"; }
step_ok "rping $COUNT round trips"

step_start "verbs_probe: memfd + mlock + ibv_reg_mr, RDMA WRITE/READ"
cc -std=gnu11 -O1 -Wall -Wextra -Werror -o "$WORK/verbs_probe" "$HERE/verbs_probe.c" -libverbs ||
  fail "cannot build verbs_probe.c (libibverbs-dev installed?)"
"$WORK/verbs_probe" "$DEV" || fail "verbs_probe failed"
step_ok "verbs_probe"

echo "smoke: $passed passed, 0 failed"
