"""mrd's client: sessions, buffers, registrations, LAMs, MR objects,
FastRegister and completions, over gRPC and the fd socket. Every handle is a
context manager that gives back what it holds on exit (and has the explicit
call: close(), release(), deregister()); errors are MrdError."""

import array
import fcntl
import mmap
import os
import select
import socket
import threading

import grpc

from mrd.v1 import fd_pb2, mrd_pb2, mrd_pb2_grpc
from mrd_client_health import health_pb2  # grpc.health.v1, generated here
from mrd_client_policy import RETRY_SERVICE_CONFIG  # client/retry_policy.json

from . import errors
from .errors import MrdError

# NDK_MR_FLAG_* (mrd.proto, R3).
LOCAL_READ = mrd_pb2.NDK_MR_FLAG_ALLOW_LOCAL_READ
LOCAL_WRITE = mrd_pb2.NDK_MR_FLAG_ALLOW_LOCAL_WRITE
REMOTE_READ = mrd_pb2.NDK_MR_FLAG_ALLOW_REMOTE_READ
REMOTE_WRITE = mrd_pb2.NDK_MR_FLAG_ALLOW_REMOTE_WRITE

# register(devices=ALL_DEVICES): every device mrd serves.
ALL_DEVICES = "all"
# register(devices=NEAREST_DEVICES): the devices on the NUMA node of the
# memory (every device when none is).
NEAREST_DEVICES = "nearest"

# The fd socket's limits (fd.proto): a request datagram of at most 4096
# bytes with at most one fd; replies fit in 4096 bytes.
FD_MAX_REQUEST_BYTES = 4096
FD_MAX_REPLY_BYTES = 4096

_F_ADD_SEALS = 1033
_F_SEAL_SHRINK = 0x0002
_F_SEAL_GROW = 0x0004


def _select_devices(selection, devices):
    """Fills a DeviceSelection from a list of names, ALL_DEVICES or
    NEAREST_DEVICES."""
    if devices == ALL_DEVICES:
        selection.all = True
    elif devices == NEAREST_DEVICES:
        selection.nearest = True
    elif isinstance(devices, str):
        raise ValueError("devices takes a list of device names, "
                         "ALL_DEVICES or NEAREST_DEVICES, not the string "
                         "%r" % devices)
    else:
        selection.names.extend(devices)


def default_runtime_dir():
    """Where mrd's sockets are, as mrd and mrctl decide it: $MRD_RUNTIME_DIR,
    else /run/mrd as root, else $XDG_RUNTIME_DIR/mrd, else /tmp/mrd-<uid>."""
    if os.environ.get("MRD_RUNTIME_DIR"):
        return os.environ["MRD_RUNTIME_DIR"]
    if os.geteuid() == 0:
        return "/run/mrd"
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.environ["XDG_RUNTIME_DIR"] + "/mrd"
    return "/tmp/mrd-%d" % os.geteuid()


