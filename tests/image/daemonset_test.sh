#!/usr/bin/env bash
# The node's mrd of deploy/daemonset, played for real with podman (`podman
# kube play`, offline) on the image docker/build-image.sh built, serving
# three workload pods made from deploy/examples/node-client.yaml through the
# host directories, as on a node: the greedy pod and the neighbour pod run
# as uid 1000, the other pod as uid 1001. It checks that mrd's quotas are
# per pod:
#   1. a `mrctl hold` in each pod says session.tenant=pod:<that pod's id>
#      (podman's pod id), three different tenants;
#   2. the greedy pod registers its whole share of pinned bytes and is then
#      refused LIMIT_TENANT_PINNED_BYTES naming its own tenant, while the
#      neighbour (same uid) and the other pod register, and a peer on the
#      host network reads through their tokens;
#   3. `mrctl tenant list` in the mrd pod (podman exec, root: the admin
#      socket) lists the three tenants;
#   4. removing the greedy pod releases everything it held: its tenant's
#      pinned bytes go to 0, and the neighbour's whole share, which did not
#      fit in the node's total while the greedy pod held its own, now does;
#   5. stopping the mrd pod (workloads still holding) stops mrd with exit 0
#      and nothing pinned.
# mrd runs with --max_total_pinned_bytes=128M --tenant_default_percent=50,
# so a share is 64M and two shares fill the node: check 4's "now" then
# depends on the greedy pod's release, not just on per-pod quotas.
#
# hostPID: podman 4.3's kube play ignores spec.hostPID (it learned it in
# 4.4, containers/podman#17157): played as is, the pod gets a pid namespace
# of its own (PidMode private), SO_PEERCRED then gives mrd pid 0 for every
# workload, and each counts as its uid. The least surprising equivalent
# keeps both the manifest and kube play: the pod spec keeps hostPID: true,
# and the mrd pod alone is played with a containers.conf that is
# tests/image/containers.conf plus `pidns = "host"`, podman's default pid
# namespace for the containers it creates. Every container of that pod
# (prepare-dirs and mrd) then gets the host's pid namespace, as hostPID
# gives them, and nothing else changes; the workload pods are played with
# the usual file and keep their own. The test checks that podman recorded
# PidMode host. (`podman pod create --pid=host` would leave kube play,
# `podman run --pid=host` the manifest.)
#
# deploy/daemonset/daemonset.yaml is transformed only as podman 4.3, this
# machine and a finite test need: the DaemonSet's pod template becomes a Pod
# (restartPolicy Never), played with the ConfigMap of configmap.yaml (its
# flag file as is); `image: mrd` becomes the local image (kustomize's
# `images:` does that in a cluster); the hostPath directories /run/mrd,
# /dev/shm/mrd, /dev/infiniband and /var/log/pods become directories of the
# test's work dir (the shm one a tmpfs, as the host's /dev/shm is; the
# infiniband one empty, so --device=auto picks the software device; the pod
# logs one empty: podman pods are named by their ids); the optional Secret
# of etcd's credentials, which the test does not make, becomes an empty
# directory; NODE_IP, from status.hostIP, becomes 127.0.0.1 and
# `$(NODE_IP)` in args is expanded (the kubelet's work: podman 4.3 refuses
# that fieldRef and passes `$(NODE_IP)` on literally), NODE_NAME
# (spec.nodeName) becomes test-node and the variables taken from
# configmap.yaml's ConfigMaps (the directory's, empty endpoints: no
# directory; empty TLS and user flags: none) their values there; mrd's
# two ports become 0 (any free one: this
# machine's network may have another mrd on 7471 or 9464; peers learn the
# port from their ticket); and args after the flag file (which win) add the
# third uid to --allowed_uids and set the small totals above. hostNetwork
# stays, so the peer is this machine's mrctl, as any host of the node's
# network would reach mrd. Probes and preStop stay too, but podman runs
# none of them here (its health checks need systemd timers): the test
# waits for mrd's health itself. The workload pods are node-client.yaml's
# pod template, its own command (the health loop) included, with the uid
# set per pod and its host directories pointed at the same work dirs;
# every `mrctl hold` runs in them with `podman exec`, so in their cgroups,
# as the pod's app would.
#   tests/image/daemonset_test.sh SOURCE_DIR BUILD_DIR    (root; after image_test)
set -uo pipefail
src=$1
build=$2
. "$src/tests/image/common.sh"
ds=mrd-ds-$$
greedy=mrd-greedy-$$
neighbour=mrd-neighbour-$$
other=mrd-other-$$
mrctl=$build/client/mrctl/mrctl
share=$((64 << 20))
declare -A hold_fd=()
hold_pids=()
pm() { podman "${storage[@]}" "$@"; }
cleanup() {
  local fd pid
  for fd in "${hold_fd[@]}"; do exec {fd}>&-; done
  pm pod rm -f -t 0 -i "$greedy" "$neighbour" "$other" >/dev/null 2>&1
  pm kube down "$work/mrd.yaml" >/dev/null 2>&1
  pm volume rm -f mrd-flags >/dev/null 2>&1  # the ConfigMap's (kube down keeps it)
  for pid in "${hold_pids[@]}"; do kill "$pid" 2>/dev/null; done
  umount "$work/shm" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
pm image exists "$image" || {
  echo "FAIL $image is missing: tests/image/image_test.sh builds it"
  exit 1
}
# within SECONDS COMMAND...: runs COMMAND every 0.1 s until it succeeds or
# SECONDS have passed.
within() {
  local deadline=$((SECONDS + $1))
  shift
  until "$@"; do
    [ "$SECONDS" -lt "$deadline" ] || return 1
    sleep 0.1
  done
}
mkdir -m 0755 "$work/run" "$work/shm" "$work/infiniband" "$work/pod-logs"
mount -t tmpfs -o mode=1777,size=64m tmpfs "$work/shm"
sed '/^\[containers\]/a pidns = "host"' "$CONTAINERS_CONF" >"$work/hostpid.conf"

/usr/bin/python3 - "$src/deploy" "$work" "$image" "$ds" \
  "$greedy:1000" "$neighbour:1000" "$other:1001" <<'PY'
import copy
import re
import sys
import yaml
deploy, work, image, ds_name = sys.argv[1:5]
clients = [a.rsplit(":", 1) for a in sys.argv[5:]]
host_dirs = {"/run/mrd": work + "/run", "/dev/shm/mrd": work + "/shm",
             "/dev/infiniband": work + "/infiniband",
             "/var/log/pods": work + "/pod-logs"}

def to_pod(name, template, spec):
    spec["restartPolicy"] = "Never"
    for c in spec.get("initContainers", []) + spec["containers"]:
        if c["image"] in ("mrd", "registry.example.com/mrd:0.1.0"):
            c["image"] = image
    for v in spec["volumes"]:
        if "hostPath" in v:
            v["hostPath"]["path"] = host_dirs[v["hostPath"]["path"]]
        elif "secret" in v and v["secret"].get("optional"):
            # An optional Secret nobody made (the directory's etcd
            # credentials): an empty directory, as the kubelet mounts it.
            del v["secret"]
            v["emptyDir"] = {}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": template["metadata"]["labels"]},
            "spec": spec}

