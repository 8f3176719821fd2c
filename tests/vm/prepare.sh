#!/usr/bin/env bash
# Prepares what tests/vm/run.sh boots: Debian's own kernel (with rdma_rxe,
# Soft-RoCE) and a busybox initramfs holding tests/vm/init.sh and the modules
# it loads. Nothing is installed on the host's kernel: the kernel package is
# downloaded with apt-get and unpacked into the cache directory.
#
# Idempotent: when the cache is complete and the initramfs inputs are
# unchanged it returns at once without touching the network.
#
# Cache: ${MRD_VM_CACHE:-<repo>/.cache/vm}
#   dl/                      downloaded .deb files
#   kernel/                  unpacked kernel package (dpkg -x), depmod'ed
#   kernel.ready             "<package filename> <kernel version>"
#   vmlinuz, initramfs.cpio.gz, initramfs.stamp
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE="${MRD_VM_CACHE:-$REPO/.cache/vm}"
KERNEL_META="${MRD_VM_KERNEL_PACKAGE:-linux-image-amd64}"
export PATH="$PATH:/usr/sbin:/sbin"

die() {
  echo "mrd-vm prepare: ERROR: $*" >&2
  exit 1
}
say() { echo "mrd-vm prepare: $*" >&2; }

as_root() {
  if [[ $(id -u) -eq 0 ]]; then
    "$@"
  elif command -v sudo >/dev/null; then
    sudo "$@"
  else
    die "need root (or sudo) to run: $*"
  fi
}

# Modules the VM needs, in load order; modprobe --show-depends adds their
# dependencies. Required ones must exist (as a module or built in).
REQUIRED_MODULES=(virtio_pci 9pnet_virtio 9p ib_uverbs rdma_ucm rdma_rxe dummy)
# Loaded when present: rxe computes its ICRC with the "crc32" crypto
# algorithm, which nothing loads on demand inside the initramfs.
OPTIONAL_MODULES=(crc32_generic configfs)
# Top-level order matters only for the optional ones (crc32 before rxe).
LOAD_ORDER=(virtio_pci 9pnet_virtio 9p crc32_generic configfs ib_uverbs rdma_ucm
  rdma_rxe dummy)

# Host tools the harness uses, and the Debian packages that provide them.
declare -A TOOL_PKG=(
  [qemu-system-x86_64]=qemu-system-x86
  [cpio]=cpio
  [modprobe]=kmod
  [depmod]=kmod
  [dpkg-deb]=dpkg
  [apt-get]=apt
  [gzip]=gzip
  [ip]=iproute2
  [rdma]=iproute2
  [ibv_devices]=ibverbs-utils
  [ibv_devinfo]=ibverbs-utils
  [ib_write_bw]=perftest
  [rping]=rdmacm-utils
)
# Userspace provider for rxe (librxe-rdmav*.so) and the rest of rdma-core.
EXTRA_PKGS=(busybox-static rdma-core ibverbs-providers)

