"""mrd_client against the real mrd on two software devices
(--software_devices=2: software, software1): the device list, registrations
on both (by name and ALL_DEVICES) with a token per device that a
SoftwarePeer on that device's ticket reads through until it is deregistered,
batches on both, a session's default devices, MR objects and LAMs of one
device (create_mr/build_lam device=) fast-registered on that device's
connections only, and unknown device names refused by name with nothing
pinned."""

import grpc
import pytest

import mrd_client
from mrd.v1 import mrd_pb2
from mrd_client import MrdError, PeerError, SoftwarePeer

NAMES = ["software", "software1"]


@pytest.fixture
def client(two_devices):
    return two_devices


def pinned(client):
    """Pinned bytes of each device."""
    return [d.pinned_bytes for d in client.devices()]


def read_through(session, token, address, length):
    """READ through `token` by a peer of its device (a ticket of it)."""
    ticket = session.peer_ticket(token.device)
    assert ticket.device == token.device
    assert ticket.peer_address == token.peer_address
    with SoftwarePeer.connect(ticket) as peer:
        return peer.read(token.rkey, address, length)


def test_devices_lists_both_with_peer_paths_of_their_own(client):
    devices = client.devices()
    assert [d.name for d in devices] == NAMES
    assert all(d.kind == "software" and d.healthy for d in devices)
    assert devices[0].peer_address != devices[1].peer_address
    assert client.device_info().name == "software"  # the first, as before


def test_a_peer_reads_through_each_devices_token(client):
    addresses = [d.peer_address for d in client.devices()]
    with client.open_fd_session() as session, \
            session.create_buffer(2 * 4096) as buffer:
        buffer.memory[:11] = b"two devices"
        reg = session.register(buffer, flags=mrd_client.REMOTE_READ,
                               devices=mrd_client.ALL_DEVICES)
        assert [t.device for t in reg.tokens] == NAMES
        assert [t.peer_address for t in reg.tokens] == addresses
        assert reg.rkey == reg.tokens[0].rkey
        assert reg.token("software1") is reg.tokens[1]
        assert pinned(client) == [2 * 4096, 2 * 4096]
        for token in reg.tokens:
            assert read_through(session, token, reg.base_address, 11) == \
                b"two devices", token.device
        # The same devices by name: the same registration, its tokens.
        again = session.register(buffer, flags=mrd_client.REMOTE_READ,
                                 devices=NAMES)
        assert again.cache_hit and again.id == reg.id
        assert list(again.tokens) == list(reg.tokens)
        listed = session.list().registrations
        assert [list(r.tokens) for r in listed] == [list(reg.tokens)]
        assert again.deregister() == 1
        tokens, address = reg.tokens, reg.base_address
        assert reg.deregister() == 0
        # Deregistered: dead on both devices.
        for token in tokens:
            with pytest.raises(PeerError) as e:
                read_through(session, token, address, 4)
            assert e.value.peer_status == "PEER_REMOTE_ACCESS_ERROR"
        assert pinned(client) == [0, 0]
        # The second device alone: one token, of that device.
        with session.register(buffer, length=4096,
                              flags=mrd_client.REMOTE_READ,
                              devices=["software1"]) as second:
            assert [t.device for t in second.tokens] == ["software1"]
            assert read_through(session, second.token("software1"),
                                second.base_address, 3) == b"two"
            with pytest.raises(KeyError):
                second.token("software")
            # mrd's software devices share their pins: both show the page.
            assert pinned(client) == [4096, 4096]
    assert pinned(client) == [0, 0]


def test_a_batch_registers_each_item_on_its_devices(client):
    with client.open_fd_session() as session, \
            session.create_buffer(4 * 4096) as buffer:
        buffer.memory[4096:4101] = b"batch"
        first, second = session.register_batch([
            dict(buffer=buffer, offset=0, length=4096,
                 flags=mrd_client.REMOTE_READ,
                 devices=mrd_client.ALL_DEVICES),
            dict(buffer=buffer, offset=4096, length=4096,
                 flags=mrd_client.REMOTE_READ, devices=["software1"]),
        ])
        assert [t.device for t in first.tokens] == NAMES
        assert [t.device for t in second.tokens] == ["software1"]
        assert read_through(session, second.tokens[0], second.base_address,
                            5) == b"batch"
        assert pinned(client) == [2 * 4096, 2 * 4096]  # pins shared
        assert session.deregister_batch([first, second]) == [0, 0]
        assert pinned(client) == [0, 0]


def test_unknown_devices_are_refused_by_name(client):
    with client.open_fd_session() as session, \
            session.create_buffer(4096) as buffer:
        with pytest.raises(MrdError) as e:
            session.register(buffer, devices=["software1", "mlx5_7"])
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.reason == "UNKNOWN_DEVICE"
        assert "mlx5_7" in e.value.message
        assert pinned(client) == [0, 0]
        assert len(session.list().registrations) == 0
        with pytest.raises(MrdError) as e:
            session.peer_ticket("mlx5_7")
        assert e.value.reason == "UNKNOWN_DEVICE"
        # A bare name is not a list of names.
        with pytest.raises(ValueError):
            session.register(buffer, devices="software1")


