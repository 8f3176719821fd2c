#!/usr/bin/env bash
# Installs every Debian package mrd needs to build, run and test. Idempotent:
# when everything is already installed it does nothing (no apt-get update).
set -euo pipefail

PACKAGES=(
  # toolchain
  cmake ninja-build g++ pkg-config clang-format
  # the fuzz targets (tests/fuzz, scripts/fuzz.sh) and the TSan build, which
  # also checks thread-safety annotations: clang with libFuzzer and the
  # sanitizer runtimes; clang-tidy 22 for the lint test (.clang-tidy), which
  # skips the system headers and so takes 60 % of clang-tidy 14's time
  clang-14 libclang-rt-14-dev clang-tidy-22
  # gRPC, protobuf, reflection/health protos
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  # Abseil
  libabsl-dev
  # rdma-core: libibverbs, librdmacm and the user-space providers (rxe)
  libibverbs-dev librdmacm-dev ibverbs-providers rdma-core ibverbs-utils
  # metrics; promtool (Debian's prometheus package) lints a live scrape and
  # checks and unit-tests the alert rules (deploy/monitoring)
  prometheus-cpp-dev prometheus
  # the container image without registry or daemon (docker/build-image.sh,
  # `make image`) and podman to run it in tests
  debootstrap buildah podman runc catatonit
  # the Python client (client/python) and its tests; Debian's python3-yaml
  # reads deploy/ in tests/deploy
  python3 python3-grpcio python3-protobuf python3-pytest python3-yaml
  # its verbs peer (mrd_client.verbs_peer), tested inside the Soft-RoCE VM
  python3-pyverbs
  # systemd-analyze checks deploy/systemd/mrd.service (verify, security);
  # unshare and ip give the README's recipes private namespaces
  # (tests/integration/readme_test.py)
  systemd util-linux iproute2
  # the directory on etcd (server/directory, docs/DIRECTORY.md): the etcd
  # server its tests run as a three-member cluster on loopback, etcdctl
  # (the tests turn etcd's authentication on with it), and etcd's own
  # .proto files, from which the build makes the v3 API's client stubs
  # (proto/etcd); openssl: the tests make the CA and certificates of etcd
  # over TLS
  etcd-server etcd-client golang-etcd-server-dev openssl
  # tests and benchmarks
  libgtest-dev libgmock-dev libbenchmark-dev
  # `make bench`'s plots (bench/plot_bench.py, PNGs for docs/PERFORMANCE.md)
  python3-matplotlib
  # the cache benchmark's comparison: UCX's registration cache (ucs_rcache)
  libucx-dev
  # the Soft-RoCE VM harness (tests/vm): qemu, a static busybox for the
  # initramfs, cpio and kmod (depmod) to build it, and RDMA tools used inside
  qemu-system-x86 busybox-static cpio kmod perftest rdmacm-utils
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done
# Node.js and npm run the manifest validators (tests/deploy/k8s); a machine
# that has them from elsewhere keeps its own.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  missing+=(nodejs npm)
fi
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null; then
    echo "install-deps: missing packages (${missing[*]}); run as root, or" \
      "install sudo (apt-get install sudo, as root) and try again" >&2
    exit 1
  fi
  SUDO="sudo"
fi
echo "install-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
