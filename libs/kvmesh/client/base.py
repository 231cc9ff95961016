"""What the sync and async clients share: settings, call metadata, and finding a running stack."""

from __future__ import annotations

import os
from typing import Any, Self

from kvmesh import state
from kvmesh.client.retry_policy import CallPolicy


class ClientBase:
    """Settings of a client: ``target`` (host:port of the router's gRPC API), ``api_key``, the default
    deadline ``timeout_s`` of each call (None = none), and the UNAVAILABLE retry budget."""

    def __init__(self, target: str, api_key: str | None = None, timeout_s: float | None = 60,
                 retries: int = 3, backoff_s: float = 0.2) -> None:
        if retries < 0 or backoff_s < 0:
            raise ValueError("retries and backoff_s must be >= 0")
        self.target = target
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    @classmethod
    def from_state_dir(cls, state_dir: str | os.PathLike[str] | None = None, **kw: Any) -> Self:
        """A client for the stack that ``kvmesh up`` started (state dir rule of ``kvmesh.state``); raises
        FileNotFoundError, saying how to start one, when there is none."""
        return cls(state.StackInfo.read(state.state_dir(state_dir)).router_grpc, **kw)

    def _channel_options(self) -> list[tuple[str, int]]:
        # Reconnect as fast as we retry: grpc's default first reconnect backoff (1 s) would fail our early
        # retries at once while the channel still waits to reconnect.
        ms = max(int(self.backoff_s * 1000), 50)
        return [("grpc.initial_reconnect_backoff_ms", ms), ("grpc.max_reconnect_backoff_ms", max(ms, 5000))]

    def _policy(self, timeout_s: float | None) -> CallPolicy:
        return CallPolicy(self.timeout_s if timeout_s is None else timeout_s, self.retries, self.backoff_s,
                          self._metadata)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.target!r})"
