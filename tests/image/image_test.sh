#!/usr/bin/env bash
# The container image, built here without a registry or daemon
# (docker/build-image.sh: debootstrap + buildah), run with podman as the
# manifests run mrd (uid 0 with every capability dropped but IPC_LOCK, no
# privilege escalation, read-only root file system): it must serve health,
# let a client outside the container register a memfd through the shared
# socket directory (SCM_RIGHTS across the container boundary) that a peer
# then reads and writes, and exit 0 on SIGTERM with nothing pinned.
#   tests/image/image_test.sh SOURCE_DIR BUILD_DIR PYTHON_GEN_DIR    (root)
set -uo pipefail
src=$1
build=$2
python_gen=$3
. "$src/tests/image/common.sh"
name=mrd-image-test-$$
cleanup() {
  podman "${storage[@]}" rm -f "$name" >/dev/null 2>&1
  rm -rf "$work"
}
trap cleanup EXIT

check "docker/build-image.sh builds the image" \
  "$src/docker/build-image.sh" "$build" "$out" >"$work/build.log" 2>&1 ||
  tail -30 "$work/build.log"
config=$(podman "${storage[@]}" image inspect --format \
  '{{json .Config.Entrypoint}} {{.Config.User}} {{.Config.StopSignal}}' "$image")
echo "image config: $config"
check "the image runs mrd with the runtime dir, shm dir and metrics of the manifests" \
  grep -qF '["/usr/local/bin/mrd","--runtime_dir=/run/mrd","--shm_dir=/dev/shm/mrd","--metrics_address=0.0.0.0:9464"] 0:0 SIGTERM' <<<"$config"
check "the archive for podman load or a registry exists" \
  test -s "$out/mrd-$version.oci.tar"

mkdir -m 0750 "$work/run"
check "mrd starts in the image as the manifests start it" \
  podman "${storage[@]}" run -d --name "$name" --network=host \
  --cap-drop=all --cap-add=IPC_LOCK --security-opt=no-new-privileges \
  --read-only -v "$work/run:/run/mrd" "$image" \
  --device=software --peer_address=127.0.0.1:0 --metrics_address= \
  >/dev/null
for _ in $(seq 100); do [ -S "$work/run/fd.sock" ] && break; sleep 0.1; done
check "mrctl (outside) gets SERVING from mrd (inside)" \
  "$build/client/mrctl/mrctl" --socket="$work/run/mrd.sock" health
out_py=$(PYTHONPATH=$python_gen:$src/client/python /usr/bin/python3 - "$work/run" <<'PY' 2>&1
import sys
import mrd_client
run = sys.argv[1]
with mrd_client.Client(run + "/mrd.sock", run + "/fd.sock") as c, \
        c.open_fd_session() as s, s.create_buffer(65536) as buffer:
    buffer.memory[:12] = b"from outside"
    flags = mrd_client.REMOTE_READ | mrd_client.REMOTE_WRITE
    with s.register(buffer, flags=flags) as reg, \
            mrd_client.SoftwarePeer.connect(s.peer_ticket()) as peer:
        print("read", peer.read(reg.rkey, reg.base_address, 12).decode())
        peer.write(reg.rkey, reg.base_address, b"FROM")
        print("sees", bytes(buffer.memory[:12]).decode())
PY
)
echo "$out_py"
check "a memfd from outside is registered inside, read and written by a peer" \
  test "$out_py" = "$(printf 'read from outside\nsees FROM outside')"
podman "${storage[@]}" stop -t 30 "$name" >/dev/null
code=$(podman "${storage[@]}" inspect --format '{{.State.ExitCode}}' "$name")
logs=$(podman "${storage[@]}" logs "$name" 2>&1)
check "SIGTERM: mrd exits 0 with nothing pinned (exit $code)" \
  test "$code" = 0 -a -n "$(grep 'device pinned bytes: 0' <<<"$logs")"
[ "$failures" -eq 0 ] || echo "$logs"
echo "$failures failure(s)"
[ "$failures" -eq 0 ]
