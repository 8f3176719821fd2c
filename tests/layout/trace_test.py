#!/usr/bin/env python3
"""The rule -> code -> test trace of docs/CONFORMANCE.md, held to the tree.

Fails when a rule of docs/SEMANTICS.md has no row in CONFORMANCE.md, when a
source path the trace cites does not exist, or when a test it names
(`[prefix.][Instance/]Suite.Name`, Name may be `*`) is not a TEST, TEST_F or
TEST_P of tests/ (a renamed or deleted test would otherwise leave the trace
pointing at nothing).
Run: trace_test.py REPO_ROOT
"""
import os
import re
import sys

RULE = re.compile(r"^- ([CRLFW]\d+)\b", re.M)
ROW_RULE = re.compile(r"^\|\s*([CRLFW]\d+)\b", re.M)
PATH = re.compile(r"`((?:server|client|proto|tests|docs|deploy|bench)/[\w./-]+)`")
TEST_NAME = re.compile(
    r"`(?:[a-z_]+\.)?(?:\w+/)?(\w+Test)\.(\w+|\*)`")
# `Class::Method` cited as the code of a rule (namespaces left out).
CITED_CODE = re.compile(r"`(?:\w+::)*([A-Z]\w*)::([A-Z]\w*)`")
DEFINED = re.compile(r"^\s*TEST(?:_F|_P)?\(\s*(\w+)\s*,\s*(\w+)\s*\)", re.M)


def defined_tests(root):
    tests = set()
    for dirpath, _, files in os.walk(os.path.join(root, "tests")):
        for name in files:
            if name.endswith(".cc"):
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    tests.update(DEFINED.findall(f.read()))
    return tests


def defined_methods(root):
    """(class, method) of every out-of-line member function in server/ and
    client/ (`Class::Method(` at the start of a definition), and the methods
    declared in a class body (`  Type Method(`) of every header, by class."""
    found = set()
    definition = re.compile(r"\b([A-Z]\w*)::([A-Z]\w*)\(")
    for top in ("server", "client", "proto"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for name in files:
                if not name.endswith((".cc", ".h")):
                    continue
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    text = f.read()
                found.update(definition.findall(text))
                if name.endswith(".h"):
                    # Declared in a class body (e.g. an interface's pure
                    # virtual methods): each chunk after `class Name`.
                    chunks = re.split(r"^class (\w+)\b", text, flags=re.M)
                    for i in range(1, len(chunks) - 1, 2):
                        for method in re.findall(r"\b([A-Z]\w*)\(",
                                                 chunks[i + 1]):
                            found.add((chunks[i], method))
    return found


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    with open(os.path.join(root, "docs", "SEMANTICS.md"), encoding="utf-8") as f:
        rules = RULE.findall(f.read())
    with open(os.path.join(root, "docs", "CONFORMANCE.md"), encoding="utf-8") as f:
        trace = f.read()
    failures = []
    if len(rules) < 30:
        failures.append(f"only {len(rules)} rules found in SEMANTICS.md")
    rows = set(ROW_RULE.findall(trace))
    for rule in rules:
        if rule not in rows:
            failures.append(f"rule {rule} has no row in CONFORMANCE.md")
    for path in sorted(set(PATH.findall(trace))):
        if not os.path.exists(os.path.join(root, path.rstrip("/"))):
            failures.append(f"CONFORMANCE.md cites {path}, which does not exist")
    tests = defined_tests(root)
    suites = {suite for suite, _ in tests}
    named = set(TEST_NAME.findall(trace))
    for suite, name in sorted(named):
        if name == "*":
            if suite not in suites:
                failures.append(f"CONFORMANCE.md names {suite}.*, no such suite")
        elif (suite, name) not in tests:
            failures.append(f"CONFORMANCE.md names {suite}.{name}, no such test")
    methods = defined_methods(root)
    cited = set(CITED_CODE.findall(trace))
    for cls, method in sorted(cited):
        if (cls, method) not in methods:
            failures.append(f"CONFORMANCE.md cites {cls}::{method}, which is "
                            "not defined in server/, client/ or proto/")
    for f in failures:
        print("FAIL:", f)
    print(f"{len(rules)} rules, {len(named)} test names and {len(cited)} functions checked, "
          f"{len(failures)} problem(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
