#!/usr/bin/env bash
# Runs a command inside a qemu VM (TCG, Debian's kernel) that has Soft-RoCE
# devices rxe0 and rxe1, with the host's root filesystem mounted read-only as
# the VM's root. See tests/vm/README.md.
#
#   tests/vm/run.sh [--rw DIR]... [--timeout SECONDS] [--mem MB] [--cwd DIR]
#                   -- command args...
#
# Exit status: the command's own, or on a harness failure (prepare failed,
# the VM did not boot, rxe0 could not be created, the status could not be
# read back) 125, and 124 when the timeout passed. Never 0 unless the command
# ran inside the VM and exited 0.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE="${MRD_VM_CACHE:-$REPO/.cache/vm}"

HARNESS_FAIL=125
TIMEOUT_FAIL=124

usage() {
  cat >&2 <<'EOF'
usage: tests/vm/run.sh [--rw DIR]... [--timeout SECONDS] [--mem MB] [--cwd DIR] -- command args...
  --rw DIR        mount host DIR writable at the same path in the VM (repeatable)
  --timeout SECS  whole-run limit, boot included (default 1800; env MRD_VM_TIMEOUT)
  --mem MB        VM memory (default 4096; env MRD_VM_MEM)
  --cwd DIR       directory the command runs in (default: the current one)
EOF
  exit 2
}

die() {
  echo "mrd-vm: ERROR: $*" >&2
  exit "$HARNESS_FAIL"
}

RW_DIRS=()
TIMEOUT="${MRD_VM_TIMEOUT:-1800}"
MEM="${MRD_VM_MEM:-4096}"
CWD="$PWD"
BOOT_TIMEOUT="${MRD_VM_BOOT_TIMEOUT:-300}"
SMP="${MRD_VM_SMP:-2}"
CPU="${MRD_VM_CPU:-qemu64}"

while (($#)); do
  case "$1" in
    --rw) (($# >= 2)) || usage; RW_DIRS+=("$2"); shift 2 ;;
    --rw=*) RW_DIRS+=("${1#--rw=}"); shift ;;
    --timeout) (($# >= 2)) || usage; TIMEOUT="$2"; shift 2 ;;
    --timeout=*) TIMEOUT="${1#--timeout=}"; shift ;;
    --mem) (($# >= 2)) || usage; MEM="$2"; shift 2 ;;
    --mem=*) MEM="${1#--mem=}"; shift ;;
    --cwd) (($# >= 2)) || usage; CWD="$2"; shift 2 ;;
    --cwd=*) CWD="${1#--cwd=}"; shift ;;
    --) shift; break ;;
    -h | --help) usage ;;
    *) echo "mrd-vm: unknown option '$1' (the command goes after --)" >&2; usage ;;
  esac
