"""The deadline and retry budget of one client call, shared by the sync and async clients."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from kvmesh.client.errors import DeadlineExceeded, KvmeshError, from_rpc_error
from kvmesh.proto.v1 import api_pb2

# (the request, timeout, metadata) -> a started Generate call, on the router the client uses now
StartGenerate = Callable[[api_pb2.GenerateRequest, float | None, Sequence[tuple[str, str]]], Any]


class CallPolicy:
    """One call's budget: a deadline for the whole call (every attempt and backoff included; None = no
    deadline) and up to ``retries`` retries after UNAVAILABLE, waiting ``backoff_s * 2**n`` (with jitter)
    before retry ``n``. A stream that already delivered tokens is retried as a resume (it sends them back, so
    the router streams only what follows them)."""

    def __init__(self, timeout_s: float | None, retries: int, backoff_s: float,
                 metadata: Sequence[tuple[str, str]]) -> None:
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.metadata = tuple(metadata)
        self.attempt = 0

    def attempt_timeout(self) -> float | None:
        """Seconds left for the next attempt (what grpc's ``timeout=`` takes)."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("DEADLINE_EXCEEDED", f"no answer within the {self.timeout_s:g}s deadline")
        return left

    def retry_delay(self, err: grpc.RpcError) -> float | None:
        """Seconds to wait before retrying after ``err``, or None when ``err`` is final."""
        if err.code() is not grpc.StatusCode.UNAVAILABLE or self.attempt >= self.retries:
            return None
        delay = self.backoff_s * 2 ** self.attempt * random.uniform(0.8, 1.2)
        if self.deadline is not None and time.monotonic() + delay >= self.deadline:
            return None
        self.attempt += 1
        return delay

    def error(self, err: grpc.RpcError) -> KvmeshError:
        return from_rpc_error(err, self.timeout_s)
