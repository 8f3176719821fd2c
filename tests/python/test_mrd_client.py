"""mrd_client against the real mrd: sessions, memfd buffers, registrations
(W5 reference counting), the peer path, LAMs, MR objects, FastRegister and
completions, lease sessions, errors, that what a session held is gone
when it ends, and the directory on etcd (publish, list_published, resolve
from another node's mrd, unpublish, watch_name) with one etcd member."""

import os
import threading
import time

import grpc
import pytest

import mrd_client
from mrd.v1 import fd_pb2, mrd_pb2
from mrd_client import MrdError, PeerError, SoftwarePeer


def pinned(client):
    return client.device_info().pinned_bytes


def test_health_and_device(client):
    assert client.health() == "SERVING"
    assert client.health("mrd.v1.MemoryRegistration") == "SERVING"
    info = client.device_info()
    assert info.kind == "software" and info.healthy
    with pytest.raises(MrdError) as e:
        client.health("no.such.Service")
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_a_peer_reads_and_writes_a_registered_memfd(client):
    with client.open_fd_session() as session:
        with session.create_buffer(2 * 4096, name="py") as buffer:
            buffer.memory[:11] = b"hello world"
            flags = mrd_client.REMOTE_READ | mrd_client.REMOTE_WRITE
            with session.register(buffer, flags=flags) as reg:
                assert reg.references == 1 and not reg.cache_hit
                assert reg.base_address == buffer.address
                assert len(reg.rdma_descriptor) == 24
                assert pinned(client) == 2 * 4096
                ticket = session.peer_ticket()
                with SoftwarePeer.connect(ticket) as peer:
                    assert peer.read(reg.rkey, reg.base_address, 11) == \
                        b"hello world"
                    peer.write(reg.rkey, reg.base_address + 6, b"mrd!!")
                    assert bytes(buffer.memory[:11]) == b"hello mrd!!"
                rkey, address = reg.rkey, reg.base_address
            # Deregistered on exit: the token is dead.
            with SoftwarePeer.connect(ticket) as peer:
                with pytest.raises(PeerError) as e:
                    peer.read(rkey, address, 4)
                assert e.value.peer_status == "PEER_REMOTE_ACCESS_ERROR"
        assert pinned(client) == 0


def test_registering_a_range_again_takes_a_reference(client):
    with client.open_fd_session() as session, \
            session.create_buffer(4096) as buffer:
        first = session.register(buffer, flags=mrd_client.REMOTE_READ)
        second = session.register(buffer, flags=mrd_client.REMOTE_READ)
        assert second.cache_hit and second.references == 2
        assert second.rkey == first.rkey
        assert second.deregister() == 1
        assert first.deregister() == 0
        assert first.deregister() is None  # once only


def test_errors_carry_code_seed_status_reason_and_required_size(client):
    with client.open_fd_session() as session, \
            session.create_buffer(3 * 4096) as buffer:
        with pytest.raises(MrdError) as e:
            session.register(buffer, length=1 << 40)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.seed_status == "STATUS_INVALID_PARAMETER"
        assert e.value.reason
        with pytest.raises(MrdError) as e:
            session.build_lam(buffer, length=3 * 4096, lam_capacity=8)
        assert e.value.seed_status == "STATUS_BUFFER_TOO_SMALL"
        assert e.value.reason == "LAM_SPACE_TOO_SMALL"
        assert e.value.required_size > 8


def test_the_fd_socket_refuses_an_unsealed_memfd_and_stays_usable(client):
    with client.open_fd_session() as session:
        fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, 4096)
            with pytest.raises(MrdError) as e:
                session.import_memfd(fd)
            assert e.value.reason == "NOT_SEALED"
            assert "F_SEAL_SHRINK" in e.value.message
        finally:
            os.close(fd)
        with session.create_buffer(4096) as buffer:
            assert buffer.id


