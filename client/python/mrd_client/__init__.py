"""mrd's Python client: register memory with mrd, the node-local RDMA
memory-registration service, from a process with no RDMA privileges.

    import mrd_client

    with mrd_client.Client() as client, client.open_fd_session() as session:
        with session.create_buffer(1 << 20) as buffer:
            buffer.memory[:5] = b"hello"
            with session.register(buffer, flags=mrd_client.REMOTE_READ) as reg:
                ticket = session.peer_ticket()
                ...  # hand reg.rkey, reg.base_address and the ticket to a peer

On several devices (client.devices()), session.register(...,
devices=mrd_client.ALL_DEVICES) or devices=[names] gives one token per
device (reg.tokens, reg.token(name)); a peer of a device uses its token with
session.peer_ticket(name).

Errors are MrdError (code, seed_status, reason, required_size). The
software device's peer side is mrd_client.SoftwarePeer.
"""

from .client import (ALL_DEVICES, NEAREST_DEVICES, FD_MAX_REPLY_BYTES, FD_MAX_REQUEST_BYTES, HUGE_PAGE_SIZE,
                     LOCAL_READ, LOCAL_WRITE, REMOTE_READ, REMOTE_WRITE,
                     Buffer, Client,
                     FdSession, Lam, LeaseSession, MemfdBuffer, Mr,
                     NameWatch, Registration, Session, default_runtime_dir)
from .errors import MrdError
from .peer import PeerError, SoftwarePeer

# mrd_client.verbs_peer (VerbsPeer) needs python3-pyverbs: import it by name.

__all__ = [
    "ALL_DEVICES", "NEAREST_DEVICES", "Buffer", "Client", "FdSession", "FD_MAX_REPLY_BYTES",
    "FD_MAX_REQUEST_BYTES", "HUGE_PAGE_SIZE", "Lam", "LeaseSession", "LOCAL_READ",
    "LOCAL_WRITE", "MemfdBuffer", "Mr", "MrdError", "NameWatch", "PeerError",
    "REMOTE_READ", "REMOTE_WRITE", "Registration", "Session", "SoftwarePeer",
    "default_runtime_dir",
]
