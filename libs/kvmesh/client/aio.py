"""The asyncio client: ``AsyncKvmeshClient`` over a grpc.aio channel."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, Self, Unpack

import grpc
import grpc.aio

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


class AsyncGenerateStream(AsyncIterator[GenerateChunk]):
    """The chunks of one ``Generate`` call as an async iterator; same contract as the sync ``GenerateStream``
    (retries on the next router, resumes after the tokens delivered). Use ``async with`` (or ``aclose()``) to
    cancel a stream left before its end."""

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

    async def _run(self) -> AsyncGenerator[GenerateChunk, None]:
        delivered: list[int] = []
        request_id = self._request.request_id
        while not self._cancelled:
            request = resumed(self._request, request_id, delivered) if delivered else self._request
            call = self._call = self._start(request, self._policy.attempt_timeout(), self._policy.metadata)
            try:
                async for msg in call:
                    chunk = GenerateChunk.from_pb(msg)
                    request_id = chunk.request_id or request_id
                    delivered += chunk.token_ids
                    yield chunk
                self.trailing_metadata = metadata_dict(await call.trailing_metadata())
                return
            except asyncio.CancelledError:
                if self._cancelled:                     # our cancel(), not the task's
                    return
                raise
            except grpc.RpcError as e:
                if self._cancelled and e.code() is grpc.StatusCode.CANCELLED:
                    return
                delay = self._policy.retry_delay(e)
                if delay is None:
                    raise self._policy.error(e) from None
                self._failover()
            finally:
                call.cancel()                           # no-op once the call has ended
            await asyncio.sleep(delay)

    async def __anext__(self) -> GenerateChunk:
        return await self._chunks.__anext__()

    def cancel(self) -> None:
        """Stop the call; iteration then ends."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()
        await self._chunks.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncKvmeshClient(ClientBase):
    """Asyncio client of the ``kvmesh.v1.Kvmesh`` API; same methods, deadlines, retries and errors as
    ``KvmeshClient``. Create it inside the event loop that uses it."""

    def __init__(self, target: str | Sequence[str], api_key: str | None = None, timeout_s: float | None = 60,
                 retries: int = 3, backoff_s: float = 0.2) -> None:
        super().__init__(target, api_key, timeout_s, retries, backoff_s)
        # TLS when KVMESH_TLS_CA is set; a channel per router (each connects on first use)
        self._channels = [tls.aio_channel(t, self._channel_options()) for t in self.targets]
        self._stubs = [api_pb2_grpc.KvmeshStub(ch) for ch in self._channels]

    @property
    def _stub(self) -> api_pb2_grpc.KvmeshStub:
        return self._stubs[self._current]

    def generate(self, prompt: str | Sequence[int] | None = None, *,
                 messages: Sequence[Message] | None = None, timeout_s: float | None = None,
                 **options: Unpack[ChatOptions]) -> AsyncGenerateStream:
        """Stream one completion of ``prompt`` (text or token ids) or of chat ``messages``: ``async for``."""
        request = generate_request(prompt, messages, **options)
        return AsyncGenerateStream(lambda req, timeout, md: self._stub.Generate(req, timeout=timeout, metadata=md),
                                   request, self._policy(timeout_s), self._failover)

    async def complete(self, prompt: str | Sequence[int] | None = None, *,
                       messages: Sequence[Message] | None = None, timeout_s: float | None = None,
                       **options: Unpack[ChatOptions]) -> Completion:
        builder = CompletionBuilder()
        async with self.generate(prompt, messages=messages, timeout_s=timeout_s, **options) as stream:
            async for chunk in stream:
                builder.add(chunk)
        return builder.build(stream.trailing_metadata)

    async def chat(self, messages: Sequence[Message], *, timeout_s: float | None = None,
                   **options: Unpack[ChatOptions]) -> Completion:
        policy = self._policy(timeout_s)
        request = chat_request(messages, **options)
        start = time.perf_counter()
        response, trailing = await self._unary(self._stub.Chat, request, policy)
        return completion_from_chat(response, trailing, time.perf_counter() - start)

    async def list_models(self, timeout_s: float | None = None) -> list[ModelInfo]:
        response, _ = await self._unary(self._stub.ListModels, api_pb2.ListModelsRequest(),
                                        self._policy(timeout_s))
        return models_from_pb(response)

    async def close_session(self, session_id: str, timeout_s: float | None = None) -> None:
        """Session ``session_id`` (the caller's tenant's) is over: every cache lets its KV go first."""
        await self._unary(self._stub.CloseSession, api_pb2.CloseSessionRequest(session_id=session_id),
                          self._policy(timeout_s))

    async def health(self, timeout_s: float | None = None) -> HealthInfo:
        response, _ = await self._unary(self._stub.Health, api_pb2.HealthRequest(), self._policy(timeout_s))
        return HealthInfo.from_pb(response)

    async def _unary(self, rpc: Any, request: object, policy: CallPolicy) -> tuple[Any, dict[str, str]]:
        while True:
            try:
                call = rpc(request, timeout=policy.attempt_timeout(), metadata=policy.metadata)
                return await call, metadata_dict(await call.trailing_metadata())
            except grpc.RpcError as e:
                delay = policy.retry_delay(e)
                if delay is None:
                    raise policy.error(e) from None
                self._failover()
            await asyncio.sleep(delay)

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
