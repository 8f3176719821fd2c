#!/bin/sh
# PID 1 of the mrd test VM (busybox ash; packed into the initramfs by
# tests/vm/prepare.sh, booted by tests/vm/run.sh).
#
# 9p shares from the host (mount tags):
#   mrdroot  the host's root, read-only: the chroot the command runs in
#   mrdctl   the run directory, writable: job.sh and rw.list in; stage,
#            output.log, status, error and dmesg.txt out
#   mrdrwN   host directories mounted writable at the same path (rw.list)
# Then: dummy netdevs mrd0 (10.77.0.1/24) and mrd1 (10.76.0.1/24), Soft-RoCE
# devices rxe0 and rxe1 on them,
# RLIMIT_MEMLOCK unlimited, job.sh in the chroot, its status to mrdctl,
# power off.

/bin/busybox mkdir -p /bin /sbin /usr/bin /usr/sbin /proc /sys /dev
/bin/busybox --install -s
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
umask 022

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

NINEP="trans=virtio,version=9p2000.L,msize=512000"
CTL_MOUNTED=0

say() {
  echo "mrd-vm: [$(cut -d' ' -f1 /proc/uptime)s] $*"
}

stage() {
  say "$*"
  if [ "$CTL_MOUNTED" = 1 ]; then
    echo "$*" >>/ctl/stage
  fi
}

halt_now() {
  sync
  poweroff -f
  # poweroff -f should not return; if it does, let the kernel panic
  # (panic=-1 and qemu -no-reboot end the VM).
  exit 1
}

fail() {
  say "ERROR: $*"
  if [ "$CTL_MOUNTED" = 1 ]; then
    echo "$*" >/ctl/error
    dmesg >/ctl/dmesg.txt 2>&1
  else
    dmesg | tail -n 40
  fi
  halt_now
}

say "init started"
while read -r mod params; do
  [ -n "$mod" ] || continue
  # shellcheck disable=SC2086 # params are separate words
  insmod "/lib/modules/$mod" $params || fail "insmod $mod $params failed"
done </etc/modules.list
say "modules loaded"

mkdir -p /ctl
mount -t 9p -o "$NINEP,cache=none" mrdctl /ctl || fail "cannot mount the mrdctl 9p share"
CTL_MOUNTED=1
stage booted

R=/newroot
mkdir -p $R
# The host's root, read-only. cache=loose: the VM keeps what it read (the
# host's files do not change under a test run).
mount -t 9p -o "$NINEP,ro,cache=loose" mrdroot $R || fail "cannot mount the host root (mrdroot)"
[ -x $R/bin/bash ] || fail "host root mounted but $R/bin/bash is missing"

mount -t proc proc $R/proc || fail "mount proc"
mount -t sysfs sysfs $R/sys || fail "mount sysfs"
mount -t devtmpfs devtmpfs $R/dev || fail "mount devtmpfs"
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts $R/dev/pts || fail "mount devpts"
mount -t tmpfs -o mode=1777 tmpfs $R/dev/shm || fail "mount /dev/shm"
mount -t tmpfs -o mode=1777 tmpfs $R/tmp || fail "mount /tmp"
mount -t tmpfs -o mode=755 tmpfs $R/run || fail "mount /run"
if [ -d $R/var/tmp ]; then
  mount -t tmpfs -o mode=1777 tmpfs $R/var/tmp || fail "mount /var/tmp"
fi
if [ -d /sys/kernel/config ]; then
  mount -t configfs configfs $R/sys/kernel/config 2>/dev/null
fi
mkdir -p $R/run/mrd-vm
mount --bind /ctl $R/run/mrd-vm || fail "bind mount of mrdctl into the chroot"

# Writable host directories, parents first (rw.list is sorted by the host).
if [ -f /ctl/rw.list ]; then
  while read -r tag path; do
    [ -n "$tag" ] || continue
    mkdir -p "$R$path" 2>/dev/null
    # cache=mmap: writes go straight to the host; shared mmap works.
    mount -t 9p -o "$NINEP,cache=mmap" "$tag" "$R$path" ||
      fail "cannot mount writable share $tag at $path"
    say "writable: $path"
  done </ctl/rw.list
fi

in_root() {
  chroot $R /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "$@"
}

in_root ip link set lo up || fail "ip link set lo up"
# A Soft-RoCE device on a dummy netdev of its own: rdma_add NETDEV ADDRESS RXE.
rdma_add() {
  in_root ip link add "$1" type dummy || fail "cannot create dummy netdev $1"
  in_root ip addr add "$2/24" dev "$1" || fail "cannot give $1 $2/24"
  in_root ip link set "$1" up || fail "cannot bring $1 up"
  in_root rdma link add "$3" type rxe netdev "$1" ||
    fail "rdma link add $3 type rxe netdev $1 failed"
}

# Waits until port 1 of RDMA device $1 is ACTIVE (10 s at most).
wait_active() {
  state=""
  i=0
  while [ $i -lt 100 ]; do
    state=$(cat "/sys/class/infiniband/$1/ports/1/state" 2>/dev/null)
    case "$state" in *ACTIVE*) return 0 ;; esac
    sleep 0.1
    i=$((i + 1))
  done
  fail "$1 port 1 not ACTIVE after 10 s (state: '${state:-none}')"
}

in_root ip link set lo up || fail "ip link set lo up"
# rxe0 serves every verbs test; rxe1 is the second device of mrd's
# several-devices tests (--verbs_devices).
rdma_add mrd0 10.77.0.1 rxe0
rdma_add mrd1 10.76.0.1 rxe1
wait_active rxe0
wait_active rxe1
ls $R/dev/infiniband/uverbs* >/dev/null 2>&1 || fail "no /dev/infiniband/uverbs* after creating rxe0"
[ -e $R/dev/infiniband/rdma_cm ] || fail "no /dev/infiniband/rdma_cm (rdma_ucm not loaded?)"

# shellcheck disable=SC3045 # busybox ash has ulimit -l
ulimit -l unlimited || fail "cannot raise RLIMIT_MEMLOCK"
[ -f /ctl/job.sh ] || fail "no job.sh in the mrdctl share"
stage ready

# job.sh sets the environment, directory and command; its output goes
# straight to the host through the share.
chroot $R /usr/bin/env -i /bin/bash /run/mrd-vm/job.sh \
  </dev/null >>/ctl/output.log 2>&1
rc=$?
stage "finished $rc"

if ! { echo "$rc" >/ctl/status.tmp && mv /ctl/status.tmp /ctl/status; }; then
  fail "cannot write the exit status to the mrdctl share"
fi
# Leftover processes of the command die with the VM; flush first.
kill -TERM -1 2>/dev/null
sleep 0.2
kill -KILL -1 2>/dev/null
sync
halt_now
