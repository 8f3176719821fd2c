#!/usr/bin/python3
"""deploy/monitoring against Prometheus' own tools and mrd's metrics.

- promtool checks the alert rules and runs their unit tests;
- the PrometheusRule carries exactly the plain rules file's groups;
- every query of the Grafana dashboard is valid PromQL (promtool checks it
  as a recording rule);
- every metric the rules and the dashboard use is one mrd exports
  (docs/METRICS.md, itself checked against a live scrape by
  tests/integration/metrics_test.cc);
- the PodMonitor selects the label the manifests give mrd, and finds its
  metrics port: by name where the mrd container declares it (the sidecar),
  by the port of --metrics_address for a container that declares none (the
  DaemonSet's, whose host-network ports would be host ports).

Usage: monitoring_test.py SOURCE_DIR  (exit 0 when everything holds)
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import yaml

PROMTOOL = "/usr/bin/promtool"
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def promtool(*args, cwd=None):
    r = subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True,
                       text=True)
    out = (r.stdout + r.stderr).strip()
    return r.returncode, out


def metric_names(expr):
    """mrd's, gRPC's and the process's metric names an expression uses."""
    names = set(re.findall(r"\b((?:mrd|grpc_server|process)_[a-z_]+)\b",
                           expr))
    out = set()
    for n in names:
        for suffix in ("_bucket", "_count", "_sum"):
            if n.endswith(suffix):
                n = n[: -len(suffix)]
                break
        out.add(n)
    return out


def main():
    src = sys.argv[1]
    mon = os.path.join(src, "deploy", "monitoring")
    if not os.access(PROMTOOL, os.X_OK):
        check(False, "promtool is installed (Debian's prometheus package; "
              "scripts/install-deps.sh)")
        return 1

    # The alert rules and their unit tests.
    rc, out = promtool("check", "rules", "mrd-alerts.rules.yml", cwd=mon)
    check(rc == 0, "promtool check rules mrd-alerts.rules.yml\n" + out)
    rc, out = promtool("test", "rules", "mrd-alerts.test.yml", cwd=mon)
    check(rc == 0, "promtool test rules mrd-alerts.test.yml\n" + out)

    with open(os.path.join(mon, "mrd-alerts.rules.yml")) as f:
        rules = yaml.safe_load(f)
    with open(os.path.join(mon, "prometheusrule.yaml")) as f:
        crd = yaml.safe_load(f)
    check(crd.get("kind") == "PrometheusRule" and
          crd.get("apiVersion") == "monitoring.coreos.com/v1",
          "prometheusrule.yaml is a monitoring.coreos.com/v1 PrometheusRule")
    check(crd.get("spec", {}).get("groups") == rules["groups"],
          "prometheusrule.yaml's groups are mrd-alerts.rules.yml's")

    # Every alert is unit-tested.
    with open(os.path.join(mon, "mrd-alerts.test.yml")) as f:
        tests = yaml.safe_load(f)
    tested = {t["alertname"] for case in tests["tests"]
              for t in case.get("alert_rule_test", [])
              if t.get("exp_alerts")}
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]
              if "alert" in r}
    check(alerts <= tested,
          "every alert fires in a unit test (untested: %s)" %
          sorted(alerts - tested))

    # The dashboard's queries, as recording rules promtool can check.
    with open(os.path.join(mon, "grafana-dashboard.json")) as f:
        dash = json.load(f)
    exprs = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            exprs.append((panel["title"], target["expr"]))
    check(len(exprs) >= 20, "the dashboard has its queries (%d)" % len(exprs))
    record = {"groups": [{"name": "dashboard", "rules": [
        {"record": "dashboard:query_%d" % i,
         "expr": e.replace("$__rate_interval", "5m")
                  .replace("$instance", ".*")}
        for i, (_, e) in enumerate(exprs)]}]}
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        yaml.safe_dump(record, f)
        path = f.name
    rc, out = promtool("check", "rules", path)
    os.unlink(path)
    check(rc == 0, "every dashboard query is valid PromQL\n" + out)
    uids = [p.get("datasource", {}).get("uid") for p in dash["panels"]
            if p["type"] != "row"]
    check(all(u == "${datasource}" for u in uids),
          "every panel uses the datasource variable")

    # Metric names against docs/METRICS.md.
    with open(os.path.join(src, "docs", "METRICS.md")) as f:
        documented = set(re.findall(r"^\| `([a-z_]+)` \|", f.read(), re.M))
    used = set()
    for g in rules["groups"]:
        for r in g["rules"]:
            used |= metric_names(r["expr"])
    for _, e in exprs:
        used |= metric_names(e)
    check(used and used <= documented,
          "the rules and the dashboard use only metrics mrd exports "
          "(unknown: %s)" % sorted(used - documented))

    # The PodMonitor finds what the manifests label.
    with open(os.path.join(mon, "podmonitor.yaml")) as f:
        pm = yaml.safe_load(f)
    selector = pm["spec"]["selector"]["matchLabels"]
    endpoints = pm["spec"]["podMetricsEndpoints"]
    port = endpoints[0]["port"]
    for e in endpoints:
        check({"targetLabel": "job", "replacement": "mrd"} in e["relabelings"],
              "the PodMonitor names the job mrd (the rules select "
              "job=\"mrd\")")
    # The endpoint for containers without ports: which container it keeps,
    # and the port it puts in the address.
    portless = [e for e in endpoints if "port" not in e]
    check(len(portless) == 1, "the PodMonitor scrapes port-less mrd containers")
    keep = [r for r in portless[0]["relabelings"] if r.get("action") == "keep"]
    address = [r for r in portless[0]["relabelings"]
               if r.get("targetLabel") == "__address__"]
    check(len(keep) == 1 and keep[0]["regex"] == "mrd;;false" and
          keep[0]["sourceLabels"] == [
              "__meta_kubernetes_pod_container_name",
              "__meta_kubernetes_pod_container_port_number",
              "__meta_kubernetes_pod_container_init"],
          "the port-less endpoint keeps the container named mrd")
    portless_port = address[0]["replacement"].rsplit(":", 1)[1] \
        if address else None
    for kind in ("daemonset", "sidecar"):
        with open(os.path.join(src, "deploy", kind,
                               "kustomization.yaml")) as f:
            kust = yaml.safe_load(f)
        labels = {}
        for entry in kust.get("labels", []):
            if entry.get("includeTemplates"):
                labels.update(entry["pairs"])
        check(all(labels.get(k) == v for k, v in selector.items()),
              "deploy/%s labels its pods %s" % (kind, selector))
        ports = []
        found_portless = False
        for res in kust["resources"]:
            with open(os.path.join(src, "deploy", kind, res)) as f:
                for doc in yaml.safe_load_all(f):
                    if not doc or doc.get("kind") not in ("DaemonSet",
                                                           "Deployment"):
                        continue
                    spec = doc["spec"]["template"]["spec"]
                    for c in (spec.get("containers", []) +
                              spec.get("initContainers", [])):
                        if c.get("image") != "mrd":
                            continue
                        ports += [p.get("name") for p in c.get("ports", [])]
                        metrics = [a.rsplit(":", 1)[1]
                                   for a in c.get("args", [])
                                   if a.startswith("--metrics_address=")]
                        if (c in spec.get("containers", []) and
                                c.get("name") == "mrd" and
                                not c.get("ports") and
                                metrics == [portless_port]):
                            found_portless = True
        check(port in ports or found_portless,
              "deploy/%s's mrd container has the port %s, or declares "
              "none and serves metrics on port %s" %
              (kind, port, portless_port))

    print("%d failure(s)" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
