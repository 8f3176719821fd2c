#!/usr/bin/env bash
# The lint test: clang-tidy (the checks of the repository's .clang-tidy) over
# the C++ sources of server/, client/ and proto/ in a build's
# compile_commands.json — not the generated protobuf code — in parallel.
# Any finding fails (WarningsAsErrors).
#   tests/support/clang_tidy.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
source_dir=$1
build_dir=$2
# clang-tidy 22 (scripts/install-deps.sh installs it): it matches only our
# code, not the system headers' declarations, in about 60 % of clang-tidy
# 14's time over the same checks. Older ones serve where it is missing.
tidy=$(command -v clang-tidy-22 || command -v clang-tidy-14 || command -v clang-tidy)
# The compile commands without the precompiled header (cmake/Pch.cmake): it
# is clang 14's, and without it a source that does not include what it uses
# fails here.
db=$(mktemp -d)
trap 'rm -rf "$db"' EXIT
mapfile -t files < <(/usr/bin/python3 - "$source_dir" "$build_dir" "$db" <<'PY'
import json, os, re, sys
src, build, db = (os.path.realpath(p) for p in sys.argv[1:4])
# The code mrd ships: the daemon, the clients and the protocol's helpers.
# The tests and benchmarks are left out for make test's time budget: they
# are half the sources and more than half the lint's time, and a test's
# mistake shows when it runs (they build with every warning an error).
LINTED = ("server", "client", "proto")
with open(os.path.join(build, "compile_commands.json")) as f:
    entries = json.load(f)
pch = re.compile(r" -Winvalid-pch| -Xclang -include-pch -Xclang \S+"
                 r"| -Xclang -include -Xclang \S+cmake_pch\.hxx")
seen = set()
for e in entries:
    e["command"] = pch.sub("", e["command"])
    path = os.path.realpath(os.path.join(e["directory"], e["file"]))
    if not path.startswith(src + os.sep) or path.startswith(build + os.sep):
        continue
    if path.endswith(".pb.cc") or path in seen:
        continue
    if os.path.relpath(path, src).split(os.sep)[0] not in LINTED:
        continue
    seen.add(path)
    print(path)
with open(os.path.join(db, "compile_commands.json"), "w") as f:
    json.dump(entries, f)
PY
)
echo "clang-tidy: ${#files[@]} files, $(nproc) at a time"
status=0
# -Wno-deprecated-declarations: clang 22 reports libstdc++ 12's own call of
# the deprecated get_temporary_buffer inside std::stable_sort against the
# caller; the compiler's -Werror, in every build, reports any deprecated
# call of ours.
printf '%s\n' "${files[@]}" |
  xargs -P "$(nproc)" -n 4 "$tidy" -p "$db" --quiet \
    --extra-arg=-Wno-deprecated-declarations 2>/dev/null ||
  status=$?
if [ "$status" -ne 0 ]; then
  echo "clang-tidy: findings above (exit $status, ${SECONDS} s)"
  exit 1
fi
# The time, to watch the cost grow (under 3 minutes on 2 idle cores).
echo "clang-tidy: clean (${SECONDS} s)"