done
(($#)) || usage
[[ $TIMEOUT =~ ^[1-9][0-9]*$ ]] || die "--timeout must be a positive number of seconds, got '$TIMEOUT'"
[[ $BOOT_TIMEOUT =~ ^[1-9][0-9]*$ ]] || die "MRD_VM_BOOT_TIMEOUT must be a positive number, got '$BOOT_TIMEOUT'"
[[ $MEM =~ ^[1-9][0-9]*$ ]] || die "--mem must be a number of MiB, got '$MEM'"
[[ $SMP =~ ^[1-9][0-9]*$ ]] || die "MRD_VM_SMP must be a positive number, got '$SMP'"

CWD="$(cd "$CWD" 2>/dev/null && pwd -P)" || die "--cwd directory does not exist"
declare -a RW_ABS=()
for d in "${RW_DIRS[@]}"; do
  [[ -d $d ]] || die "--rw $d: not a directory"
  a="$(cd "$d" && pwd -P)"
  [[ $a != / ]] || die "--rw /: the root cannot be writable"
  [[ $a != *[[:space:]]* ]] || die "--rw $a: paths with white space are not supported"
  RW_ABS+=("$a")
done
# Parents before children, so nested --rw directories mount in order.
if ((${#RW_ABS[@]})); then
  mapfile -t RW_ABS < <(printf '%s\n' "${RW_ABS[@]}" | sort -u)
fi

fresh_in_vm() {
  case "$1/" in
    /tmp/* | /run/* | /dev/* | /proc/* | /sys/* | /var/tmp/*) return 0 ;;
  esac
  return 1
}
if fresh_in_vm "$CWD"; then
  covered=0
  for a in "${RW_ABS[@]}"; do
    [[ $CWD/ == "$a"/* ]] && covered=1
  done
  ((covered)) || die "--cwd $CWD is under a directory that is empty inside the VM" \
    "(/tmp, /run, /dev, /var/tmp are fresh there); pass it with --rw"
fi

"$HERE/prepare.sh" || die "tests/vm/prepare.sh failed (see above)"

KVER="$(awk '{print $2}' "$CACHE/kernel.ready")"

mkdir -p "$CACHE/runs" || die "cannot create $CACHE/runs"
# Keep the 20 newest run directories.
ls -1dt "$CACHE"/runs/run-* 2>/dev/null | tail -n +21 | xargs -r rm -rf
RUN="$(mktemp -d "$CACHE/runs/run-$(date +%Y%m%d-%H%M%S)-XXXX")" || die "mktemp failed"
OUT="$RUN/output.log"
CONSOLE="$RUN/console.log"
: >"$OUT"

# --- job.sh: what runs in the chroot (bash from the host's root). ---
{
  echo '# Written by tests/vm/run.sh; runs inside the VM.'
  while IFS= read -r name; do
    printf 'export %s=%q\n' "$name" "${!name}"
  done < <(compgen -e | grep -E '^(MRD_|CTEST_)' | sort)
  printf 'export PATH=%q\n' "${PATH:-/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin}"
  echo 'export HOME=/tmp'
  echo 'export MRD_VM=1 MRD_VERBS_DEVICE=rxe0 MRD_VERBS_ADDRESS=10.77.0.1'
  echo 'export MRD_VERBS_DEVICE2=rxe1 MRD_VERBS_ADDRESS2=10.76.0.1'
  [[ -n ${LANG:-} ]] && printf 'export LANG=%q\n' "$LANG"
  echo 'ulimit -l unlimited || { echo "mrd-vm: cannot raise RLIMIT_MEMLOCK" >&2; exit 125; }'
  printf 'cd %q || { echo "mrd-vm: cannot enter %q inside the VM" >&2; exit 125; }\n' "$CWD" "$CWD"
  printf '%q ' "$@"
  echo
} >"$RUN/job.sh"

QEMU_ARGS=(
  -accel tcg -cpu "$CPU" -smp "$SMP" -m "$MEM"
  -nodefaults -no-user-config -nographic -monitor none -nic none
  -serial "file:$CONSOLE" -no-reboot
  -kernel "$CACHE/vmlinuz" -initrd "$CACHE/initramfs.cpio.gz"
  -append "console=ttyS0 panic=-1 quiet loglevel=4 mitigations=off"
  -virtfs "local,path=/,mount_tag=mrdroot,security_model=none,readonly=on,multidevs=remap"
  -virtfs "local,path=$RUN,mount_tag=mrdctl,security_model=none,multidevs=remap"
)
: >"$RUN/rw.list"
i=0
for a in "${RW_ABS[@]}"; do
  QEMU_ARGS+=(-virtfs "local,path=$a,mount_tag=mrdrw$i,security_model=none,multidevs=remap")
  echo "mrdrw$i $a" >>"$RUN/rw.list"
  i=$((i + 1))
done

echo "mrd-vm: kernel $KVER, run directory $RUN" >&2
START=$SECONDS
qemu-system-x86_64 "${QEMU_ARGS[@]}" </dev/null >"$RUN/qemu.log" 2>&1 &
QEMU_PID=$!
TAIL_PID=""
cleanup() {
  [[ -n $TAIL_PID ]] && kill "$TAIL_PID" 2>/dev/null
  if kill -0 "$QEMU_PID" 2>/dev/null; then
    kill "$QEMU_PID" 2>/dev/null
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      kill -0 "$QEMU_PID" 2>/dev/null || break
      sleep 0.5
    done
    kill -9 "$QEMU_PID" 2>/dev/null
  fi
}
trap 'cleanup; echo "mrd-vm: interrupted" >&2; exit 130' INT TERM
trap cleanup EXIT

show_console() {
  echo "----- mrd-vm: last lines of the VM console ($CONSOLE) -----" >&2
  # Without the terminal control sequences the firmware prints.
  tail -n "${1:-40}" "$CONSOLE" 2>/dev/null | sed 's/\x1b\[[0-9;?]*[A-Za-z]//g; s/\x1bc//g' >&2
  if [[ -s $RUN/qemu.log ]]; then
    echo "----- mrd-vm: qemu output ($RUN/qemu.log) -----" >&2
    tail -n 20 "$RUN/qemu.log" >&2
  fi
  if [[ -s $RUN/dmesg.txt ]]; then
    echo "----- mrd-vm: VM kernel log, last lines ($RUN/dmesg.txt) -----" >&2
    tail -n 30 "$RUN/dmesg.txt" >&2
  fi
  echo "-----" >&2
}

has_stage() { grep -qx "$1" "$RUN/stage" 2>/dev/null; }

# Wait for the VM to boot and set up rxe0.
timed_out=""
while kill -0 "$QEMU_PID" 2>/dev/null; do
  has_stage ready && break
  [[ -s $RUN/error ]] && break
  el=$((SECONDS - START))
  if ((el >= TIMEOUT)); then timed_out=run; break; fi
  if ((el >= BOOT_TIMEOUT)); then timed_out=boot; break; fi
  sleep 0.2
done

if [[ -z $timed_out ]] && has_stage ready; then
  echo "mrd-vm: VM ready after $((SECONDS - START)) s (rxe0 on mrd0, 10.77.0.1; rxe1 on mrd1, 10.76.0.1)" >&2
  echo "===== mrd-vm: output of: $* (cwd $CWD; saved to $OUT) ====="
  # Stream the command's output live; it is written to the share by the VM.
  # tail reads to the end of the file once qemu has exited, then stops.
  tail -n +1 -f --pid="$QEMU_PID" "$OUT" &
  TAIL_PID=$!
  while kill -0 "$QEMU_PID" 2>/dev/null; do
    if ((SECONDS - START >= TIMEOUT)); then timed_out=run; break; fi
    sleep 0.5
  done
  [[ -n $timed_out ]] && cleanup
  wait "$TAIL_PID" 2>/dev/null
  TAIL_PID=""
fi

if [[ -n $timed_out ]]; then
  cleanup
  wait "$QEMU_PID" 2>/dev/null
  if [[ $timed_out == boot ]]; then
    show_console
    echo "mrd-vm: ERROR: the VM did not boot and set up rxe0 within $BOOT_TIMEOUT s" \
      "(stages reached: $(tr '\n' ' ' 2>/dev/null <"$RUN/stage" || echo none))" >&2
    exit "$HARNESS_FAIL"
  fi
  echo "===== mrd-vm: end of output (killed) ====="
  show_console 15
  echo "mrd-vm: ERROR: timeout: the run did not finish within $TIMEOUT s;" \
    "output so far is in $OUT" >&2
  exit "$TIMEOUT_FAIL"
fi

wait "$QEMU_PID"
QEMU_RC=$?
ELAPSED=$((SECONDS - START))

if ! has_stage ready; then
  show_console
  if [[ -s $RUN/error ]]; then
    echo "mrd-vm: ERROR: VM setup failed: $(cat "$RUN/error")" >&2
  elif has_stage booted; then
    echo "mrd-vm: ERROR: the VM booted but stopped before rxe0 was ready (qemu exit $QEMU_RC)" >&2
  else
    echo "mrd-vm: ERROR: the VM did not boot (qemu exit $QEMU_RC)" >&2
  fi
  exit "$HARNESS_FAIL"
fi

if [[ ! -s $RUN/status ]]; then
  echo "===== mrd-vm: end of output (no exit status) ====="
  show_console
  [[ -s $RUN/error ]] && echo "mrd-vm: VM reported: $(cat "$RUN/error")" >&2
  echo "mrd-vm: ERROR: the VM ended (qemu exit $QEMU_RC) without writing the command's" \
    "exit status; output so far is in $OUT" >&2
  exit "$HARNESS_FAIL"
fi
STATUS="$(cat "$RUN/status")"
if ! [[ $STATUS =~ ^[0-9]+$ ]] || ((STATUS > 255)); then
  die "unreadable exit status '$STATUS' in $RUN/status"
fi
echo "===== mrd-vm: end of output; exit status $STATUS; ${ELAPSED} s in the VM" \
  "(output saved to $OUT) ====="
exit "$STATUS"
