"""An independent peer on pyverbs (mrd_client.verbs_peer), written from
docs/VERBS.md alone, against mrd's verbs device: RDMA READ and WRITE through
mrd's tokens, a bad ticket rejected as BAD_TICKET, a dead token refused.
Runs inside the Soft-RoCE VM (MRD_TEST_DEVICE=verbs; ctest label verbs)."""

import os

import pytest

import mrd_client

pytestmark = pytest.mark.skipif(
    os.environ.get("MRD_TEST_DEVICE") != "verbs",
    reason="needs the verbs device (the Soft-RoCE VM)")


def test_a_pyverbs_peer_reads_and_writes_through_the_tokens(client):
    from mrd_client.verbs_peer import VerbsPeer
    from mrd_client import PeerError
    with client.open_fd_session() as session, \
            session.create_buffer(2 * 4096) as buffer:
        buffer.memory[:13] = b"hello, verbs!"
        flags = mrd_client.REMOTE_READ | mrd_client.REMOTE_WRITE
        ticket = session.peer_ticket()
        with session.register(buffer, flags=flags) as reg:
            with VerbsPeer.connect(ticket) as peer:
                assert peer.connection > 0
                assert peer.max_message_size >= 4096
                assert peer.read(reg.rkey, reg.base_address, 13) == \
                    b"hello, verbs!"
                peer.write(reg.rkey, reg.base_address + 7, b"pyverbs")
                assert bytes(buffer.memory[:14]) == b"hello, pyverbs"
            rkey, address = reg.rkey, reg.base_address
        with VerbsPeer.connect(ticket) as peer:
            with pytest.raises(PeerError) as e:
                peer.read(rkey, address, 4)
            assert e.value.peer_status == "PEER_REMOTE_ACCESS_ERROR"
        with pytest.raises(PeerError) as e:
            VerbsPeer("0" * 32, ticket.peer_address)
        assert e.value.peer_status == "BAD_TICKET"