class Client:
    """A connection to mrd's gRPC socket (and the path of its fd socket).

    mrd bounds a connection's open calls (--grpc_max_streams_per_connection,
    32 by default); open completion streams and name watches count, and
    while they fill the bound every other call waits. A process that keeps
    more streams open makes another Client for them.
    """

    def __init__(self, socket_path=None, fd_socket_path=None, timeout=30.0):
        runtime_dir = default_runtime_dir()
        self.socket_path = socket_path or runtime_dir + "/mrd.sock"
        self.fd_socket_path = fd_socket_path or runtime_dir + "/fd.sock"
        self.timeout = timeout
        # A live handover answers the calls it held UNAVAILABLE HANDED_OVER
        # with a retry hint; retried on the channel's new connection (to the
        # new mrd) they cost a short pause. Every other UNAVAILABLE answer
        # of mrd is final (a negative hint).
        self._channel = grpc.insecure_channel(
            "unix:" + self.socket_path,
            options=[("grpc.service_config", RETRY_SERVICE_CONFIG),
                     # A connection of its own: gRPC would otherwise share
                     # one between the Clients of a process, and mrd bounds
                     # a connection's open calls (at most 32 by default,
                     # its open streams among them).
                     ("grpc.use_local_subchannel_pool", 1)])
        self._stub = mrd_pb2_grpc.MemoryRegistrationStub(self._channel)

    def call(self, method, request, timeout=None):
        """Calls a unary method by name; MrdError on failure."""
        try:
            return getattr(self._stub, method)(
                request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    def device_info(self):
        """GetDeviceInfo: the first device's attributes, and in `devices`
        every device mrd serves."""
        return self.call("GetDeviceInfo", mrd_pb2.GetDeviceInfoRequest())

    def devices(self):
        """Every device mrd serves (DeviceInfo messages, in mrd's order; the
        first is every call's default). Their `name`s are what register()'s
        `devices` and peer_ticket()'s `device` take."""
        return list(self.device_info().devices)

    def health(self, service=""):
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... ("" is
        liveness, "mrd.v1.MemoryRegistration" readiness)."""
        check = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)
        try:
            reply = check(health_pb2.HealthCheckRequest(service=service),
                          timeout=self.timeout)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def open_fd_session(self):
        """A session that lives as long as its fd-socket connection."""
        return FdSession(self)

    def open_lease_session(self, ttl_seconds=0, vouching=None):
        """A lease session (every call renews it; closed on exit). An open
        FdSession given as `vouching` vouches for it (it then carries this
        process's uid)."""
        request = mrd_pb2.OpenLeaseSessionRequest(ttl_seconds=ttl_seconds)
        if vouching is not None:
            request.vouching_session = vouching.token
        info = self.call("OpenLeaseSession", request)
        return LeaseSession(self, info.session)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _peer_still_there(sock):
    """Whether the other end of a connected socket is still open."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLRDHUP)
    for _, events in poller.poll(0):
        if events & (select.POLLHUP | select.POLLRDHUP | select.POLLERR |
                     select.POLLNVAL):
            return False
    return True


class Session:
    """What both kinds of session do; `token` names it in every request."""

    def __init__(self, client, token):
        self.client = client
        self.token = token

    def _call(self, method, request, timeout=None):
        request.session = self.token
        return self.client.call(method, request, timeout=timeout)

    def info(self):
        return self._call("GetSession", mrd_pb2.GetSessionRequest())

    def set_default_devices(self, devices):
        """SetDefaultDevices: the devices register() and register_batch()
        use when they name none; `devices` as register()'s (a list of
        names, ALL_DEVICES or NEAREST_DEVICES; None or []: mrd's first
        device again). Returns the SessionInfo (its `default_devices`).
        create_mr() and build_lam() do not follow it. MrdError
        INVALID_ARGUMENT UNKNOWN_DEVICE for a device mrd does not serve."""
        request = mrd_pb2.SetDefaultDevicesRequest()
        if devices is not None:
            _select_devices(request.devices, devices)
        return self._call("SetDefaultDevices", request)

    def list(self):
        return self._call("ListRegistrations",
                          mrd_pb2.ListRegistrationsRequest())

    def import_file(self, path, writable=False):
        """ImportFile: a file under mrd's --shm_dir."""
        info = self._call("ImportFile", mrd_pb2.ImportFileRequest(
            path=path, writable=writable))
        return Buffer(self, info)

    def register(self, buffer, length=None, offset=0, flags=LOCAL_READ,
                 mem_flags=0, base_address=None, mr=None,
                 descriptor_capacity=0, request_id="", devices=None,
                 timeout=None, on_progress=None):
        """RegisterMr on a Buffer (or a buffer id): the Registration.

        devices: the devices to register on, as a list of names (Client's
        devices()), ALL_DEVICES or NEAREST_DEVICES; None: the session's
        default (mrd's first device unless SetDefaultDevices said). The
        registration is on all of them or on none (an unknown name:
        MrdError INVALID_ARGUMENT UNKNOWN_DEVICE); its `tokens` give one
        token per device.

        timeout: seconds for this call (default: the client's). Passing it
        while mrd pins cancels the registration: MrdError DEADLINE_EXCEEDED,
        and nothing of it stays pinned.
        on_progress: called (on another thread) with each
        REGISTRATION_PROGRESS Completion of this call while mrd pins
        (ranges of 32 MiB or more, after a second). It reads the session's
        completion stream meanwhile: a stream of the session open elsewhere
        ends then (ABORTED, STREAM_REPLACED), one stream per session."""
        request = self._register_request(
            buffer, length=length, offset=offset, flags=flags,
            mem_flags=mem_flags, base_address=base_address, mr=mr,
            descriptor_capacity=descriptor_capacity, request_id=request_id,
            devices=devices)
        if on_progress is None:
            return Registration(
                self, self._call("RegisterMr", request, timeout=timeout))
        stream = self.client._stub.StreamCompletions(
            mrd_pb2.StreamCompletionsRequest(session=self.token))

        def watch():
            try:
                for c in stream:
                    if (c.kind == mrd_pb2.Completion.REGISTRATION_PROGRESS
                            and c.buffer == request.buffer
                            and c.offset == request.offset
                            and c.length == request.length):
                        on_progress(c)
            except grpc.RpcError:
                pass  # cancelled below, or the session ended

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            return Registration(
                self, self._call("RegisterMr", request, timeout=timeout))
        finally:
            stream.cancel()
            watcher.join()

    @staticmethod
    def _register_request(buffer, length=None, offset=0, flags=LOCAL_READ,
                          mem_flags=0, base_address=None, mr=None,
                          descriptor_capacity=0, request_id="", devices=None):
        buffer_id = buffer.id if isinstance(buffer, Buffer) else buffer
        if length is None:
            length = buffer.size - offset
        request = mrd_pb2.RegisterMrRequest(
            buffer=buffer_id, offset=offset, length=length, flags=flags,
            mem_flags=mem_flags, descriptor_capacity=descriptor_capacity,
            request_id=request_id, mr=mr.id if isinstance(mr, Mr) else (mr or 0))
        if base_address is not None:
            request.base_address = base_address
        if devices is not None:
            _select_devices(request.devices, devices)
        return request

    def register_batch(self, items):
        """RegisterMrBatch: many registrations in one round trip. `items` are
        dicts of register()'s keyword arguments. Returns one entry per item,
        in order: its Registration, or the MrdError it got (a failed item
        leaves nothing behind and does not stop the others). The call itself
        raises MrdError only when the batch could not be tried at all
        (session, BATCH_TOO_LARGE)."""
        request = mrd_pb2.RegisterMrBatchRequest()
        for item in items:
            request.items.append(self._register_request(**item))
        reply = self._call("RegisterMrBatch", request)
        results = []
        for result in reply.items:
            error = errors.from_item_status(result.status)
            results.append(error if error is not None
                           else Registration(self, result.registration))
        return results

    def deregister_batch(self, registrations):
        """DeregisterMrBatch: gives one reference of each Registration back in
        one round trip. Returns, per registration in order, the references
        left or the MrdError it got; each is deregistered afterwards (as after
        deregister())."""
        request = mrd_pb2.DeregisterMrBatchRequest()
        for registration in registrations:
            request.items.add(registration=registration.id)
            registration.id = 0
        reply = self._call("DeregisterMrBatch", request)
        results = []
        for result in reply.items:
            error = errors.from_item_status(result.status)
            results.append(error if error is not None else result.references)
        return results

    def build_lam(self, buffer, length, offset=0, lam_capacity=0,
                  timeout=None, device=""):
        """BuildLam: pins the range and returns its page list (a Lam).
        timeout: as register()'s (passing while mrd pins cancels it).
        device: the device whose logical address space maps it (a name from
        Client.devices(); "": mrd's first device, whatever the session's
        default devices); its pages serve fast registrations of that
        device's MR objects only."""
        buffer_id = buffer.id if isinstance(buffer, Buffer) else buffer
        return Lam(self, self._call("BuildLam", mrd_pb2.BuildLamRequest(
            buffer=buffer_id, offset=offset, length=length,
            lam_capacity=lam_capacity, device=device), timeout=timeout))

    def create_mr(self, fast_register=True, allow_remote_access=True,
                  device=""):
        """CreateMr: an MR object (an Mr) of `device` (a name from
        Client.devices(); "": mrd's first device, whatever the session's
        default devices). A fast-register MR is posted on that device's
        connections only, over LAMs of that device."""
        return Mr(self, self._call("CreateMr", mrd_pb2.CreateMrRequest(
            fast_register=fast_register,
            allow_remote_access=allow_remote_access, device=device)))

    def fast_register(self, connection, mr, lam, length, base_address,
                      flags=0, request_context=0):
        """FastRegister (F1-F6) of `mr` over `lam`'s pages on a peer
        connection; the result arrives as a completion. The work request."""
        reply = self._call("FastRegister", mrd_pb2.FastRegisterRequest(
            connection=connection, request_context=request_context,
            mr=mr.id if isinstance(mr, Mr) else mr,
            pages=list(lam.pages), fbo=lam.fbo, length=length,
            base_address=base_address, flags=flags))
        return reply.work_request

    def invalidate(self, connection, mr, flags=0, request_context=0):
        reply = self._call("InvalidateMr", mrd_pb2.InvalidateMrRequest(
            connection=connection, request_context=request_context,
            mr=mr.id if isinstance(mr, Mr) else mr, flags=flags))
        return reply.work_request

    def completions(self, timeout=None):
        """The session's completions (Completion messages) as they come;
        ends with the session, or raises MrdError(DEADLINE_EXCEEDED)."""
        stream = self.client._stub.StreamCompletions(
            mrd_pb2.StreamCompletionsRequest(session=self.token),
            timeout=timeout)
        try:
            for completion in stream:
                yield completion
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise errors.from_rpc_error(e) from None
        finally:
            stream.cancel()

    def peer_ticket(self, device=""):
        """A ticket that lets a remote peer connect to this session on
        `device`'s peer path (a name from Client.devices(); "": mrd's first
        device): a PeerTicket with `ticket`, `peer_address` and `device`. A
        peer uses it with the registrations' tokens of that device. MrdError
        INVALID_ARGUMENT UNKNOWN_DEVICE for a device mrd does not serve."""
        return self._call("CreatePeerTicket",
                          mrd_pb2.CreatePeerTicketRequest(device=device))

    # The directory on etcd (docs/DIRECTORY.md): needs mrd's
    # --etcd_endpoints; without it these raise MrdError FAILED_PRECONDITION
    # reason DIRECTORY_OFF (list_published reports directory_state "off").

    def publish(self, name, registration=None, mr=None):
        """Publish: makes a Registration (or a registration id) the session
        holds findable under `name` (1 to 128 characters of [A-Za-z0-9._-])
        in its tenant's part of the directory; or, with `mr` (an MR object
        id) instead, the current mapping of a fast-register MR object.
        Returns the PublishedEntry at once; etcd is written in the
        background (list_published() says when), and the entry goes when
        the registration does (or the mapping: InvalidateMr). MrdError:
        BAD_PUBLISH_NAME, NOT_FOUND, NAME_TAKEN, DIRECTORY_FULL,
        MR_NOT_MAPPED."""
        if (registration is None) == (mr is None):
            raise ValueError("give exactly one of registration and mr")
        if mr is not None:
            return self._call("Publish", mrd_pb2.PublishRequest(
                name=name, mr=mr))
        registration_id = (registration.id
                           if isinstance(registration, Registration)
                           else registration)
        return self._call("Publish", mrd_pb2.PublishRequest(
            name=name, registration=registration_id))

    def unpublish(self, name):
        """Unpublish: removes a name the session published. True once etcd
        deleted it; False when it did not within mrd's
        --directory_unpublish_wait (the delete stays queued). MrdError
        NOT_FOUND NOT_PUBLISHED when the session has no such name."""
        return self._call("Unpublish",
                          mrd_pb2.UnpublishRequest(name=name)).deleted

    def list_published(self):
        """ListPublished: the ListPublishedResponse, with `entries` (the
        names the session published, each with its `state` on etcd:
        "pending", "published" or "conflict") and `directory_state` ("off",
        "connecting", "serving" or "unavailable")."""
        return self._call("ListPublished", mrd_pb2.ListPublishedRequest())

    def resolve(self, name, tenant=""):
        """Resolve: looks `name` up on etcd, as published by any node's mrd,
        in `tenant`'s names (default: the session's tenant). The
        PublishedEntry: node, address, length, flags, tokens (per device its
        rkey and peer_address), epoch. MrdError NOT_FOUND NAME_NOT_PUBLISHED,
        UNAVAILABLE ETCD_UNAVAILABLE."""
        return self._call("Resolve",
                          mrd_pb2.ResolveRequest(name=name, tenant=tenant))

    def watch_name(self, name, tenant=""):
        """WatchName: follows `name` as resolve() finds it, without polling.
        A NameWatch: iterating it yields NameEvent messages, first the
        name's state now (kind PUBLISHED with the entry, or UNPUBLISHED),
        then each change, waiting for them as long as it takes (no
        deadline). The iteration stops after cancel() (callable from any
        thread) or when mrd ends the stream cleanly; otherwise it raises
        MrdError: resolve()'s errors, RESOURCE_EXHAUSTED WATCH_LIMIT, or
        UNAVAILABLE when mrd stops or hands over (watch again). Leaving it
        as a context manager cancels it."""
        return NameWatch(self.client._stub.WatchName(
            mrd_pb2.ResolveRequest(session=self.token, name=name,
                                   tenant=tenant)))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class NameWatch:
    """One WatchName stream (Session.watch_name): an iterator of NameEvent
    messages that ends after cancel(), and a context manager that cancels
    on exit."""

    def __init__(self, call):
        self._call = call
        self._cancelled = False

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._call)
        except grpc.RpcError as e:
            if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise errors.from_rpc_error(e) from None

    def cancel(self):
        """Ends the stream: a __next__ waiting now, or called later, stops
        the iteration. Idempotent."""
        self._cancelled = True
        self._call.cancel()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cancel()


