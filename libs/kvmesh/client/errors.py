"""Client-side errors: every gRPC failure surfaces as a ``KvmeshError``; its subclass says what to do next."""

from __future__ import annotations

import grpc

from kvmesh.client.types import metadata_dict


class KvmeshError(Exception):
    """A failed call. ``code`` is the gRPC status name (``"INVALID_ARGUMENT"``), ``message`` the server's
    detail, ``request_id`` the router's id for the request when it sent one (trailing ``x-request-id``)."""

    def __init__(self, code: str, message: str, request_id: str = "") -> None:
        super().__init__(f"{code}: {message}" + (f" (request {request_id})" if request_id else ""))
        self.code = code
        self.message = message
        self.request_id = request_id


class InvalidRequest(KvmeshError):
    """The request itself is wrong (INVALID_ARGUMENT): change it, do not retry it."""


class Overloaded(KvmeshError):
    """Admission control rejected the request (RESOURCE_EXHAUSTED): no instance can meet the SLO right now."""


class Unavailable(KvmeshError):
    """The router (or the instance serving the request) could not be reached (UNAVAILABLE)."""


class DeadlineExceeded(KvmeshError):
    """The call did not finish within its deadline (DEADLINE_EXCEEDED)."""


class Unauthenticated(KvmeshError):
    """The API key is missing or wrong (UNAUTHENTICATED, PERMISSION_DENIED)."""


class Cancelled(KvmeshError):
    """The call was cancelled (CANCELLED)."""


_BY_CODE: dict[grpc.StatusCode, type[KvmeshError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: Unauthenticated,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def from_rpc_error(err: grpc.RpcError, timeout_s: float | None = None) -> KvmeshError:
    """The ``KvmeshError`` for a failed call; ``timeout_s`` is the deadline the call ran under, named in the
    message of a DEADLINE_EXCEEDED."""
    code: grpc.StatusCode = err.code()
    message = err.details() or code.name.lower().replace("_", " ")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED and timeout_s is not None:
        message = f"{message} (no answer within the {timeout_s:g}s deadline; pass a larger timeout_s)"
    trailing = metadata_dict(err.trailing_metadata())
    return _BY_CODE.get(code, KvmeshError)(code.name, message, trailing.get("x-request-id", ""))
