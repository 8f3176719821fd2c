// Validates every Kubernetes object in deploy/ against its schema, offline:
// the built-in kinds with kubernetes-models' Kubernetes OpenAPI schemas, the
// Prometheus Operator's (PodMonitor, PrometheusRule) with its CRDs'. Also
// checks that each kustomization names only files that exist and that every
// object of deploy/ belongs to one (examples/ excepted).
//   node validate.js SOURCE_DIR     (exit 0: everything valid)
"use strict";
const fs = require("fs");
const path = require("path");
const YAML = require("yaml");

const src = process.argv[2];
const deploy = path.join(src, "deploy");
let failures = 0;
function check(ok, what) {
  console.log((ok ? "ok   " : "FAIL ") + what);
  if (!ok) failures++;
}

// apiVersion -> the module with its kinds.
function modelsFor(apiVersion) {
  if (apiVersion === "monitoring.coreos.com/v1") {
    return require("@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1");
  }
  if (apiVersion === "kustomize.config.k8s.io/v1beta1") return null;
  return require("kubernetes-models/" + apiVersion);
}

const kustomized = new Set();
for (const dir of fs.readdirSync(deploy)) {
  const kustomization = path.join(deploy, dir, "kustomization.yaml");
  if (!fs.existsSync(kustomization)) continue;
  const k = YAML.parse(fs.readFileSync(kustomization, "utf8"));
  for (const res of k.resources || []) {
    const file = path.join(deploy, dir, res);
    check(fs.existsSync(file), `deploy/${dir}/kustomization.yaml: ${res} exists`);
    kustomized.add(file);
  }
  for (const gen of k.configMapGenerator || []) {
    for (const f of gen.files || []) {
      const file = path.join(deploy, dir, f.split("=").pop());
      check(fs.existsSync(file), `deploy/${dir}: configMapGenerator file ${f} exists`);
      if (file.endsWith(".json")) {
        let parsed = true;
        try { JSON.parse(fs.readFileSync(file, "utf8")); } catch (e) { parsed = false; }
        check(parsed, `deploy/${dir}/${f.split("=").pop()} is JSON`);
      }
    }
  }
}

let objects = 0;
for (const dir of fs.readdirSync(deploy)) {
  const full = path.join(deploy, dir);
  if (!fs.statSync(full).isDirectory()) continue;
  for (const name of fs.readdirSync(full)) {
    if (!/\.ya?ml$/.test(name) || name === "kustomization.yaml") continue;
    if (/\.(rules|test)\.ya?ml$/.test(name)) continue;  // Prometheus' files
    const file = path.join(full, name);
    const docs = YAML.parseAllDocuments(fs.readFileSync(file, "utf8"));
    for (const doc of docs) {
      const obj = doc.toJS();
      if (!obj) continue;
      const where = `deploy/${dir}/${name}: ${obj.kind} ${obj.metadata && obj.metadata.name}`;
      if (doc.errors.length) {
        check(false, `${where}: YAML ${doc.errors[0].message}`);
        continue;
      }
      const models = modelsFor(obj.apiVersion);
      if (models === null) continue;
      const Model = models && models[obj.kind];
      if (!Model) {
        check(false, `${where}: no schema for ${obj.apiVersion} ${obj.kind}`);
        continue;
      }
      let error = "";
      try {
        new Model(obj).validate();
      } catch (e) {
        error = e.message;
      }
      check(error === "", `${where} is a valid ${obj.apiVersion} ${obj.kind}${error ? ": " + error : ""}`);
      check(dir === "examples" || kustomized.has(file),
            `${where} belongs to its kustomization`);
      objects++;
    }
  }
}
check(objects >= 8, `found the manifests (${objects} objects)`);