# The node's mrd.
with open(deploy + "/daemonset/daemonset.yaml") as f:
    ds = next(d for d in yaml.safe_load_all(f) if d and d["kind"] == "DaemonSet")
with open(deploy + "/daemonset/configmap.yaml") as f:
    configmaps = [d for d in yaml.safe_load_all(f) if d]
configmap = next(d for d in configmaps if d["metadata"]["name"] == "mrd-flags")
values = {(d["metadata"]["name"], k): v
          for d in configmaps for k, v in d.get("data", {}).items()}
template = ds["spec"]["template"]
spec = template["spec"]
assert spec.get("hostPID") is True, "daemonset.yaml lacks hostPID: true"
for c in spec["initContainers"] + spec["containers"]:
    env = {}
    for e in c.get("env", []):
        source = e.get("valueFrom", {})
        if source.get("fieldRef", {}).get("fieldPath") == "status.hostIP":
            del e["valueFrom"]
            e["value"] = "127.0.0.1"
        elif source.get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
            del e["valueFrom"]
            e["value"] = "test-node"
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            del e["valueFrom"]
            e["value"] = values[(ref["name"], ref["key"])]
        env[e["name"]] = e.get("value")
    c["args"] = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a)
                 for a in c.get("args", [])]
mrd = next(c for c in spec["containers"] if c["name"] == "mrd")
ports = {"--metrics_address=127.0.0.1:9464": "--metrics_address=127.0.0.1:0",
         "--peer_address=127.0.0.1:7471": "--peer_address=127.0.0.1:0"}
assert set(ports) <= set(mrd["args"]), mrd["args"]
mrd["args"] = [ports.get(a, a) for a in mrd["args"]]
assert mrd["args"][0].startswith("--flagfile="), mrd["args"]
mrd["args"] += ["--allowed_uids=1000,1001",
                "--max_total_pinned_bytes=%d" % (128 << 20),
                "--tenant_default_percent=50"]
with open(work + "/mrd.yaml", "w") as f:
    yaml.safe_dump_all([configmap, to_pod(ds_name, template, spec)], f)

# The workloads: node-client.yaml's pod template, one pod per name:uid.
with open(deploy + "/examples/node-client.yaml") as f:
    deployment = yaml.safe_load(f)
