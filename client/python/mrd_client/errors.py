"""mrd's errors as one exception type carrying the gRPC code and the seed's
outcome (mrd.proto's error convention: trailing metadata mrd-error-bin,
mrd-seed-status, mrd-reason, mrd-required-size; the fd socket's FdError)."""

import grpc

from mrd.v1 import mrd_pb2

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class MrdError(Exception):
    """A refused or failed call.

    code: grpc.StatusCode; seed_status: the seed document's outcome name
    ("STATUS_BUFFER_TOO_SMALL", "SEED_STATUS_UNSPECIFIED" when none);
    reason: mrd's stable reason ("LAM_SPACE_TOO_SMALL"); required_size: the
    size the seed asks the caller to retry with (0 if none); message: text
    for humans.
    """

    def __init__(self, code, message, seed_status="SEED_STATUS_UNSPECIFIED",
                 reason="", required_size=0):
        self.code = code
        self.message = message
        self.seed_status = seed_status
        self.reason = reason
        self.required_size = required_size
        super().__init__("%s %s %s: %s" % (code.name, seed_status,
                                           reason or "-", message))


def _from_detail(code, message, detail):
    return MrdError(code, message,
                    seed_status=mrd_pb2.SeedStatus.Name(detail.seed_status),
                    reason=detail.reason, required_size=detail.required_size)


def from_rpc_error(error):
    """The MrdError of a grpc.RpcError (a finished call)."""
    code = error.code()
    message = error.details() or ""
    detail = mrd_pb2.ErrorDetail()
    trailers = {}
    for key, value in (error.trailing_metadata() or ()):
        trailers[key] = value
    if "mrd-error-bin" in trailers:
        detail.ParseFromString(trailers["mrd-error-bin"])
    if not detail.seed_status and "mrd-seed-status" in trailers:
        detail.seed_status = mrd_pb2.SeedStatus.Value(
            trailers["mrd-seed-status"])
    if not detail.reason:
        detail.reason = trailers.get("mrd-reason", "")
    if not detail.required_size and "mrd-required-size" in trailers:
        detail.required_size = int(trailers["mrd-required-size"])
    return _from_detail(code, message, detail)


def from_item_status(status):
    """None for an item of a batch that succeeded; its MrdError otherwise."""
    if status.code == 0:
        return None
    code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    return _from_detail(code, status.message, status.detail)


def from_fd_error(fd_error):
    """The MrdError of the fd socket's FdError."""
    code = _CODES.get(fd_error.code, grpc.StatusCode.UNKNOWN)
    return _from_detail(code, fd_error.message, fd_error.detail)
