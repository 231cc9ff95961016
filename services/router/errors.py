"""The router's error kinds: each one's HTTP status, gRPC code and OpenAI error type, in one table.

Everything the router refuses or fails raises ``RequestError(kind, message)``; the APIs only look the kind up
here. ``python -m services.router.errors`` prints the table the router's README lists (a test keeps them equal).
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

import grpc


class ErrorKind(StrEnum):
    INVALID = "invalid"
    UNAUTHENTICATED = "unauthenticated"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    TOO_LARGE = "too_large"
    OVERLOADED = "overloaded"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"
    CANCELLED = "cancelled"

    @property
    def http(self) -> int:
        return STATUS[self].http

    @property
    def grpc(self) -> grpc.StatusCode:
        return STATUS[self].grpc

    @property
    def error_type(self) -> str:
        """The ``type`` of OpenAI's error body."""
        return STATUS[self].error_type


class Status(NamedTuple):
    http: int
    grpc: grpc.StatusCode
    error_type: str
    when: str  # the README's line


STATUS: dict[ErrorKind, Status] = {
    ErrorKind.INVALID: Status(400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error",
                              "the request is malformed or asks for what the model cannot serve"),
    ErrorKind.UNAUTHENTICATED: Status(401, grpc.StatusCode.UNAUTHENTICATED, "authentication_error",
                                      "keys are on and none of them was sent (an admin operation: not the "
                                      "admin key)"),
    ErrorKind.FORBIDDEN: Status(403, grpc.StatusCode.PERMISSION_DENIED, "permission_error",
                                "an admin operation while no `admin_key` is configured; a runtime LoRA load "
                                "while no `lora_root` is"),
    ErrorKind.NOT_FOUND: Status(404, grpc.StatusCode.NOT_FOUND, "not_found_error",
                                "the model or LoRA adapter named is not served here"),
    ErrorKind.TOO_LARGE: Status(413, grpc.StatusCode.RESOURCE_EXHAUSTED, "invalid_request_error",
                                "the body (gRPC: request message) is over `max_body_bytes`"),
    ErrorKind.OVERLOADED: Status(429, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limit_error",
                                 "over `max_concurrent_requests` / `max_requests_per_tenant`, or no instance "
                                 "meets the request's TTFT target / `slo_ttft_s` (with `Retry-After: 1`)"),
    ErrorKind.UNAVAILABLE: Status(503, grpc.StatusCode.UNAVAILABLE, "service_unavailable",
                                  "no engine instance can serve the request, or the one serving it failed"),
    ErrorKind.INTERNAL: Status(500, grpc.StatusCode.INTERNAL, "internal_error",
                               "a fault of the router's own or of an engine (logged with the request and trace "
                               "id)"),
    ErrorKind.CANCELLED: Status(499, grpc.StatusCode.CANCELLED, "cancelled",
                                "the client went away (counted in metrics; no answer is sent)"),
}


class RequestError(Exception):
    """A request the router refuses or could not serve: ``kind`` says which status answers it, ``message``
    what to change. ``instance``: the engine instance that failed; ``retryable``: it could not be reached, so
    another one may serve the request."""

    def __init__(self, kind: ErrorKind, message: str, instance: str = "", retryable: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.instance = instance
        self.retryable = retryable


def invalid(message: str) -> RequestError:
    """The commonest error: the request is the caller's to fix (400 / INVALID_ARGUMENT)."""
    return RequestError(ErrorKind.INVALID, message)


def table() -> str:
    """The README's table of error kinds (markdown)."""
    rows = ["| kind | HTTP | gRPC | OpenAI `type` | when |", "|---|---|---|---|---|"]
    rows += [f"| `{k}` | {s.http} | `{s.grpc.name}` | `{s.error_type}` | {s.when} |" for k, s in STATUS.items()]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