pods = []
for name, uid in clients:
    template = copy.deepcopy(deployment["spec"]["template"])
    spec = template["spec"]
    spec["securityContext"]["runAsUser"] = int(uid)
    pods.append(to_pod(name, template, spec))
with open(work + "/clients.yaml", "w") as f:
    yaml.safe_dump_all(pods, f)
PY

# The node's mrd, in the host's pid namespace (the header says how).
check "podman kube play starts the DaemonSet's pod" \
  env CONTAINERS_CONF="$work/hostpid.conf" podman "${storage[@]}" \
  kube play "$work/mrd.yaml" >"$work/play-mrd.log" 2>&1 || cat "$work/play-mrd.log"
logs() { pm logs "$1" 2>&1; }
check "mrd runs in the host's pid namespace (hostPID)" \
  test "$(pm inspect --format '{{.HostConfig.PidMode}}' "$ds-mrd")" = host
check "mrd serves on the node's socket directory" \
  within 20 "$mrctl" --socket="$work/run/mrd.sock" health >/dev/null 2>&1 ||
  logs "$ds-mrd"

check "podman kube play starts the three workload pods" \
  pm kube play "$work/clients.yaml" >"$work/play-clients.log" 2>&1 ||
  cat "$work/play-clients.log"
serving() { logs "$1-app" | grep -qx 'status=SERVING'; }
all_serving() { serving "$greedy" && serving "$neighbour" && serving "$other"; }
check "each workload's own loop finds mrd serving through the host directory" \
  within 20 all_serving
# uid:groups of a pod's app container
ids() {
  echo "$(pm exec "$1-app" /usr/bin/id -u):$(pm exec "$1-app" /usr/bin/id -G | tr ' ' ,)"
}
ids=$(ids "$greedy")/$(ids "$neighbour")/$(ids "$other")
check "the workloads run as uid 1000, 1000 and 1001, with group 2000 ($ids)" \
  test "$ids" = 1000:1000,2000/1000:1000,2000/1001:1000,2000

# hold NAME POD ARGS...: `mrctl hold ARGS` in POD's app container, its stdin
# a pipe this script holds open (closing it releases), its output in
# $work/NAME.out.
hold() {
  local name=$1 pod=$2 fd
  shift 2
  mkfifo "$work/$name.in"
  (
    for fd in "${hold_fd[@]}"; do exec {fd}>&-; done  # the other holds' pipes
    exec podman "${storage[@]}" exec -i "$pod-app" /usr/local/bin/mrctl hold "$@" \
      <"$work/$name.in" >"$work/$name.out" 2>&1
  ) &
  hold_pids+=($!)
  exec {fd}>"$work/$name.in"
  hold_fd[$name]=$fd
}
field() { sed -n "s/^$2=//p" "$work/$1.out" | head -1; }
registered() { [ -n "$(field "$1" registration.rkey)" ]; }
pod_id() { pm pod inspect --format '{{.ID}}' "$1"; }
hold g "$greedy" --size=$share --fill=greedy --flags=remote_read
hold n "$neighbour" --size=4096 --fill=from-the-neighbour --flags=remote_read
hold o "$other" --size=4096 --fill=from-the-other-uid --flags=remote_read
all_registered() { registered g && registered n && registered o; }
check "the three pods hold registrations (the greedy one its whole share)" \
  within 30 all_registered ||
  cat "$work/g.out" "$work/n.out" "$work/o.out"

# 1. A tenant per pod.
tenant_g=pod:$(pod_id "$greedy")
tenant_n=pod:$(pod_id "$neighbour")
tenant_o=pod:$(pod_id "$other")
tenant_is() {  # tenant_is HOLD POD TENANT
  check "$2's session counts against its pod: $(field "$1" session.tenant)" \
    test "$(field "$1" session.tenant)" = "$3"
}
tenant_is g "$greedy" "$tenant_g"
tenant_is n "$neighbour" "$tenant_n"
tenant_is o "$other" "$tenant_o"
tenants=$(for h in g n o; do field $h session.tenant; done | grep . | sort -u | wc -l)
check "three different tenants, two of them of uid 1000 ($tenants)" test "$tenants" = 3

# 2. The greedy pod at its quota; the others register, a peer reads.
refusal=$(pm exec "$greedy-app" /usr/local/bin/mrctl hold --size=4096 \
  --flags=remote_read 2>&1 </dev/null)
code=$?
echo "greedy's next 4 KiB: $refusal"
check "the greedy pod's next 4 KiB is refused LIMIT_TENANT_PINNED_BYTES naming its pod (exit $code)" \
  test "$code" = 5 -a -n "$(grep -F "LIMIT_TENANT_PINNED_BYTES" <<<"$refusal" |
    grep -F "$tenant_g")"
