"""What the sync and async clients share: settings, call metadata, and finding a running stack."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Self

from kvmesh import state
from kvmesh.client.retry_policy import CallPolicy
from kvmesh.proto.v1 import api_pb2

MAX_ANSWER_BYTES = 64 * 2**20  # the largest answer message the SDK takes (the router's own limit from engines)


class ClientBase:
    """Settings of a client: ``target`` (host:port of the router's gRPC API, or a list of router replicas'),
    ``api_key``, the default deadline ``timeout_s`` of each call (None = none), and the UNAVAILABLE retry
    budget. With several routers a call goes to one of them; when it does not answer (UNAVAILABLE) the retry
    goes to the next one (failover), and a stream cut mid-way is resumed there with the token ids it delivered
    (``GenerateRequest.resume_token_ids``), so none is lost or repeated."""

    def __init__(self, target: str | Sequence[str], api_key: str | None = None, timeout_s: float | None = 60,
                 retries: int = 3, backoff_s: float = 0.2) -> None:
        if retries < 0 or backoff_s < 0:
            raise ValueError("retries and backoff_s must be >= 0")
        self.targets = [target] if isinstance(target, str) else list(target)
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"give the router's host:port, or a list of them, not {target!r}")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._current = 0

    @property
    def target(self) -> str:
        """The router address calls go to now."""
        return self.targets[self._current]

    def _failover(self) -> None:
        """The next router takes the calls (the current one did not answer)."""
        self._current = (self._current + 1) % len(self.targets)

    @classmethod
    def from_state_dir(cls, state_dir: str | os.PathLike[str] | None = None, **kw: Any) -> Self:
        """A client for the stack that ``kvmesh up`` started (state dir rule of ``kvmesh.state``): every router
        replica's address; raises FileNotFoundError, saying how to start one, when there is none."""
        return cls(state.StackInfo.read(state.state_dir(state_dir)).router_grpcs, **kw)

    def _channel_options(self) -> list[tuple[str, int]]:
        # Reconnect as fast as we retry: grpc's default first reconnect backoff (1 s) would fail our early
        # retries at once while the channel still waits to reconnect.
        ms = max(int(self.backoff_s * 1000), 50)
        return [("grpc.initial_reconnect_backoff_ms", ms), ("grpc.max_reconnect_backoff_ms", max(ms, 5000)),
                # gRPC's default 4 MiB would refuse an answer carrying a long prompt's logprobs (prompt_logprobs
                # 20: ~160 bytes a token, 4 MiB at ~26k tokens); the router takes as much from its engines
                ("grpc.max_receive_message_length", MAX_ANSWER_BYTES)]

    def _policy(self, timeout_s: float | None) -> CallPolicy:
        return CallPolicy(self.timeout_s if timeout_s is None else timeout_s, self.retries, self.backoff_s,
                          self._metadata)

    def __repr__(self) -> str:
        shown = self.targets[0] if len(self.targets) == 1 else self.targets
        return f"{type(self).__name__}({shown!r})"


def resumed(request: api_pb2.GenerateRequest, request_id: str,
            delivered: Sequence[int]) -> api_pb2.GenerateRequest:
    """``request`` again, to continue a stream that was cut after ``delivered`` tokens (under the id it had)."""
    again = api_pb2.GenerateRequest()
    again.CopyFrom(request)
    if request_id:
        again.request_id = request_id
    again.resume_token_ids[:] = delivered
    return again
