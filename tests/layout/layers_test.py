#!/usr/bin/env python3
"""The module graph of docs/ARCHITECTURE.md, held to the code.

Every `#include` of our own headers is an edge between two modules (folders,
or proto/mrd/v1 for the generated messages). The test fails when
  * an edge exists in the code that the module table does not list
    ("depends on" column), so the table always shows every edge there is;
  * the table lists an edge the code does not have (it went stale);
  * a forbidden edge appears: a server module including client/, a client
    module including server/, server/common or the devices including the
    generated proto, server/handover including a module it hands over
    (it reaches them through handover::Participant), or anything but main.cc
    including server/service;
  * server/main.cc grows to 700 lines or more (it is the wiring).
The CMake link graph (cmake --graphviz of a scratch configure) is held to
the same rule: no client target links a server library and no server
library links a client one. And the README's "## Layout" block must name
every folder of server/, client/ and tests/ and every page of docs/, and
nothing that is not there.
Run: layers_test.py REPO_ROOT
"""
import os
import re
import subprocess
import sys
import tempfile

# Longest prefix first: a file belongs to the most specific module.
MODULES = [
    "proto/mrd/v1",
    "proto/mrd",
    "server/common",
    "server/device/software",
    "server/device/verbs",
    "server/device",
    "server/fd_socket",
    "server/cache",
    "server/core",
    "server/service",
    "server/metrics",
    "server/handover",
    "server/daemon",
    "server/directory",
    "server/main.cc",
    "client/lib",
    "client/peer",
    "client/mrctl",
]

FORBIDDEN = [
    # (from-prefix, to-prefix, why)
    ("server/", "client/", "no server code includes the client"),
    ("client/", "server/", "no client code includes the server"),
    ("server/common", "proto/mrd/v1", "common speaks no wire messages"),
    ("server/cache", "proto/mrd/v1", "the cache speaks no wire messages"),
    ("server/device", "proto/mrd/v1", "devices speak no wire messages"),
] + [
    # The handover's sequence is server/handover's alone; it reaches every
    # module through participant.h, which those modules include, never the
    # other way round.
    ("server/handover", m, "the handover reaches modules only through "
     "handover::Participant")
    for m in ("server/cache", "server/core", "server/device",
              "server/fd_socket", "server/service", "server/metrics",
              "server/daemon")
]
# main.cc is the wiring: flags live in server/daemon, the handover in
# server/handover (issue 28 brought it from 2,043 lines to under 700).
MAIN_MAX_LINES = 700
# The one generated header a module of FORBIDDEN may still include: the
# software device's own peer protocol.
ALLOWED_GENERATED = {"server/device/software": {"mrd/v1/peer.pb.h"}}
# Only main.cc wires the gRPC service in.
SERVICE_USERS = {"server/main.cc", "server/service"}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def module_of(path):
    for m in MODULES:
        if path == m or path.startswith(m + "/"):
            return m
    return None


def header_module(include):
    """The module an include names (our own headers only)."""
    if include.startswith("mrd/v1/"):
        return "proto/mrd/v1"
    if include.startswith("mrd/"):
        return "proto/mrd"
    return module_of(include)


def code_edges(root):
    edges = {}
    for top in ("proto/mrd", "server", "client"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for name in files:
                if not name.endswith((".cc", ".h")):
                    continue
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root)
                src = module_of(rel)
                if src is None:
                    continue
                with open(full, encoding="utf-8") as f:
                    text = f.read()
                for inc in INCLUDE.findall(text):
                    dst = header_module(inc)
                    if dst is None or dst == src:
                        continue
                    allowed = inc in ALLOWED_GENERATED.get(src, ())
                    edges.setdefault((src, dst), []).append(
                        (rel, inc, allowed))
    return edges


def table_edges(root):
    """(module, dependency) pairs of the ARCHITECTURE.md module table."""
    path = os.path.join(root, "docs", "ARCHITECTURE.md")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Modules", 1)[1].split("\n## ", 1)[0]
    edges = set()
    rows = 0
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`"):
            continue
        module = cells[0].strip("`").rstrip("/")
        if module not in MODULES:
            sys.exit(f"ARCHITECTURE.md: unknown module {module!r} in the table")
        rows += 1
        for dep in re.findall(r"`([^`]+)`", cells[3]):
            dep = dep.rstrip("/")
            if dep in MODULES:
                edges.add((module, dep))
    if rows != len(MODULES):
        sys.exit(f"ARCHITECTURE.md: the module table has {rows} rows of our "
                 f"modules, the code has {len(MODULES)}")
    return edges