# peer_read NAME POD LENGTH: the peer on the host network reads LENGTH bytes
# through NAME's registration (a ticket of its session, asked in POD).
peer_read() {
  local ticket_out ticket address
  ticket_out=$(pm exec "$2-app" /usr/local/bin/mrctl \
    --session="$(field "$1" session.session)" peer-ticket)
  ticket=$(sed -n 's/^ticket=//p' <<<"$ticket_out")
  address=$(sed -n 's/^peer_address=//p' <<<"$ticket_out")
  "$mrctl" peer read --kind=software --address="$address" --ticket="$ticket" \
    --rkey="$(field "$1" registration.rkey)" \
    --va="$(field "$1" registration.base_address)" --length="$3"
}
check "a peer reads through the neighbour pod's token (same uid as the greedy one)" \
  test "$(peer_read n "$neighbour" 18)" = from-the-neighbour
check "a peer reads through the uid-1001 pod's token" \
  test "$(peer_read o "$other" 18)" = from-the-other-uid

# 3. The operator's view, in the mrd pod (root: the admin socket).
tenants_json() {
  pm exec "$ds-mrd" /usr/local/bin/mrctl --json tenant list
}
# used TENANT RESOURCE: what tenant list says TENANT uses of RESOURCE
# ("absent" when it lists no such tenant).
used() {
  tenants_json | /usr/bin/python3 -c '
import json, sys
tenant, resource = sys.argv[1:3]
for t in json.load(sys.stdin).get("tenants", []):
    if t["name"] == tenant:
        print(next((r.get("used", "0") for r in t.get("resources", [])
                    if r["resource"] == resource), "0"))
        break
else:
    print("absent")' "$1" "$2"
}
pinned_g=$(used "$tenant_g" pinned_bytes)
pinned_n=$(used "$tenant_n" pinned_bytes)
pinned_o=$(used "$tenant_o" pinned_bytes)
check "mrctl tenant list in the mrd pod lists the three pods' tenants (pinned: $pinned_g, $pinned_n, $pinned_o)" \
  test "$pinned_g" = $share -a "$pinned_n" = 4096 -a "$pinned_o" = 4096 ||
  tenants_json

# 4. A pod's end releases what it held.
share_n() {
  pm exec "$neighbour-app" /usr/local/bin/mrctl hold --size=$((share - 4096)) \
    --flags=remote_read 2>&1 </dev/null
}
refusal=$(share_n)
code=$?
echo "neighbour's share while the greedy pod holds its own: $refusal"
check "while the greedy pod holds its share, the neighbour's does not fit in the node's total (LIMIT_TOTAL_PINNED_BYTES, exit $code)" \
  test "$code" = 5 -a -n "$(grep -F LIMIT_TOTAL_PINNED_BYTES <<<"$refusal")"
check "podman pod rm removes the greedy pod" \
  pm pod rm -f -t 0 "$greedy" >/dev/null
released() { [[ $(used "$tenant_g" pinned_bytes) =~ ^(0|absent)$ ]]; }
within 20 released
check "the greedy pod's tenant holds no pinned bytes once the pod is gone (tenant list: $(used "$tenant_g" pinned_bytes))" \
  released || tenants_json
out=$(share_n)
code=$?
check "the neighbour pod now registers its whole share (exit $code)" \
  test "$code" = 0 -a -n "$(grep -x "session.tenant=$tenant_n" <<<"$out")" ||
  echo "$out"

# 5. The node's mrd stops cleanly, workloads still holding.
pm pod stop -t 30 "$ds" >/dev/null 2>&1
mrd_code=$(pm inspect --format '{{.State.ExitCode}}' "$ds-mrd")
mrd_log=$(logs "$ds-mrd")
check "stopping the mrd pod stops mrd with exit 0 and nothing pinned (exit $mrd_code)" \
  test "$mrd_code" = 0 -a -n "$(grep 'device pinned bytes: 0' <<<"$mrd_log")"
# (kube down's stderr: podman cannot remove the health check timer it
# could not make without systemd, and says so.)
down() {
  pm kube down "$work/mrd.yaml" >/dev/null 2>"$work/down.log" &&
    pm pod rm -f -t 0 "$neighbour" "$other" >/dev/null 2>>"$work/down.log"
}
check "podman kube down removes the mrd pod, podman pod rm the workloads" \
  down || cat "$work/down.log"
[ "$failures" -eq 0 ] || {
  for f in g n o; do echo "---- hold $f ----"; cat "$work/$f.out"; done
  echo "---- mrd ----"
  echo "$mrd_log"
}
echo "$failures failure(s)"
[ "$failures" -eq 0 ]
