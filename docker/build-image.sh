#!/usr/bin/env bash
# Builds mrd's container image without a registry or a container engine
# daemon, from Debian packages: debootstrap makes a minimal bookworm root
# with exactly the shared libraries mrd and mrctl use (found with ldd and
# dpkg, plus ibverbs-providers, which libibverbs loads at run time), buildah
# (vfs storage, no daemon) puts mrd and mrctl on it and commits
# localhost/mrd:<version>, and writes it to <out>/mrd-<version>.oci.tar for
# `podman load` or `skopeo copy` to a registry. The entrypoint and settings
# are docker/Dockerfile's (the Dockerfile stays for those with a registry).
#   docker/build-image.sh BUILD_DIR [OUT_DIR]     (root; `make image`)
# Containers storage: OUT_DIR/storage (podman and buildah take it with
# --root OUT_DIR/storage --runroot OUT_DIR/runroot --storage-driver vfs).
set -euo pipefail
build=$(cd "$1" && pwd)
out=${2:-$build/image}
root=$(cd "$(dirname "$0")/.." && pwd)
version=$(sed -n 's/^CMAKE_PROJECT_VERSION:STATIC=//p' "$build/CMakeCache.txt")
tag=localhost/mrd:$version
storage=(--root "$out/storage" --runroot "$out/runroot" --storage-driver vfs)
mkdir -p "$out"

# The packages that hold mrd's and mrctl's shared libraries.
owner() {  # the package of a library path (dpkg knows one of its names)
  dpkg -S "$1" 2>/dev/null || dpkg -S "$(readlink -f "$1")" 2>/dev/null ||
    dpkg -S "/usr$1" 2>/dev/null || dpkg -S "${1#/usr}" 2>/dev/null ||
    { echo "image: no package owns $1" >&2; exit 1; }
}
libs=$(for bin in "$build/server/mrd" "$build/client/mrctl/mrctl"; do
  ldd "$bin" | awk '$3 ~ /^\// {print $3}'
done | sort -u)
packages=$(for lib in $libs; do owner "$lib"; done | cut -d: -f1 | sort -u |
  grep -vx 'libc6\|libgcc-s1\|libstdc++6' | tr '\n' ' ')
packages="${packages}ibverbs-providers"
echo "image: packages: $packages"

# The root file system, rebuilt only when the package list changes.
rootfs=$out/rootfs
if [ "$(cat "$out/rootfs.packages" 2>/dev/null)" != "$packages" ]; then
  rm -rf "$rootfs"
  debootstrap --variant=minbase --include="${packages// /,}" bookworm \
    "$rootfs" http://deb.debian.org/debian >"$out/debootstrap.log" 2>&1 || {
    tail -20 "$out/debootstrap.log"
    exit 1
  }
  # What an image does not need: docs, manuals, locales, apt's lists.
  rm -rf "$rootfs"/usr/share/{doc,man,info,locale} "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/log/*.log
  echo "$packages" >"$out/rootfs.packages"
fi

# mrd and mrctl without debug info; every library they need is there.
mkdir -p "$out/bin"
for bin in "$build/server/mrd" "$build/client/mrctl/mrctl"; do
  strip --strip-debug -o "$out/bin/$(basename "$bin")" "$bin"
done
for bin in mrd mrctl; do
  if chroot "$rootfs" true 2>/dev/null; then
    cp "$out/bin/$bin" "$rootfs/tmp/$bin"
    if chroot "$rootfs" ldd "/tmp/$bin" | grep -F 'not found'; then
      echo "image: $bin lacks shared libraries in the image" >&2
      exit 1
    fi
    rm "$rootfs/tmp/$bin"
  fi
done

buildah "${storage[@]}" rm mrd-image-build >/dev/null 2>&1 || true
ctr=$(buildah "${storage[@]}" from --name mrd-image-build scratch)
trap 'buildah "${storage[@]}" rm "$ctr" >/dev/null 2>&1 || true' EXIT
buildah "${storage[@]}" copy "$ctr" "$rootfs/" / >/dev/null
buildah "${storage[@]}" copy --chmod 0755 "$ctr" "$out/bin/mrd" "$out/bin/mrctl" \
  /usr/local/bin/ >/dev/null
buildah "${storage[@]}" config \
  --label org.opencontainers.image.title=mrd \
  --label "org.opencontainers.image.description=Node-local RDMA memory-registration service (mrd) and its CLI (mrctl)" \
  --label "org.opencontainers.image.version=$version" \
  --label "org.opencontainers.image.revision=$(git -C "$root" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)" \
  --env PATH=/usr/local/bin:/usr/bin:/bin \
  --port 9464 --user 0:0 --stop-signal SIGTERM \
  --entrypoint '["/usr/local/bin/mrd", "--runtime_dir=/run/mrd", "--shm_dir=/dev/shm/mrd", "--metrics_address=0.0.0.0:9464"]' \
  --cmd '[]' "$ctr"
buildah "${storage[@]}" commit --rm "$ctr" "$tag" >/dev/null
trap - EXIT
rm -f "$out/mrd-$version.oci.tar"
buildah "${storage[@]}" push "$tag" "oci-archive:$out/mrd-$version.oci.tar:$tag" >/dev/null
echo "image: $tag (storage $out/storage), archive $out/mrd-$version.oci.tar"
