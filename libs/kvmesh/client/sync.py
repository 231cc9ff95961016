"""The blocking client: ``KvmeshClient`` over a grpc channel."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, Self, TypeVar, Unpack

import grpc

from kvmesh import tls
from kvmesh.client.base import ClientBase, resumed
from kvmesh.client.requests import ChatOptions, Message, chat_request, generate_request
from kvmesh.client.retry_policy import CallPolicy, StartGenerate
from kvmesh.client.types import (
    Completion,
    CompletionBuilder,
    GenerateChunk,
    HealthInfo,
    ModelInfo,
    completion_from_chat,
    metadata_dict,
    models_from_pb,
)
from kvmesh.proto.v1 import api_pb2, api_pb2_grpc

R = TypeVar("R")


class GenerateStream(Iterator[GenerateChunk]):
    """The chunks of one ``Generate`` call, which starts at the first ``next()``. A failure with UNAVAILABLE is
    retried (on the next router, when the client has several); after tokens were delivered, as a resume that
    sends them back, so the stream goes on after them and no token is ever delivered twice. ``cancel()`` (or
    leaving ``with``) stops the call; ``trailing_metadata`` is set once the stream ended."""

    def __init__(self, start: StartGenerate, request: api_pb2.GenerateRequest, policy: CallPolicy,
                 failover: Callable[[], None]) -> None:
        self._start = start
        self._request = request
        self._policy = policy
        self._failover = failover
        self._call: Any = None
        self._cancelled = False
        self._chunks = self._run()
        self.trailing_metadata: dict[str, str] = {}

    def _run(self) -> Generator[GenerateChunk, None, None]:
        delivered: list[int] = []
        request_id = self._request.request_id
        while not self._cancelled:
            request = resumed(self._request, request_id, delivered) if delivered else self._request
            call = self._call = self._start(request, self._policy.attempt_timeout(), self._policy.metadata)
            try:
                for msg in call:
                    chunk = GenerateChunk.from_pb(msg)
                    request_id = chunk.request_id or request_id
                    delivered += chunk.token_ids
                    yield chunk
                self.trailing_metadata = metadata_dict(call.trailing_metadata())
                return
            except grpc.RpcError as e:
                if self._cancelled and e.code() is grpc.StatusCode.CANCELLED:
                    return
                delay = self._policy.retry_delay(e)
                if delay is None:
                    raise self._policy.error(e) from None
                self._failover()
            finally:
                call.cancel()                           # no-op once the call has ended
            time.sleep(delay)

    def __next__(self) -> GenerateChunk:
        return next(self._chunks)

    def cancel(self) -> None:
        """Stop the call; iteration then ends. Safe from another thread and after the end."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class KvmeshClient(ClientBase):
    """Blocking client of the ``kvmesh.v1.Kvmesh`` API. Every call runs under a deadline (its ``timeout_s``,
    else the client's; None = none) and is retried after UNAVAILABLE up to ``retries`` times with exponential
    backoff. ``api_key`` is sent as ``authorization: Bearer <key>``. Failures raise ``KvmeshError``s."""

    def __init__(self, target: str | Sequence[str], api_key: str | None = None, timeout_s: float | None = 60,
                 retries: int = 3, backoff_s: float = 0.2) -> None:
        super().__init__(target, api_key, timeout_s, retries, backoff_s)
        # TLS when KVMESH_TLS_CA is set; a channel per router (each connects on first use)
        self._channels = [tls.channel(t, self._channel_options()) for t in self.targets]
        self._stubs = [api_pb2_grpc.KvmeshStub(ch) for ch in self._channels]

    @property
    def _stub(self) -> api_pb2_grpc.KvmeshStub:
        return self._stubs[self._current]

    def generate(self, prompt: str | Sequence[int] | None = None, *,
                 messages: Sequence[Message] | None = None, timeout_s: float | None = None,
                 **options: Unpack[ChatOptions]) -> GenerateStream:
        """Stream one completion of ``prompt`` (text or token ids) or of chat ``messages``."""
        request = generate_request(prompt, messages, **options)
        return GenerateStream(lambda req, timeout, md: self._stub.Generate(req, timeout=timeout, metadata=md),
                              request, self._policy(timeout_s), self._failover)

    def complete(self, prompt: str | Sequence[int] | None = None, *,
                 messages: Sequence[Message] | None = None, timeout_s: float | None = None,
                 **options: Unpack[ChatOptions]) -> Completion:
        """``generate``, collected into one ``Completion`` with client-side TTFT and ITLs."""
        builder = CompletionBuilder()
        with self.generate(prompt, messages=messages, timeout_s=timeout_s, **options) as stream:
            for chunk in stream:
                builder.add(chunk)
        return builder.build(stream.trailing_metadata)

    def chat(self, messages: Sequence[Message], *, timeout_s: float | None = None,
             **options: Unpack[ChatOptions]) -> Completion:
        """One chat completion through the unary ``Chat`` RPC."""
        policy = self._policy(timeout_s)
        request = chat_request(messages, **options)
        start = time.perf_counter()
        response, call = self._unary(self._stub.Chat.with_call, request, policy)
        trailing = metadata_dict(call.trailing_metadata())
        return completion_from_chat(response, trailing, time.perf_counter() - start)

    def list_models(self, timeout_s: float | None = None) -> list[ModelInfo]:
        response, _ = self._unary(self._stub.ListModels.with_call, api_pb2.ListModelsRequest(),
                                  self._policy(timeout_s))
        return models_from_pb(response)

    def close_session(self, session_id: str, timeout_s: float | None = None) -> None:
        """Session ``session_id`` (the caller's tenant's) is over: every cache lets its KV go first."""
        self._unary(self._stub.CloseSession.with_call, api_pb2.CloseSessionRequest(session_id=session_id),
                    self._policy(timeout_s))

    def health(self, timeout_s: float | None = None) -> HealthInfo:
        response, _ = self._unary(self._stub.Health.with_call, api_pb2.HealthRequest(),
                                  self._policy(timeout_s))
        return HealthInfo.from_pb(response)

    def _unary(self, rpc: Callable[..., R], request: object, policy: CallPolicy) -> R:
        while True:
            try:
                return rpc(request, timeout=policy.attempt_timeout(), metadata=policy.metadata)
            except grpc.RpcError as e:
                delay = policy.retry_delay(e)
                if delay is None:
                    raise policy.error(e) from None
                self._failover()
            time.sleep(delay)

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