def test_fast_register_invalidate_and_completions(client):
    with client.open_fd_session() as session, \
            session.create_buffer(3 * 4096) as buffer:
        buffer.memory[10:20] = b"0123456789"
        completions = session.completions(timeout=20)
        with SoftwarePeer.connect(session.peer_ticket()) as peer:
            connected = next(completions)
            assert connected.kind == connected.PEER_CONNECTED
            assert connected.connection == peer.connection
            with session.create_mr(fast_register=True) as mr, \
                    session.build_lam(buffer, offset=10, length=8192) as lam:
                assert lam.fbo == 10 and len(lam.pages) == 3
                base = 0x10000000A
                work = session.fast_register(peer.connection, mr, lam,
                                             length=8192, base_address=base,
                                             flags=0x8, request_context=42)
                done = next(completions)
                assert done.kind == done.FAST_REGISTER
                assert done.request_context == 42
                assert done.work_request == work
                assert done.status == mrd_pb2.STATUS_SUCCESS, done.message
                assert peer.read(done.rkey, base, 5) == b"01234"
                session.invalidate(peer.connection, mr, request_context=43)
                invalidated = next(completions)
                assert invalidated.kind == invalidated.INVALIDATE
                with pytest.raises(PeerError):
                    peer.read(done.rkey, base, 5)
        completions.close()


def test_a_lease_session_imports_a_shared_file(client, mrd):
    path = os.path.join(mrd.shm_dir, "data")
    with open(path, "wb") as f:
        f.write(b"from a file".ljust(8192, b"\0"))
    with client.open_fd_session() as vouching, \
            client.open_lease_session(ttl_seconds=60,
                                      vouching=vouching) as lease:
        assert lease.info().verified
        with lease.import_file("data", writable=True) as buffer:
            with lease.register(buffer, length=4096,
                                flags=mrd_client.REMOTE_READ) as reg:
                with SoftwarePeer.connect(lease.peer_ticket()) as peer:
                    assert peer.read(reg.rkey, reg.base_address, 11) == \
                        b"from a file"
                listed = lease.list()
                assert [r.registration for r in listed.registrations] == \
                    [reg.id]
    assert pinned(client) == 0


def test_ending_an_fd_session_releases_everything_it_held(client):
    session = client.open_fd_session()
    buffer = session.create_buffer(4 * 4096)
    session.register(buffer, flags=mrd_client.REMOTE_READ)
    session.build_lam(buffer, length=4096)
    assert pinned(client) > 0
    session.close()  # nothing deregistered or released by hand
    for _ in range(100):
        if pinned(client) == 0:
            break
    assert pinned(client) == 0
    buffer.memory.close()


def test_the_fd_socket_takes_requests_up_to_its_documented_size(client):
    """FD_MAX_REQUEST_BYTES (fd.proto) against mrd: a Ping padded with an
    unknown field to exactly the limit is answered, one byte more is
    refused as MESSAGE_TOO_LARGE, and the session carries on."""
    with client.open_fd_session() as session:
        def ping(size):
            head = fd_pb2.FdRequest(sequence=7, ping=fd_pb2.Ping())
            body = head.SerializeToString()
            # Field 100, length-delimited: tag 0xa2 0x06, then a 2-byte
            # varint length.
            pad = size - len(body) - 4
            body += bytes([0xA2, 0x06, 0x80 | (pad & 0x7F), pad >> 7])
            body += b"\0" * pad
            assert len(body) == size
            session._sock.send(body)
            return session._reply(0)
        assert ping(mrd_client.FD_MAX_REQUEST_BYTES).HasField("pong")
        with pytest.raises(MrdError) as e:
            ping(mrd_client.FD_MAX_REQUEST_BYTES + 1)
        assert e.value.reason == "MESSAGE_TOO_LARGE"
        with session.create_buffer(4096) as buffer:
            assert buffer.id


