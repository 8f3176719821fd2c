# Sourced by tests/image/*_test.sh after setting src and build: root or
# skip (77), podman/buildah settings for this machine, the image's name, a
# work directory, and check() with its failure count.
if [ "$(id -u)" -ne 0 ]; then
  echo "SKIP: building and running containers needs root"
  exit 77
fi
out=$build/image
export CONTAINERS_CONF=$src/tests/image/containers.conf
storage=(--root "$out/storage" --runroot "$out/runroot" --storage-driver vfs)
version=$(sed -n 's/^CMAKE_PROJECT_VERSION:STATIC=//p' "$build/CMakeCache.txt")
image=localhost/mrd:$version
work=$(mktemp -d /tmp/mrd-image-test-XXXXXX)
. "$src/tests/support/check.sh"
