"""The software device's peer path (peer.proto): what a remote peer speaks
to READ and WRITE memory through mrd's tokens, as a remote NIC would. TCP;
each frame is a 4-byte little-endian length and one serialized message; the
first request is `hello` with a ticket from Session.peer_ticket()."""

import socket
import struct

import grpc

from mrd.v1 import peer_pb2

from .errors import MrdError

_MAX_FRAME = 64 << 20


class PeerError(MrdError):
    """The device refused a request (peer_status: "PEER_REMOTE_ACCESS_ERROR",
    ...). After a refused READ or WRITE the connection is closed, as an RC
    queue pair moves to the error state."""

    def __init__(self, peer_status, message):
        self.peer_status = peer_status
        code = (grpc.StatusCode.PERMISSION_DENIED
                if peer_status == "PEER_REMOTE_ACCESS_ERROR"
                else grpc.StatusCode.UNAVAILABLE)
        super().__init__(code, message, reason=peer_status)


class SoftwarePeer:
    """A connection to the software device's peer port. Use as a context
    manager, or close()."""

    def __init__(self, ticket, address, timeout=30.0):
        host, _, port = address.rpartition(":")
        self._sock = socket.create_connection((host.strip("[]"), int(port)),
                                              timeout=timeout)
        self._next_id = 1
        hello = self._ask(peer_pb2.PeerRequest(
            hello=peer_pb2.PeerHello(ticket=ticket)))
        self.connection = hello.connection
        self.max_message_size = hello.max_message_size

    @classmethod
    def connect(cls, ticket, timeout=30.0):
        """Connects with a PeerTicket (Session.peer_ticket())."""
        return cls(ticket.ticket, ticket.peer_address, timeout)

    def read(self, rkey, address, length):
        """RDMA READ: `length` bytes at `address` of the region of `rkey`."""
        return self._ask(peer_pb2.PeerRequest(read=peer_pb2.PeerRead(
            rkey=rkey, address=address, length=length))).data

    def write(self, rkey, address, data):
        """RDMA WRITE of `data` at `address` of the region of `rkey`."""
        self._ask(peer_pb2.PeerRequest(write=peer_pb2.PeerWrite(
            rkey=rkey, address=address, data=bytes(data))))

    def close(self):
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _ask(self, request):
        request.id = self._next_id
        self._next_id += 1
        body = request.SerializeToString()
        self._sock.sendall(struct.pack("<I", len(body)) + body)
        (length,) = struct.unpack("<I", self._recv_exactly(4))
        if length > _MAX_FRAME:
            raise PeerError("PEER_REMOTE_INVALID_REQUEST",
                            "frame of %d bytes" % length)
        response = peer_pb2.PeerResponse()
        response.ParseFromString(self._recv_exactly(length))
        if response.status != peer_pb2.PEER_SUCCESS:
            raise PeerError(peer_pb2.PeerStatus.Name(response.status),
                            response.message)
        return response

    def _recv_exactly(self, n):
        out = bytearray()
        while len(out) < n:
            chunk = self._sock.recv(n - len(out))
            if not chunk:
                raise PeerError("PEER_CONNECTION_BROKEN",
                                "the peer port closed the connection")
            out += chunk
        return bytes(out)