def test_batches_register_and_deregister_many_in_one_call(client):
    with client.open_fd_session() as session:
        with session.create_buffer(8 * 4096, name="py-batch") as buffer:
            for i in range(8):
                buffer.memory[i * 4096:i * 4096 + 6] = b"page %d" % i
            items = [dict(buffer=buffer, offset=i * 4096, length=4096,
                          flags=mrd_client.REMOTE_READ) for i in range(8)]
            items.append(dict(buffer=buffer, offset=8 * 4096, length=4096))
            results = session.register_batch(items)
            assert len(results) == 9
            error = results[-1]
            assert isinstance(error, MrdError)
            assert error.code == grpc.StatusCode.INVALID_ARGUMENT
            regs = results[:-1]
            assert all(isinstance(r, mrd_client.Registration) for r in regs)
            assert pinned(client) == 8 * 4096
            ticket = session.peer_ticket()
            with SoftwarePeer.connect(ticket) as peer:
                for i, reg in enumerate(regs):
                    assert peer.read(reg.rkey, reg.base_address, 6) == \
                        b"page %d" % i
                tokens = [(r.rkey, r.base_address) for r in regs]
            left = session.deregister_batch(regs)
            assert left == [0] * 8
            # A refused access ends the peer's connection: one peer each.
            for rkey, address in tokens:
                with SoftwarePeer.connect(ticket) as peer:
                    with pytest.raises(PeerError):
                        peer.read(rkey, address, 1)
            assert pinned(client) == 0
            assert all(r.deregister() is None for r in regs)


def test_a_long_registration_reports_progress_and_a_timeout_cancels_it(
        client):
    size = 1 << 30
    with client.open_fd_session() as session, \
            session.create_buffer(size, name="big") as buffer:
        seen = []
        with session.register(buffer, flags=mrd_client.REMOTE_READ,
                              request_id="big", on_progress=seen.append):
            assert seen, "no progress reported"
            for c in seen:
                assert c.request_id == "big" and c.buffer == buffer.id
                assert c.offset == 0 and c.length == size
                assert c.bytes_pinned <= size and c.bytes_populated <= size
            assert [c.elapsed_ms for c in seen] == \
                sorted(c.elapsed_ms for c in seen)
        assert pinned(client) == 0
    # A timeout that passes while mrd pins (a new buffer, whose pages mrd
    # allocates as it goes): cancelled, nothing pinned.
    with client.open_fd_session() as session, \
            session.create_buffer(size, name="big") as buffer:
        with pytest.raises(MrdError) as e:
            session.register(buffer, flags=mrd_client.REMOTE_READ,
                             timeout=0.15)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        # BuildLam the same way (another new buffer).
        with session.create_buffer(size, name="big-lam") as other:
            with pytest.raises(MrdError) as e:
                session.build_lam(other, size, timeout=0.15)
            assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(1000):
            if pinned(client) == 0:
                break
            time.sleep(0.01)
        assert pinned(client) == 0
        held = session.list()
        assert len(held.registrations) == 0 and len(held.lams) == 0


def _raise_huge_pages(pages):
    """Raises vm.nr_hugepages by `pages` (root only); the old value, or None
    when it cannot."""
    path = "/proc/sys/vm/nr_hugepages"
    try:
        with open(path) as f:
            before = int(f.read())
        with open(path, "w") as f:
            f.write(str(before + pages))
        with open(path) as f:
            if int(f.read()) == before + pages:
                return before
        with open(path, "w") as f:
            f.write(str(before))
    except OSError:
        pass
    return None


def test_a_huge_page_buffer_is_registered_and_read_by_a_peer(client):
    with client.open_fd_session() as session:
        with pytest.raises(ValueError):
            session.create_buffer(mrd_client.HUGE_PAGE_SIZE + 4096,
                                  huge_pages=True)
        before = _raise_huge_pages(1)
        if before is None:
            pytest.skip("cannot raise vm.nr_hugepages (not root)")
        try:
            with session.create_buffer(mrd_client.HUGE_PAGE_SIZE,
                                       huge_pages=True) as buffer:
                buffer.memory[4096:4100] = b"huge"
                with session.register(buffer,
                                      flags=mrd_client.REMOTE_READ) as reg:
                    assert pinned(client) == mrd_client.HUGE_PAGE_SIZE
                    with SoftwarePeer.connect(session.peer_ticket()) as peer:
                        assert peer.read(reg.rkey, reg.base_address + 4096,
                                         4) == b"huge"
            assert pinned(client) == 0
        finally:
            with open("/proc/sys/vm/nr_hugepages", "w") as f:
                f.write(str(before))


