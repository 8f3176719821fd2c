"""A remote peer of mrd's verbs device on rdma-core's pyverbs (Debian's
python3-pyverbs): an RC queue pair connected through rdma_cm with the
session's ticket, posting RDMA READ and WRITE against mrd's tokens. It
follows docs/VERBS.md ("The connection protocol, for peer authors") and
nothing else of mrd's."""

import pyverbs.cm_enums as cm
import pyverbs.enums as ibv
from pyverbs.cmid import CMEvent, CMEventChannel, CMID, AddrInfo, ConnParam
from pyverbs.qp import QPCap, QPInitAttr

from .peer import PeerError

_ACCEPT_BYTES = 16
_WC_STATUS = {
    ibv.IBV_WC_REM_ACCESS_ERR: "PEER_REMOTE_ACCESS_ERROR",
    ibv.IBV_WC_REM_INV_REQ_ERR: "PEER_REMOTE_INVALID_REQUEST",
}


class VerbsPeer:
    """A connection to the verbs device's rdma_cm listener. Use as a
    context manager, or close(). `connection` and `max_message_size` come
    from the accept's private data."""

    def __init__(self, ticket, address, buffer_size=1 << 20,
                 timeout_ms=5000):
        host, _, port = address.rpartition(":")
        self._channel = CMEventChannel()
        self._cmid = CMID(creator=self._channel, port_space=cm.RDMA_PS_TCP)
        try:
            info = AddrInfo(dst=host.strip("[]"), dst_service=port,
                            port_space=cm.RDMA_PS_TCP)
            self._cmid.resolve_addr(info, timeout_ms)
            self._expect(cm.RDMA_CM_EVENT_ADDR_RESOLVED)
            self._cmid.resolve_route(timeout_ms)
            self._expect(cm.RDMA_CM_EVENT_ROUTE_RESOLVED)
            cap = QPCap(max_send_wr=4, max_recv_wr=1, max_send_sge=1,
                        max_recv_sge=1)
            self._cmid.create_qp(QPInitAttr(qp_type=ibv.IBV_QPT_RC,
                                            cap=cap, sq_sig_all=1))
            # initiator_depth >= 1: RDMA READ needs responder resources on
            # mrd's side, which mrd grants as many as asked here.
            data = ticket.encode("ascii")
            param = ConnParam(resources=0, depth=1, retry=7, rnr_retry=7,
                              data_len=len(data))
            param.set_private_data(data)
            self._cmid.connect(param)
            event, data = self._event()
            if event == cm.RDMA_CM_EVENT_REJECTED:
                reason = data.split(b"\0")[0].decode("ascii", "replace")
                raise PeerError(reason or "PEER_CONNECTION_REJECTED",
                                "mrd rejected the connection: " + reason)
            if event != cm.RDMA_CM_EVENT_ESTABLISHED:
                raise PeerError("PEER_CONNECTION_BROKEN",
                                "connecting: rdma_cm event %d" % event)
            if len(data) < _ACCEPT_BYTES:
                raise PeerError("PEER_PROTOCOL_ERROR",
                                "accept carried %d bytes" % len(data))
            self.connection = int.from_bytes(data[0:8], "little")
            self.max_message_size = int.from_bytes(data[8:16], "little")
            self._buffer_size = buffer_size
            self._mr = self._cmid.reg_msgs(buffer_size)
        except Exception:
            self._cmid.close()
            self._channel.close()
            raise

    @classmethod
    def connect(cls, ticket, **kwargs):
        """Connects with a PeerTicket (Session.peer_ticket())."""
        return cls(ticket.ticket, ticket.peer_address, **kwargs)

    def read(self, rkey, address, length):
        """RDMA READ of `length` bytes at `address` of `rkey`'s region."""
        self._check_length(length)
        self._cmid.post_read(self._mr, length, address, rkey,
                             flags=ibv.IBV_SEND_SIGNALED)
        self._complete()
        return self._mr.read(length, 0)

    def write(self, rkey, address, data):
        """RDMA WRITE of `data` at `address` of `rkey`'s region."""
        data = bytes(data)
        self._check_length(len(data))
        self._mr.write(data, len(data))
        self._cmid.post_write(self._mr, len(data), address, rkey,
                              flags=ibv.IBV_SEND_SIGNALED)
        self._complete()

    def close(self):
        try:
            self._cmid.disconnect()
        except Exception:  # the QP may be in error, or mrd gone
            pass
        self._mr.close()
        self._cmid.close()
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_length(self, length):
        if length > self._buffer_size:
            raise ValueError("%d bytes exceed the peer's buffer of %d" %
                             (length, self._buffer_size))

    def _complete(self):
        wc = self._cmid.get_send_comp()
        if wc.status != ibv.IBV_WC_SUCCESS:
            raise PeerError(_WC_STATUS.get(wc.status, "PEER_CONNECTION_BROKEN"),
                            "work completion status %d" % wc.status)

    def _event(self):
        event = CMEvent(self._channel)
        kind = event.event_type
        data = bytes(event.private_data or b"")
        event.ack_cm_event()
        return kind, data

    def _expect(self, kind):
        got, _ = self._event()
        if got != kind:
            raise PeerError("PEER_CONNECTION_BROKEN",
                            "rdma_cm event %d, not %d" % (got, kind))