class FdSession(Session):
    """A session on the fd socket: memfds go to mrd over it, and everything
    the session holds is released when it closes (or this process dies)."""

    def __init__(self, client):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.settimeout(client.timeout)
            self._sock.connect(client.fd_socket_path)
            welcome = self._reply(0)
        except OSError as e:
            self._sock.close()
            raise MrdError(grpc.StatusCode.UNAVAILABLE,
                           "fd socket %s: %s" % (client.fd_socket_path, e),
                           reason="FD_SOCKET_UNAVAILABLE") from None
        except MrdError:
            self._sock.close()
            raise
        super().__init__(client, welcome.welcome.session)
        self._sequence = 0

    def import_memfd(self, fd, writable=True, expected_size=0):
        """Hands `fd` (a memfd sealed against shrinking) to mrd: BufferInfo."""
        self._sequence += 1
        request = fd_pb2.FdRequest(
            sequence=self._sequence,
            import_memfd=fd_pb2.ImportMemfd(writable=writable,
                                            expected_size=expected_size))
        self._sock.sendmsg([request.SerializeToString()], [(
            socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        return self._reply(self._sequence).buffer

    def create_buffer(self, size, name="mrd-buffer", writable=True,
                      huge_pages=False):
        """A new memfd of `size` bytes, sealed, mapped here and imported: a
        MemfdBuffer whose `memory` this process reads and writes. With
        `huge_pages` the memfd is on hugetlbfs (2 MiB pages from
        vm.nr_hugepages; `size` a multiple of 2 MiB)."""
        return MemfdBuffer(self, size, name, writable, huge_pages)

    def close(self):
        """CloseSession (mrd releases everything the session holds before
        it answers), then the socket closes. When mrd is gone or cannot
        answer, the socket's hang-up ends the session on mrd's own time."""
        if self._sock.fileno() < 0:
            return
        if self.token and _peer_still_there(self._sock):
            try:
                self.client.call("CloseSession",
                                 mrd_pb2.CloseSessionRequest(session=self.token))
            except (MrdError, ValueError):  # ValueError: the channel closed
                pass
        self._sock.close()

    def _reply(self, sequence):
        data = self._sock.recv(FD_MAX_REPLY_BYTES)
        if not data:
            raise MrdError(grpc.StatusCode.UNAVAILABLE,
                           "mrd closed the fd socket",
                           reason="FD_SOCKET_CLOSED")
        reply = fd_pb2.FdReply()
        reply.ParseFromString(data)
        if reply.HasField("error"):
            raise errors.from_fd_error(reply.error)
        if sequence and reply.sequence != sequence:
            raise MrdError(grpc.StatusCode.INTERNAL,
                           "reply %d to request %d" % (reply.sequence,
                                                       sequence))
        return reply


class LeaseSession(Session):
    """A lease session: closed (CloseSession) on exit."""

    def close(self):
        if self.token:
            token, self.token = self.token, ""
            self.client.call("CloseSession",
                             mrd_pb2.CloseSessionRequest(session=token))


class Buffer:
    """An imported buffer (BufferInfo in `info`); released on exit."""

    def __init__(self, session, info):
        self.session = session
        self.info = info
        self.id = info.buffer
        self.size = info.size
        self.address = info.address

    def release(self):
        """ReleaseBuffer: invalidates its registrations, releases its LAMs."""
        if self.id:
            buffer_id, self.id = self.id, 0
            return self.session._call("ReleaseBuffer",
                                      mrd_pb2.ReleaseBufferRequest(
                                          buffer=buffer_id))
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


# The page size of huge-page buffers (create_buffer(huge_pages=True)).
HUGE_PAGE_SIZE = 2 << 20


class MemfdBuffer(Buffer):
    """A memfd made here (memfd_create, F_SEAL_SHRINK|F_SEAL_GROW), mapped
    here (`memory`, an mmap) and imported into an fd session."""

    def __init__(self, session, size, name, writable, huge_pages=False):
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        if huge_pages:
            if size % HUGE_PAGE_SIZE:
                raise ValueError("a huge-page buffer's size must be a multiple "
                                 f"of 2 MiB; {size} is not")
            flags |= os.MFD_HUGETLB | os.MFD_HUGE_2MB
        fd = os.memfd_create(name, flags)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, _F_ADD_SEALS, _F_SEAL_SHRINK | _F_SEAL_GROW)
            self.memory = mmap.mmap(fd, size)
            info = session.import_memfd(fd, writable=writable,
                                        expected_size=size)
        finally:
            os.close(fd)
        super().__init__(session, info)

    def release(self):
        result = super().release()
        if not self.memory.closed:
            self.memory.close()
        return result


class Registration:
    """A reference on a registration (W5: registering the same range again
    takes another reference on the same one). `rkey`, `base_address`,
    `references`, `cache_hit`, `rdma_descriptor`, and `tokens`: one
    DeviceToken (device, rkey, lkey, peer_address) per device it is on, in
    mrd's order (`rkey` and `lkey` are the first's). Deregistered on exit."""

    def __init__(self, session, reply):
        self.session = session
        self.reply = reply
        self.id = reply.registration
        self.rkey = reply.rkey
        self.lkey = reply.lkey
        self.base_address = reply.base_address
        self.length = reply.length
        self.references = reply.references
        self.cache_hit = reply.cache_hit
        self.rdma_descriptor = reply.rdma_descriptor
        self.tokens = list(reply.tokens)

    def token(self, device):
        """The DeviceToken of `device` (its name); KeyError if the
        registration is not on it."""
        for token in self.tokens:
            if token.device == device:
                return token
        raise KeyError("registration %d is not on device %r (it is on %s)" % (
            self.reply.registration, device,
            ", ".join(t.device for t in self.tokens)))

    def deregister(self):
        """Gives this reference back: the references left (0: released, the
        token dead before this returns)."""
        if not self.id:
            return None
        registration, self.id = self.id, 0
        return self.session._call("DeregisterMr", mrd_pb2.DeregisterMrRequest(
            registration=registration)).references

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.deregister()


class Lam:
    """A logical address mapping (BuildLam): `pages`, `fbo`, `lam_size`,
    `device` (the device it is mapped on). Released (ReleaseLam) on exit."""

    def __init__(self, session, reply):
        self.session = session
        self.id = reply.lam
        self.pages = list(reply.pages)
        self.fbo = reply.fbo
        self.length = reply.length
        self.lam_size = reply.lam_size
        self.device = reply.device

    def release(self):
        if self.id:
            lam, self.id = self.id, 0
            self.session._call("ReleaseLam", mrd_pb2.ReleaseLamRequest(
                lam=lam))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class Mr:
    """An MR object (CreateMr): `id`, `info` (the MrInfo), `device` (the
    device it belongs to); closed (CloseMr) on exit."""

    def __init__(self, session, info):
        self.session = session
        self.info = info
        self.id = info.mr
        self.device = info.device

    def close(self):
        if self.id:
            mr, self.id = self.id, 0
            self.session._call("CloseMr", mrd_pb2.CloseMrRequest(mr=mr))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
