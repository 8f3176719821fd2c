"""pytest fixtures: the real mrd (MRD_BINARY) on the test's device, in a
private runtime directory and shm directory, and a Client connected to it."""

import os
import shutil
import subprocess
import tempfile
import time

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
    def __init__(self):
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
             "--prefault_threads=1"],
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
