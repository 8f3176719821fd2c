"""pytest fixtures: the real mrd (MRD_BINARY) on the test's device, in a
private runtime directory and shm directory, and a Client connected to it."""

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

import mrd_client


def device_flags():
    """The device the tests run on: the software device, or inside the
    Soft-RoCE VM (MRD_TEST_DEVICE=verbs; tests/vm/run.sh sets
    MRD_VERBS_DEVICE and MRD_VERBS_ADDRESS) the verbs device."""
    if os.environ.get("MRD_TEST_DEVICE") != "verbs":
        return ["--device=software", "--peer_address=127.0.0.1:0"]
    return ["--device=verbs",
            "--verbs_device=" + os.environ.get("MRD_VERBS_DEVICE", ""),
            "--peer_address=%s:0" % os.environ.get("MRD_VERBS_ADDRESS",
                                                   "127.0.0.1")]


class Mrd:
    def __init__(self, extra_flags=()):
        self.dir = tempfile.mkdtemp(prefix="mrd-python-")
        self.runtime_dir = os.path.join(self.dir, "run")
        os.mkdir(self.runtime_dir, 0o700)
        self.shm_dir = tempfile.mkdtemp(prefix="mrd-python-shm-",
                                        dir="/dev/shm")
        os.chmod(self.shm_dir, 0o1777)
        self.log_path = os.path.join(self.dir, "mrd.log")
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [os.environ["MRD_BINARY"]] + device_flags() +
            ["--runtime_dir=" + self.runtime_dir, "--shm_dir=" + self.shm_dir,
             "--metrics_address=",
             "--warm_pin_bytes_per_session=0", "--warm_pin_bytes_total=0",
             # Long registrations report early and often, and pin slowly
             # enough to be cancelled (test_a_long_registration_...).
             "--progress_after=1ms", "--progress_interval=5ms",
             "--prefault_threads=1"] + list(extra_flags),
            stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(200):
            if os.path.exists(self.socket_path) or self.process.poll() is not None:
                break
            time.sleep(0.05)
        assert os.path.exists(self.socket_path), self.read_log()

    @property
    def socket_path(self):
        return os.path.join(self.runtime_dir, "mrd.sock")

    @property
    def fd_socket_path(self):
        return os.path.join(self.runtime_dir, "fd.sock")

    def read_log(self):
        with open(self.log_path) as f:
            return f.read()

    def stop(self):
        self.process.terminate()
        code = self.process.wait(timeout=30)
        self.log.close()
        log = self.read_log()
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        return code, log


@pytest.fixture
def mrd():
    server = Mrd()
    yield server
    code, log = server.stop()
    assert code == 0, log
    assert "device pinned bytes: 0" in log, log


@pytest.fixture
def client(mrd):
    with mrd_client.Client(socket_path=mrd.socket_path,
                           fd_socket_path=mrd.fd_socket_path) as c:
        yield c


@pytest.fixture
def two_devices():
    """A Client of an mrd of its own on two software devices
    (--software_devices=2: software, software1)."""
    if os.environ.get("MRD_TEST_DEVICE") == "verbs":
        pytest.skip("software devices only")
    server = Mrd(["--software_devices=2"])
    with mrd_client.Client(socket_path=server.socket_path,
                           fd_socket_path=server.fd_socket_path) as c:
        yield c
    code, log = server.stop()
    assert code == 0, log
    assert "device pinned bytes: 0" in log, log


def free_port():
    """A free TCP port on 127.0.0.1 (bound and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    """One etcd member (Debian's /usr/bin/etcd) on free loopback ports, its
    data in a temporary directory; ready once its /health says so."""

    BINARY = "/usr/bin/etcd"

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="mrd-python-etcd-")
        self.log_path = os.path.join(self.dir, "etcd.log")
        self.log = open(self.log_path, "w")
        client_port, peer_port = free_port(), free_port()
        self.endpoint = "127.0.0.1:%d" % client_port
        client_url = "http://" + self.endpoint
        peer_url = "http://127.0.0.1:%d" % peer_port
        self.process = subprocess.Popen(
            [self.BINARY, "--name=py", "--data-dir=" + self.dir + "/data",
             "--listen-client-urls=" + client_url,
             "--advertise-client-urls=" + client_url,
             "--listen-peer-urls=" + peer_url,
             "--initial-advertise-peer-urls=" + peer_url,
             "--initial-cluster=py=" + peer_url,
             "--initial-cluster-state=new",
             "--heartbeat-interval=50", "--election-timeout=500"],
            stdout=self.log, stderr=subprocess.STDOUT)
        # No event says it is up: poll /health, bounded (20 s).
        deadline = time.monotonic() + 20
        while True:
            assert self.process.poll() is None, self.read_log()
            try:
                with urllib.request.urlopen(client_url + "/health",
                                            timeout=1) as reply:
                    if b'"true"' in reply.read():
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, self.read_log()
            time.sleep(0.05)

    def read_log(self):
        with open(self.log_path) as f:
            return f.read()

    def stop(self):
        self.process.kill()
        self.process.wait(timeout=30)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def etcd():
    if not os.access(Etcd.BINARY, os.X_OK):
        pytest.skip("no " + Etcd.BINARY + " (Debian's etcd-server)")
    server = Etcd()
    yield server
    server.stop()


def directory_flags(etcd, node):
    return ["--etcd_endpoints=" + etcd.endpoint,
            "--directory_cluster=py%d" % os.getpid(),
            "--node_name=" + node, "--directory_lease_ttl=5s",
            "--directory_unpublish_wait=5s"]


@pytest.fixture
def directory_mrds(etcd):
    """Two mrds on the same etcd, node-a and node-b: a Client of each."""
    servers = [Mrd(directory_flags(etcd, node))
               for node in ("node-a", "node-b")]
    clients = [mrd_client.Client(socket_path=s.socket_path,
                                 fd_socket_path=s.fd_socket_path)
               for s in servers]
    yield clients
    for c in clients:
        c.close()
    for server in servers:
        code, log = server.stop()
        assert code == 0, log
        assert "device pinned bytes: 0" in log, log
