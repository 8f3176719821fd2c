#!/usr/bin/env bash
# The sidecar pod of deploy/sidecar, played for real with podman (`podman
# kube play`, offline) on the image docker/build-image.sh built: the
# workload container, through the shared socket directory, opens an fd
# session, passes a memfd (SCM_RIGHTS across containers), registers it and
# holds it until a peer's write lands (`mrctl hold --until-written`); a peer
# outside the pod writes through the token; the workload sees the
# write and exits 0; stopping the pod stops mrd with exit 0 and nothing
# pinned. The peer is this machine's mrctl entered into the pod's network
# namespace only (nsenter), where mrd's peer port listens.
#
# deploy/sidecar/deployment.yaml is transformed only as podman 4.3 and a
# finite test need: its pod template becomes a Pod (restartPolicy Never),
# mrd moves from a native sidecar (an initContainer with restartPolicy
# Always, which podman 4.3 does not run) into containers, `image: mrd`
# becomes the local image (kustomize's `images:` does that in a cluster),
# the /dev/shm/mrd emptyDir becomes a tmpfs (podman's emptyDir is not one,
# and mrd requires tmpfs there), fsGroup's effects are spelled out (podman
# applies it neither to volumes nor to groups: prepare-dirs also chgrps them,
# and the pod lists the group in supplementalGroups), and the app's
# placeholder loop becomes the workload above.
#   tests/image/pod_test.sh SOURCE_DIR BUILD_DIR    (root; after image_test)
set -uo pipefail
src=$1
build=$2
. "$src/tests/image/common.sh"
pod=mrd-e2e-$$
cleanup() {
  podman "${storage[@]}" kube down "$work/pod.yaml" >/dev/null 2>&1
  umount "$work/shm" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
podman "${storage[@]}" image exists "$image" || {
  echo "FAIL $image is missing: tests/image/image_test.sh builds it"
  exit 1
}
mkdir "$work/shm"
mount -t tmpfs -o mode=1777,size=64m tmpfs "$work/shm"

/usr/bin/python3 - "$src/deploy/sidecar/deployment.yaml" "$work/pod.yaml" \
  "$pod" "$image" "$work/shm" <<'PY'
import sys
import yaml
source, target, name, image, shm = sys.argv[1:6]
with open(source) as f:
    deployment = yaml.safe_load(f)
template = deployment["spec"]["template"]
spec = template["spec"]
spec["restartPolicy"] = "Never"
init = []
for c in spec.get("initContainers", []):
    if c.pop("restartPolicy", None) == "Always":
        spec["containers"].insert(0, c)  # a native sidecar: a container here
    else:
        init.append(c)
spec["initContainers"] = init
for c in spec["initContainers"] + spec["containers"]:
    if c["image"] == "mrd":
        c["image"] = image
# fsGroup: a kubelet makes each volume group-owned by it and adds it to
# every container's groups; podman 4.3 does neither, so the pod says so.
group = spec.get("securityContext", {}).get("fsGroup")
if group is not None:
    spec["securityContext"]["supplementalGroups"] = [group]
    for c in spec["initContainers"]:
        if c["name"] == "prepare-dirs":
            c["args"][0] = ("chgrp %d /run/mrd /dev/shm/mrd\n" % group) + c["args"][0]
            c["securityContext"]["capabilities"]["add"].append("CHOWN")
for v in spec["volumes"]:
    if v["name"] == "mrd-shm":
        v.pop("emptyDir")
        v["hostPath"] = {"path": shm, "type": "Directory"}
for c in spec["containers"]:
    if c["name"] == "app":
        # Without native sidecars nothing orders the two containers: the
        # workload waits for mrd's health, as the startup probe would.
        c["command"] = ["/bin/sh", "-c"]
        c["args"] = [
            "until /usr/local/bin/mrctl health >/dev/null 2>&1; do "
            "sleep 0.2; done; exec /usr/local/bin/mrctl hold --size=65536 "
            "--fill='nothing yet' --flags=remote_read,remote_write "
            "--until-written=FROM-THE-PEER --duration=120s"]
pod = {"apiVersion": "v1", "kind": "Pod",
       "metadata": {"name": name, "labels": template["metadata"]["labels"]},
       "spec": spec}
with open(target, "w") as f:
    yaml.safe_dump(pod, f)
PY
check "podman kube play starts the sidecar pod" \
  podman "${storage[@]}" kube play "$work/pod.yaml" >"$work/play.log" 2>&1 ||
  cat "$work/play.log"

logs() { podman "${storage[@]}" logs "$pod-$1" 2>&1; }
field() { logs app | sed -n "s/^$1=//p" | head -1; }
for _ in $(seq 150); do
  [ -n "$(field registration.base_address)" ] && break
  sleep 0.2
done
rkey=$(field registration.rkey)
va=$(field registration.base_address)
session=$(field session.session)
check "the workload registered a memfd through the shared socket directory" \
  test -n "$rkey" -a -n "$va" -a -n "$session" || {
  logs app
  logs mrd
}
ticket=$(podman "${storage[@]}" exec "$pod-app" /usr/local/bin/mrctl \
  --session="$session" peer-ticket | sed -n 's/^ticket=//p')
peer_address=$(logs mrd | sed -n 's/.*peers connect to \([0-9.:]*\).*/\1/p' | head -1)
infra=$(podman "${storage[@]}" pod inspect --format '{{.InfraContainerID}}' "$pod")
infra_pid=$(podman "${storage[@]}" inspect --format '{{.State.Pid}}' "$infra")
# The peer: this machine's mrctl, in the pod's network namespace only (where
# mrd's peer port listens, as a remote host on the pod network would reach it).
check "a peer outside the pod writes through the token" \
  nsenter --net="/proc/$infra_pid/ns/net" "$build/client/mrctl/mrctl" \
  peer write --kind=software --address="$peer_address" --ticket="$ticket" \
  --rkey="$rkey" --va="$va" --data=FROM-THE-PEER
code=$(podman "${storage[@]}" wait "$pod-app" 2>/dev/null | tail -1)
check "the workload sees the write and exits 0 (exit ${code:-none})" \
  test "$code" = 0 -a -n "$(logs app | grep -x 'written=FROM-THE-PEER')"
podman "${storage[@]}" pod stop -t 30 "$pod" >/dev/null 2>&1
mrd_code=$(podman "${storage[@]}" inspect --format '{{.State.ExitCode}}' "$pod-mrd")
check "stopping the pod stops mrd with exit 0 and nothing pinned (exit $mrd_code)" \
  test "$mrd_code" = 0 -a -n "$(logs mrd | grep 'device pinned bytes: 0')"
check "podman kube down removes the pod" \
  podman "${storage[@]}" kube down "$work/pod.yaml" >/dev/null
[ "$failures" -eq 0 ] || { echo "---- app ----"; logs app; echo "---- mrd ----"; logs mrd; }
echo "$failures failure(s)"
[ "$failures" -eq 0 ]
