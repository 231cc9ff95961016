"""The blocking client: ``KvmeshClient`` over a grpc channel."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, Self, TypeVar, Unpack

import grpc

from kvmesh import tls
from kvmesh.client.base import ClientBase
from kvmesh.client.requests import Message, RequestOptions, chat_request, generate_request
from kvmesh.client.retry_policy import CallPolicy, StartCall
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
    """The chunks of one ``Generate`` call, which starts at the first ``next()``. A failure before the first
    chunk is retried (UNAVAILABLE only); after it, it is raised, so no token is ever delivered twice.
    ``cancel()`` (or leaving ``with``) stops the call; ``trailing_metadata`` is set once the stream ended."""

    def __init__(self, start: StartCall, policy: CallPolicy) -> None:
        self._start = start
        self._policy = policy
        self._call: Any = None
        self._cancelled = False
        self._chunks = self._run()
        self.trailing_metadata: dict[str, str] = {}

    def _run(self) -> Generator[GenerateChunk, None, None]:
        while not self._cancelled:
            call = self._call = self._start(self._policy.attempt_timeout(), self._policy.metadata)
            started = False
            try:
                for chunk in call:
                    started = True
                    yield GenerateChunk.from_pb(chunk)
                self.trailing_metadata = metadata_dict(call.trailing_metadata())
                return
            except grpc.RpcError as e:
                if self._cancelled and e.code() is grpc.StatusCode.CANCELLED:
                    return
                delay = None if started else self._policy.retry_delay(e)
                if delay is None:
                    raise self._policy.error(e) from None
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

    def __init__(self, target: str, api_key: str | None = None, timeout_s: float | None = 60,
                 retries: int = 3, backoff_s: float = 0.2) -> None:
        super().__init__(target, api_key, timeout_s, retries, backoff_s)
        self._channel = tls.channel(target, self._channel_options())  # TLS when KVMESH_TLS_CA is set
        self._stub = api_pb2_grpc.KvmeshStub(self._channel)

    def generate(self, prompt: str | Sequence[int] | None = None, *,
                 messages: Sequence[Message] | None = None, timeout_s: float | None = None,
                 **options: Unpack[RequestOptions]) -> GenerateStream:
        """Stream one completion of ``prompt`` (text or token ids) or of chat ``messages``."""
        policy = self._policy(timeout_s)
        request = generate_request(prompt, messages, **options)
        return GenerateStream(lambda timeout, md: self._stub.Generate(request, timeout=timeout, metadata=md),
                              policy)

    def complete(self, prompt: str | Sequence[int] | None = None, *,
                 messages: Sequence[Message] | None = None, timeout_s: float | None = None,
                 **options: Unpack[RequestOptions]) -> Completion:
        """``generate``, collected into one ``Completion`` with client-side TTFT and ITLs."""
        builder = CompletionBuilder()
        with self.generate(prompt, messages=messages, timeout_s=timeout_s, **options) as stream:
            for chunk in stream:
                builder.add(chunk)
        return builder.build(stream.trailing_metadata)

    def chat(self, messages: Sequence[Message], *, timeout_s: float | None = None,
             **options: Unpack[RequestOptions]) -> Completion:
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
            time.sleep(delay)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