def test_publish_list_resolve_on_another_node_and_unpublish(directory_mrds):
    node_a, node_b = directory_mrds
    with node_a.open_fd_session() as session, \
            session.create_buffer(64 << 10, name="weights") as buffer, \
            session.register(buffer, flags=mrd_client.REMOTE_READ) as reg:
        tenant = session.info().tenant
        entry = session.publish("weights.0", reg)
        assert entry.name == "weights.0" and entry.node == "node-a"
        assert entry.tenant == tenant
        assert entry.address == reg.base_address
        assert entry.length == 64 << 10
        assert [t.rkey for t in entry.tokens] == [reg.rkey]

        # etcd is written in the background: no event reaches the client,
        # so a bounded poll until mrd says it is there.
        deadline = time.monotonic() + 10
        while True:
            listed = session.list_published()
            if (listed.entries and listed.entries[0].state == "published"
                    or time.monotonic() >= deadline):
                break
            time.sleep(0.02)
        assert listed.directory_state == "serving"
        assert [(e.name, e.state, e.registration) for e in listed.entries] == \
            [("weights.0", "published", reg.id)]

        # Another node's mrd on the same etcd finds it.
        peer_address = node_a.device_info().peer_address
        with node_b.open_fd_session() as other:
            for found in (other.resolve("weights.0", tenant=tenant),
                          other.resolve("weights.0")):
                assert found.node == "node-a" and found.name == "weights.0"
                assert found.address == reg.base_address
                assert found.length == 64 << 10
                assert found.epoch == 1
                assert [(t.rkey, t.peer_address) for t in found.tokens] == \
                    [(reg.rkey, peer_address)]

            assert session.unpublish("weights.0") is True
            with pytest.raises(MrdError) as e:
                other.resolve("weights.0", tenant=tenant)
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            assert e.value.reason == "NAME_NOT_PUBLISHED"
        with pytest.raises(MrdError) as e:
            session.unpublish("weights.0")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        assert not session.list_published().entries

        # An MR object's mapping is published with mr=: one not yet
        # fast-registered has no token to publish.
        mr = session.create_mr()
        with pytest.raises(MrdError) as e:
            session.publish("weights.1", mr=mr.id)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert e.value.reason == "MR_NOT_MAPPED"
        with pytest.raises(ValueError):
            session.publish("weights.1")
        with pytest.raises(ValueError):
            session.publish("weights.1", reg, mr=mr.id)


def test_a_watcher_sees_the_name_published_and_its_token_die(directory_mrds):
    node_a, node_b = directory_mrds
    with node_a.open_fd_session() as session, \
            node_b.open_fd_session() as other, \
            session.create_buffer(64 << 10, name="watched") as buffer:
        tenant = session.info().tenant
        # From another node: first the state now, nothing published.
        with other.watch_name("watched", tenant=tenant) as watch:
            event = next(watch)
            assert event.kind == mrd_pb2.NameEvent.UNPUBLISHED
            reg = session.register(buffer, flags=mrd_client.REMOTE_READ)
            session.publish("watched", reg)
            event = next(watch)
            assert event.kind == mrd_pb2.NameEvent.PUBLISHED
            assert event.entry.node == "node-a"
            assert event.entry.address == reg.base_address
            assert [t.rkey for t in event.entry.tokens] == [reg.rkey]
            # The token dies: the watcher hears it without asking.
            reg.deregister()
            event = next(watch)
            assert event.kind == mrd_pb2.NameEvent.UNPUBLISHED

            # Nothing more comes: a cancel from another thread ends the
            # wait, and the iteration stops.
            canceller = threading.Thread(target=watch.cancel)
            canceller.start()
            assert list(watch) == []
            canceller.join()

    # A stream mrd refuses raises MrdError.
    with node_a.open_fd_session() as session:
        with pytest.raises(MrdError) as e:
            next(session.watch_name("bad/name"))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.reason == "BAD_PUBLISH_NAME"


def test_without_etcd_the_directory_is_off(client):
    with client.open_fd_session() as session, \
            session.create_buffer(4096) as buffer, \
            session.register(buffer, flags=mrd_client.REMOTE_READ) as reg:
        with pytest.raises(MrdError) as e:
            session.publish("weights.0", reg)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert e.value.reason == "DIRECTORY_OFF"
        assert session.list_published().directory_state == "off"
