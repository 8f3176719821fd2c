#!/usr/bin/env bash
# deploy/'s manifests against the Kubernetes schemas, offline
# (tests/deploy/k8s/validate.js): installs the pinned validators
# (package-lock.json, from the npm registry) into WORK_DIR, then validates.
#   tests/deploy/manifests_test.sh SOURCE_DIR WORK_DIR
set -euo pipefail
src=$1
work=$2
mkdir -p "$work"
cp "$src/tests/deploy/k8s/package.json" "$src/tests/deploy/k8s/package-lock.json" \
  "$src/tests/deploy/k8s/validate.js" "$work/"
cd "$work"
if ! cmp -s package-lock.json node_modules/.package-lock.json 2>/dev/null; then
  npm ci --no-audit --no-fund --loglevel=error >npm.log 2>&1 || {
    cat npm.log
    exit 1
  }
fi
node validate.js "$src"