CLIENT_TARGETS = {"mrd_client", "mrd_peer_client", "mrd_verbs_peer", "mrctl"}
SERVER_TARGET = re.compile(
    r"^mrd_(common|device\w*|verbs_device|fd_socket|cache|core|service|"
    r"metrics|rpc_observer|directory)$")
NODE = re.compile(r'^\s*"(node\d+)" \[ label = "([^"]+)"', re.M)
EDGE = re.compile(r'^\s*"(node\d+)" -> "(node\d+)"', re.M)


def link_failures(root):
    """Forbidden edges of the CMake link graph."""
    with tempfile.TemporaryDirectory() as tmp:
        dot = os.path.join(tmp, "targets.dot")
        subprocess.run(["cmake", "-S", root, "-B", os.path.join(tmp, "build"),
                        "-G", "Ninja", f"--graphviz={dot}"],
                       check=True, stdout=subprocess.DEVNULL)
        with open(dot, encoding="utf-8") as f:
            text = f.read()
    names = dict(NODE.findall(text))
    failures = []
    edges = 0
    for a, b in EDGE.findall(text):
        src, dst = names.get(a, ""), names.get(b, "")
        edges += 1
        if src in CLIENT_TARGETS and SERVER_TARGET.match(dst):
            failures.append(f"client target {src} links server library {dst}")
        if SERVER_TARGET.match(src) and dst in CLIENT_TARGETS:
            failures.append(f"server library {src} links client target {dst}")
    if edges == 0 or "mrd_client" not in names.values():
        failures.append("cmake --graphviz gave no graph of our targets")
    return failures


def layout_failures(root):
    """The README's layout block against the tree."""
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        text = f.read()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    # Each top-level entry: its first line starts with the folder name; its
    # continuation lines are indented.
    entries = {}
    current = None
    for line in block.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            current = line.split()[0]
            entries[current] = line[len(current):]
        elif current is not None:
            entries[current] += " " + line
    failures = []
    for top in ("server/", "client/", "tests/"):
        if top not in entries:
            failures.append(f"README layout has no {top} line")
            continue
        named = set(re.findall(r"(?<![\w/.])([a-z_]+)/", entries[top]))
        named.discard(top.rstrip("/"))
        actual = {d for d in os.listdir(os.path.join(root, top))
                  if os.path.isdir(os.path.join(root, top, d))}
        for d in sorted(actual - named):
            failures.append(f"README layout does not name {top}{d}/")
        for d in sorted(named - actual):
            # device/software/ style mentions name nested folders
            if not any(os.path.isdir(os.path.join(root, top, a, d))
                       for a in actual):
                failures.append(f"README layout names {top}{d}/, which "
                                f"does not exist")
    docs = {f for f in os.listdir(os.path.join(root, "docs"))
            if f.endswith(".md")}
    named_docs = set(re.findall(r"([A-Z]+\.md)", entries.get("docs/", "")))
    for d in sorted(docs - named_docs):
        failures.append(f"README layout does not name docs/{d}")
    for d in sorted(named_docs - docs):
        failures.append(f"README layout names docs/{d}, which does not exist")
    return failures


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    code = code_edges(root)
    table = table_edges(root)
    failures = []
    failures += link_failures(root)
    failures += layout_failures(root)
    with open(os.path.join(root, "server", "main.cc"), encoding="utf-8") as f:
        main_lines = sum(1 for _ in f)
    if main_lines >= MAIN_MAX_LINES:
        failures.append(f"server/main.cc has {main_lines} lines, "
                        f"{MAIN_MAX_LINES} or more: it is the wiring; move "
                        f"what is not to the module it belongs to")
    for (src, dst), uses in sorted(code.items()):
        for prefix_from, prefix_to, why in FORBIDDEN:
            if src.startswith(prefix_from) and dst.startswith(prefix_to):
                bad = sorted({f"{rel} includes {inc}"
                              for rel, inc, allowed in uses if not allowed})
                if bad:
                    failures.append(f"forbidden edge {src} -> {dst} ({why}): "
                                    + "; ".join(bad))
        if dst == "server/service" and src not in SERVICE_USERS:
            failures.append(f"forbidden edge {src} -> server/service (only "
                            f"main.cc wires the service): {uses[0][0]}")
        if (src, dst) not in table:
            failures.append(f"edge {src} -> {dst} is in the code "
                            f"({uses[0][0]}) but not in ARCHITECTURE.md")
    for src, dst in sorted(table - set(code)):
        failures.append(f"ARCHITECTURE.md lists {src} -> {dst}, which the "
                        f"code does not have")
    for f in failures:
        print("FAIL:", f)
    print(f"{len(code)} module edges checked, {len(failures)} problem(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
