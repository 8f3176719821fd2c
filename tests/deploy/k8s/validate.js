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
console.log(`${failures} failure(s)`);
process.exit(failures ? 1 : 0);
