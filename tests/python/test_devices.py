"""mrd_client against the real mrd on two software devices
(--software_devices=2: software, software1): the device list, registrations
on both (by name and ALL_DEVICES) with a token per device that a
SoftwarePeer on that device's ticket reads through until it is deregistered,
batches on both, and unknown device names refused by name with nothing
pinned."""

import grpc
import pytest

import mrd_client
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