ensure_host_tools() {
  local missing=() t
  for t in "${!TOOL_PKG[@]}"; do
    command -v "$t" >/dev/null 2>&1 || missing+=("${TOOL_PKG[$t]}")
  done
  [[ -x /bin/busybox ]] || missing+=(busybox-static)
  compgen -G '/usr/lib/*/libibverbs/librxe-rdmav*.so' >/dev/null || missing+=(ibverbs-providers)
  if ((${#missing[@]})); then
    mapfile -t missing < <(printf '%s\n' "${missing[@]}" "${EXTRA_PKGS[@]}" | sort -u)
    say "installing missing host packages: ${missing[*]}"
    as_root apt-get install -y --no-install-recommends "${missing[@]}" >&2 ||
      { as_root apt-get update >&2 && as_root apt-get install -y --no-install-recommends "${missing[@]}" >&2; } ||
      die "could not install ${missing[*]}"
  fi
  file_is_static /bin/busybox || die "/bin/busybox is not statically linked (install busybox-static)"
}

file_is_static() {
  # A static executable has no PT_INTERP program header.
  ! LC_ALL=C readelf -l "$1" 2>/dev/null | grep -q 'Requesting program interpreter'
}

# apt-get download, running apt-get update once when the lists do not know the
# package.
apt_download() {
  local pkg="$1" out
  if out=$(cd "$CACHE/dl" && apt-get download "$pkg" 2>&1); then
    return 0
  fi
  say "apt-get download $pkg failed; updating package lists and retrying"
  echo "$out" | grep -v '^W: Download is performed unsandboxed' >&2 || true
  as_root apt-get update >&2 || die "apt-get update failed"
  (cd "$CACHE/dl" && apt-get download "$pkg" 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2;
    exit "${PIPESTATUS[0]}") || die "apt-get download $pkg failed"
}

prepare_kernel() {
  if [[ -f $CACHE/kernel.ready && -f $CACHE/vmlinuz ]]; then
    return 0
  fi
  mkdir -p "$CACHE/dl"
  say "downloading $KERNEL_META"
  rm -f "$CACHE/dl/${KERNEL_META}"_*.deb
  apt_download "$KERNEL_META"
  local meta
  meta=$(ls -t "$CACHE/dl/${KERNEL_META}"_*.deb | head -1)
  [[ -f $meta ]] || die "apt-get download $KERNEL_META produced no .deb in $CACHE/dl"
  # linux-image-amd64 is a metapackage: its first linux-image-* dependency is
  # the real kernel package.
  local image
  image=$(dpkg-deb -f "$meta" Depends | tr ',|' '\n' | sed 's/(.*//; s/ //g' |
    grep -E '^linux-image-[0-9]' | head -1 || true)
  local deb="$meta"
  if [[ -n $image ]]; then
    say "downloading $image"
    rm -f "$CACHE/dl/${image}"_*.deb
    apt_download "$image"
    deb=$(ls -t "$CACHE/dl/${image}"_*.deb | head -1)
    [[ -f $deb ]] || die "apt-get download $image produced no .deb in $CACHE/dl"
  fi
  say "unpacking $(basename "$deb")"
  rm -rf "$CACHE/kernel.tmp" "$CACHE/kernel"
  mkdir -p "$CACHE/kernel.tmp"
  dpkg -x "$deb" "$CACHE/kernel.tmp" || die "dpkg -x $deb failed"
  local kver
  kver=$(ls "$CACHE/kernel.tmp/lib/modules" 2>/dev/null | head -1)
  [[ -n $kver ]] || die "$deb has no /lib/modules/<version>"
  [[ -f $CACHE/kernel.tmp/boot/vmlinuz-$kver ]] || die "$deb has no /boot/vmlinuz-$kver"
  depmod -b "$CACHE/kernel.tmp" "$kver" || die "depmod -b failed for $kver"
  mv "$CACHE/kernel.tmp" "$CACHE/kernel"
  cp "$CACHE/kernel/boot/vmlinuz-$kver" "$CACHE/vmlinuz.tmp"
  mv "$CACHE/vmlinuz.tmp" "$CACHE/vmlinuz"
  echo "$(basename "$deb") $kver" >"$CACHE/kernel.ready"
  # The unpacked tree is all that is used from now on.
  rm -f "$CACHE"/dl/*.deb
  rm -f "$CACHE/initramfs.stamp"
}

# Prints "name.ko [params]" lines in load order, and copies (decompressing)
# each module into $1.
collect_modules() {
  local dest="$1" kver="$2" m line path name seen=" "
  local optional=" ${OPTIONAL_MODULES[*]} "
  for m in "${LOAD_ORDER[@]}"; do
    local deps
    if ! deps=$(modprobe -C /dev/null -d "$CACHE/kernel" -S "$kver" --show-depends "$m" 2>&1); then
      if [[ $optional == *" $m "* ]]; then
        continue
      fi
      die "kernel $kver has no module $m (needed by the VM): $deps"
    fi
    while read -r line; do
      case "$line" in
        builtin\ *) continue ;;
        insmod\ *) ;;
        *) die "unexpected modprobe output for $m: $line" ;;
      esac
      path=$(awk '{print $2}' <<<"$line")
      name=$(basename "$path")
      name=${name%%.ko*}
      [[ $seen == *" $name "* ]] && continue
      seen+="$name "
      case "$path" in
        *.ko) cp "$path" "$dest/$name.ko" ;;
        *.ko.xz) xz -dc "$path" >"$dest/$name.ko" ;;
        *.ko.zst) zstd -qdc "$path" >"$dest/$name.ko" ;;
        *.ko.gz) gzip -dc "$path" >"$dest/$name.ko" ;;
        *) die "unknown module file type: $path" ;;
      esac || die "could not unpack $path"
      if [[ $name == dummy ]]; then
        echo "$name.ko numdummies=0"  # init.sh creates mrd0 itself
      else
        echo "$name.ko"
      fi
    done <<<"$deps"
  done
  for m in "${REQUIRED_MODULES[@]}"; do
    [[ $seen == *" $m "* ]] && continue
    grep -qE "/$m\.ko" "$CACHE/kernel/lib/modules/$kver/modules.builtin" ||
      die "module $m neither loaded nor built into kernel $kver"
  done
}

build_initramfs() {
  local kver stamp
  kver=$(awk '{print $2}' "$CACHE/kernel.ready")
  stamp=$( {
    cat "$CACHE/kernel.ready"
    sha256sum "$HERE/init.sh" "$HERE/prepare.sh" /bin/busybox
  } | sha256sum | awk '{print $1}')
  if [[ -f $CACHE/initramfs.cpio.gz && -f $CACHE/initramfs.stamp &&
    $(cat "$CACHE/initramfs.stamp") == "$stamp" ]]; then
    return 0
  fi
  say "building initramfs for kernel $kver"
  local tree="$CACHE/initramfs.tmp"
  rm -rf "$tree"
  mkdir -p "$tree"/{bin,sbin,dev,proc,sys,newroot,ctl,lib/modules,etc}
  cp /bin/busybox "$tree/bin/busybox"
  ln -s busybox "$tree/bin/sh"
  install -m 0755 "$HERE/init.sh" "$tree/init"
  local modlist
  modlist=$(collect_modules "$tree/lib/modules" "$kver") || exit 1
  echo "$modlist" >"$tree/etc/modules.list"
  grep -q '^rdma_rxe\.ko' "$tree/etc/modules.list" ||
    grep -q '/rdma_rxe\.ko' "$CACHE/kernel/lib/modules/$kver/modules.builtin" ||
    die "rdma_rxe missing from the module list"
  (cd "$tree" && find . -print0 | LC_ALL=C sort -z |
    cpio --null -o -H newc --owner=0:0 --quiet | gzip -1) >"$CACHE/initramfs.cpio.gz.tmp" ||
    die "cpio/gzip failed"
  mv "$CACHE/initramfs.cpio.gz.tmp" "$CACHE/initramfs.cpio.gz"
  echo "$stamp" >"$CACHE/initramfs.stamp"
  rm -rf "$tree"
  say "initramfs ready ($(du -h "$CACHE/initramfs.cpio.gz" | cut -f1)):" \
    "$(awk '{printf "%s ", $1}' <<<"$modlist")"
}

main() {
  mkdir -p "$CACHE"
  # Several run.sh may start at once: one prepares, the others wait.
  exec 9>"$CACHE/.prepare.lock"
  flock 9
  ensure_host_tools
  prepare_kernel
  build_initramfs
}

main "$@"