// The DaemonSet updates by live handover (deploy/README.md): the new pod
// surges next to the old one, takes over, and the old one waits, holding
// nothing, until deleted; preStop keeps SIGTERM off a handover in progress.
{
  const file = path.join(deploy, "daemonset", "daemonset.yaml");
  const ds = YAML.parseAllDocuments(fs.readFileSync(file, "utf8"))
    .map((d) => d.toJS()).find((o) => o && o.kind === "DaemonSet");
  const spec = ds.spec.template.spec;
  const ru = (ds.spec.updateStrategy || {}).rollingUpdate || {};
  check(ds.spec.updateStrategy.type === "RollingUpdate" && ru.maxSurge === 1 &&
        ru.maxUnavailable === 0,
        "DaemonSet: RollingUpdate with maxSurge 1, maxUnavailable 0");
  check(!spec.hostNetwork || spec.containers.every((c) => !c.ports),
        "DaemonSet: no declared ports on the host network (they would be " +
        "host ports and keep the surge pod off its node)");
  const mrd = spec.containers.find((c) => c.name === "mrd");
  const args = mrd.args || [];
  const statusArg = args.find((a) => a.startsWith("--handover_status_file="));
  const status = statusArg ? statusArg.split("=")[1] : "";
  check(args.includes("--takeover") && args.includes("--after_handover=wait") &&
        status !== "",
        "DaemonSet: mrd takes over, waits after handing over, and writes " +
        "its status file");
  const mount = (mrd.volumeMounts || []).find(
    (m) => status.startsWith(m.mountPath + "/"));
  const volume = mount && spec.volumes.find((v) => v.name === mount.name);
  check(Boolean(volume && volume.emptyDir),
        `DaemonSet: the status file ${status} is on a volume of the pod's own (emptyDir)`);
  const cmd = (probe) => ((probe || {}).exec || {}).command || [];
  const says = (probe, state) =>
    cmd(probe).join(" ").includes(`grep -qx ${state} ${status}`);
  check(says(mrd.startupProbe, "serving") && says(mrd.readinessProbe, "serving"),
        "DaemonSet: startup and readiness need this pod's mrd serving");
  check(says(mrd.livenessProbe, "handed-over"),
        "DaemonSet: liveness passes for an mrd that handed over");
  const preStop = cmd(((mrd.lifecycle || {}).preStop));
  const awaitArg = preStop.find((a) => a.startsWith("--await_handover="));
  const awaitSeconds = awaitArg ? parseInt(awaitArg.split("=")[1], 10) : NaN;
  check(preStop.includes(`--handover_status_file=${status}`) &&
        awaitSeconds > 0,
        "DaemonSet: preStop awaits the handover on the same status file");
  check(spec.terminationGracePeriodSeconds >= awaitSeconds + 15,
        `DaemonSet: the grace period (${spec.terminationGracePeriodSeconds} s) ` +
        `covers preStop (${awaitSeconds} s) and a drain after it`);

  // Every $(VAR) of mrd's args is a variable of its env, and every one taken
  // from a ConfigMap names a key that configmap.yaml has (a missing one
  // would keep the pod from starting; an unset variable would reach mrd as
  // the text "$(VAR)").
  const configmaps = YAML.parseAllDocuments(
    fs.readFileSync(path.join(deploy, "daemonset", "configmap.yaml"), "utf8"))
    .map((d) => d.toJS()).filter((o) => o && o.kind === "ConfigMap");
  const env = new Map((mrd.env || []).map((e) => [e.name, e]));
  for (const arg of args) {
    for (const m of arg.matchAll(/\$\((\w+)\)/g)) {
      check(env.has(m[1]), `DaemonSet: ${arg}: ${m[1]} is in mrd's env`);
    }
  }
  for (const e of env.values()) {
    const ref = ((e.valueFrom || {}).configMapKeyRef);
    if (!ref) continue;
    const cm = configmaps.find((c) => c.metadata.name === ref.name);
    check(Boolean(cm && cm.data && ref.key in cm.data),
          `DaemonSet: env ${e.name} comes from ConfigMap ${ref.name} key ${ref.key}, which configmap.yaml has`);
  }
  // The directory's TLS and user (docs/DIRECTORY.md, "On Kubernetes"):
  // passed from the ConfigMap, the files from an optional Secret that only
  // mrd reads, and no password as a flag's value.
  for (const flag of ["etcd_ca_file", "etcd_cert_file", "etcd_key_file",
                      "etcd_user", "etcd_password_file"]) {
    check(args.some((a) => a.startsWith(`--${flag}=$(`)),
          `DaemonSet: mrd gets --${flag} from the ConfigMap`);
  }
  check(!args.some((a) => a.startsWith("--etcd_password=")),
        "DaemonSet: no password on mrd's command line");
  const secret = spec.volumes.find(
    (v) => v.secret && v.secret.secretName === "mrd-etcd-credentials");
  check(Boolean(secret && secret.secret.optional === true &&
                (secret.secret.defaultMode & 0o077) === 0),
        "DaemonSet: the Secret mrd-etcd-credentials is optional and readable by its owner only");
  const secretMount = secret &&
    (mrd.volumeMounts || []).find((m) => m.name === secret.name);
  check(Boolean(secretMount && secretMount.readOnly),
        "DaemonSet: mrd mounts the etcd credentials read-only");
}
console.log(`${failures} failure(s)`);
process.exit(failures ? 1 : 0);
