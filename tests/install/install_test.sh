#!/usr/bin/env bash
# `cmake --install` as a client developer uses it: installs the build into a
# fresh prefix, checks that no installed header reaches for a server header,
# builds tests/install/consumer against the prefix twice (find_package(mrd
# CONFIG) -> mrd::client, and pkg-config mrd-client), and runs both builds
# against the installed mrd on the software device.
#   tests/install/install_test.sh SOURCE_DIR BUILD_DIR
set -uo pipefail
src=$1
build=$2
work=$(mktemp -d /tmp/mrd-install-test-XXXXXX)
mrd_pid=
cleanup() {
  [ -n "$mrd_pid" ] && kill "$mrd_pid" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
. "$src/tests/support/check.sh"
prefix=$work/prefix

check "cmake --install" cmake --install "$build" --prefix "$prefix" >"$work/install.log"
check "mrd, mrctl, the client library, its CMake package and pkg-config file" \
  test -x "$prefix/bin/mrd" -a -x "$prefix/bin/mrctl" \
  -a -f "$prefix/lib/libmrd_client.a" -a -f "$prefix/lib/cmake/mrd/mrdConfig.cmake" \
  -a -f "$prefix/lib/pkgconfig/mrd-client.pc" \
  -a -f "$prefix/lib/systemd/system/mrd.service"
check "the unit runs the installed mrd" \
  grep -qx "ExecStart=$prefix/bin/mrd --runtime_dir=/run/mrd --flagfile=/etc/mrd/mrd.flags" \
  "$prefix/lib/systemd/system/mrd.service"
bad=$(grep -rl '#include "server/' "$prefix/include" || true)
check "no installed header includes a server header${bad:+ ($bad)}" test -z "$bad"
# Every quoted include of an installed header resolves inside the prefix
# (or is a Debian package's: absl, grpc, google).
missing=
for inc in $(grep -rhoE '#include "[^"]+"' "$prefix/include" | sed 's/#include "//; s/"$//' | sort -u); do
  case "$inc" in absl/* | grpc/* | grpcpp/* | google/*) continue ;; esac
  [ -f "$prefix/include/mrd/$inc" ] || missing="$missing $inc"
done
check "every installed header's includes are installed${missing:+ (missing:$missing)}" test -z "$missing"

launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
check "the consumer configures with find_package(mrd CONFIG)" \
  cmake -S "$src/tests/install/consumer" -B "$work/consumer" -G Ninja \
  -DCMAKE_PREFIX_PATH="$prefix" "${launcher[@]}" >"$work/configure.log" 2>&1 ||
  cat "$work/configure.log"
check "the consumer builds against mrd::client" \
  cmake --build "$work/consumer" >"$work/build.log" 2>&1 || cat "$work/build.log"
flags=$(PKG_CONFIG_PATH=$prefix/lib/pkgconfig pkg-config --cflags --libs mrd-client)
check "pkg-config knows mrd-client" test -n "$flags"
# shellcheck disable=SC2086
check "the consumer builds with pkg-config's flags" \
  ${launcher:+ccache} g++ -std=c++20 -o "$work/consumer-pc" \
  "$src/tests/install/consumer/main.cc" $flags

mkdir -m 0700 "$work/run"
"$prefix/bin/mrd" --device=software --runtime_dir="$work/run" --shm_dir= \
  --peer_address=127.0.0.1:0 --metrics_address= >"$work/mrd.log" 2>&1 &
mrd_pid=$!
for _ in $(seq 100); do [ -S "$work/run/fd.sock" ] && break; sleep 0.1; done
check "the installed mrd serves" test -S "$work/run/fd.sock"
for consumer in "$work/consumer/consumer" "$work/consumer-pc"; do
  out=$("$consumer" "$work/run/mrd.sock" "$work/run/fd.sock" 2>&1)
  echo "$out"
  check "$(basename "$consumer") registers through the installed library" \
    grep -qE '^rkey=[0-9]+ registrations=1$' <<<"$out"
done
# The Python client, installed beside them, against the same mrd.
pydir=$(ls -d "$prefix"/lib/python3*/dist-packages 2>/dev/null | head -1)
py_out=$(PYTHONPATH=$pydir /usr/bin/python3 - "$work/run" <<'PY' 2>&1
import sys
import mrd_client
run = sys.argv[1]
with mrd_client.Client(run + "/mrd.sock", run + "/fd.sock") as c, \
        c.open_fd_session() as s, s.create_buffer(4096) as b, \
        s.register(b, flags=mrd_client.REMOTE_READ) as r:
    print("python rkey=%d references=%d" % (r.rkey, r.references))
PY
)
echo "$py_out"
check "the installed Python client registers (${pydir:-no dist-packages})" \
  grep -qE '^python rkey=[0-9]+ references=1$' <<<"$py_out"
kill -TERM "$mrd_pid"
wait "$mrd_pid"
rc=$?
mrd_pid=
check "the installed mrd stops with exit 0, nothing pinned" \
  test "$rc" -eq 0 -a -n "$(grep 'pinned bytes: 0' "$work/mrd.log")"
[ "$failures" -eq 0 ] || cat "$work/mrd.log"
echo "$failures failure(s)"
[ "$failures" -eq 0 ]