def test_nearest_takes_every_device_when_none_has_a_numa_node(client):
    # Software devices are on no NUMA node: every device is as near.
    assert all(d.numa_node == -1 for d in client.devices())
    with client.open_fd_session() as session, \
            session.create_buffer(4096) as buffer:
        buffer.memory[:4] = b"near"
        with session.register(buffer, flags=mrd_client.REMOTE_READ,
                              devices=mrd_client.NEAREST_DEVICES) as reg:
            assert [t.device for t in reg.tokens] == NAMES
            for token in reg.tokens:
                assert read_through(session, token, reg.base_address,
                                    4) == b"near"


def test_default_devices_serve_registrations_that_name_none(client):
    with client.open_fd_session() as session, \
            session.create_buffer(4096) as buffer:
        buffer.memory[:7] = b"default"
        info = session.set_default_devices(["software1"])
        assert list(info.default_devices.names) == ["software1"]
        assert list(session.info().default_devices.names) == ["software1"]
        with session.register(buffer, flags=mrd_client.REMOTE_READ) as reg:
            assert [t.device for t in reg.tokens] == ["software1"]
            assert read_through(session, reg.tokens[0], reg.base_address,
                                7) == b"default"
        # A batch item that names none follows it too.
        [item] = session.register_batch([dict(buffer=buffer, length=4096)])
        assert [t.device for t in item.tokens] == ["software1"]
        assert session.deregister_batch([item]) == [0]
        # ALL_DEVICES (and NEAREST_DEVICES) as register() takes them.
        assert session.set_default_devices(
            mrd_client.ALL_DEVICES).default_devices.all
        assert session.set_default_devices(
            mrd_client.NEAREST_DEVICES).default_devices.nearest
        with session.register(buffer) as reg:
            assert [t.device for t in reg.tokens] == NAMES
        # None: mrd's first device again.
        session.set_default_devices(None)
        with session.register(buffer) as reg:
            assert [t.device for t in reg.tokens] == ["software"]
        with pytest.raises(MrdError) as e:
            session.set_default_devices(["mlx5_7"])
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.reason == "UNKNOWN_DEVICE"
        with pytest.raises(ValueError):
            session.set_default_devices("software1")
        assert pinned(client) == [0, 0]


def test_an_mr_and_a_lam_of_a_device_fast_register_on_its_connections(
        client):
    with client.open_fd_session() as session, \
            session.create_buffer(3 * 4096) as buffer:
        buffer.memory[10:20] = b"0123456789"
        # create_mr and build_lam name their device; "" is the first,
        # whatever the session's default devices.
        session.set_default_devices(["software1"])
        completions = session.completions(timeout=20)
        with SoftwarePeer.connect(session.peer_ticket("software1")) as peer, \
                session.create_mr(device="software1") as mr, \
                session.create_mr() as first_mr, \
                session.build_lam(buffer, offset=10, length=8192) as first_lam:
            connected = next(completions)
            assert connected.kind == connected.PEER_CONNECTED
            assert connected.connection == peer.connection
            assert mr.device == "software1" and mr.info.device == "software1"
            assert first_mr.device == "software"
            assert first_lam.device == "software"
            base = 0x10000000A
            # The second device's MR over the first device's LAM: no LAM of
            # the second device at those logical addresses.
            with pytest.raises(MrdError) as e:
                session.fast_register(peer.connection, mr, first_lam,
                                      length=8192, base_address=base,
                                      flags=0x8)
            assert e.value.reason == "UNKNOWN_LOGICAL_ADDRESS"
            with session.build_lam(buffer, offset=10, length=8192,
                                   device="software1") as lam:
                assert lam.device == "software1"
                listed = session.list()
                assert sorted(x.device for x in listed.mrs) == NAMES
                assert sorted(x.device for x in listed.lams) == NAMES
                # The first device's MR on the second device's connection.
                with pytest.raises(MrdError) as e:
                    session.fast_register(peer.connection, first_mr, lam,
                                          length=8192, base_address=base,
                                          flags=0x8)
                assert e.value.reason == "MR_ON_ANOTHER_DEVICE"
                assert e.value.seed_status == "STATUS_CONNECTION_INVALID"
                work = session.fast_register(peer.connection, mr, lam,
                                             length=8192, base_address=base,
                                             flags=0x8, request_context=26)
                done = next(completions)
                assert done.kind == done.FAST_REGISTER
                assert done.work_request == work
                assert done.status == mrd_pb2.STATUS_SUCCESS, done.message
                assert peer.read(done.rkey, base, 5) == b"01234"
                session.invalidate(peer.connection, mr, request_context=27)
                assert next(completions).kind == done.INVALIDATE
        completions.close()
        assert pinned(client) == [0, 0]
        with pytest.raises(MrdError) as e:
            session.create_mr(device="mlx5_7")
        assert e.value.reason == "UNKNOWN_DEVICE"
        with pytest.raises(MrdError) as e:
            session.build_lam(buffer, length=4096, device="mlx5_7")
        assert e.value.reason == "UNKNOWN_DEVICE"
        assert "mlx5_7" in e.value.message
        assert pinned(client) == [0, 0]
