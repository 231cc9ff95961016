"""MatchPrefix calls to one cachesvc shard, gathered per turn of the router's event loop.

Under load several requests reach their MatchPrefix in the same turn of the event loop (~4 a turn at 600 requests
a second in ``kvmesh bench routers``), and a gRPC call costs the router ~0.1 ms of CPU however small its message:
so the questions of one turn go out as one ``MatchPrefixBatch`` call and each caller gets its own answer, as a call
of its own would have given it. A turn with a single question sends a plain ``MatchPrefix``, so a router that is
not busy waits for nothing and calls as before.

Each question keeps its trace: the metadata a call of its own would carry (the W3C context of the request's
``cachesvc.match_prefix`` span, its id, model and tenant) travels in the batch entry, and cachesvc records the
entry's server span under it. A cachesvc that predates the batch answers UNIMPLEMENTED: the questions of that
call are asked again one by one, and so is every later one to that shard. A batch that fails otherwise fails each
of its questions with the call's error, as the shard's own failure would have.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc
from kvmesh.proto.raw import delimited_head
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc

log = logging.getLogger("router")

BATCH_METHOD = "/kvmesh.v1.CacheService/MatchPrefixBatch"
MAX_BATCH = 64  # questions in one call (cachesvc takes up to 256); more in a turn go out as several calls

Metadata = Sequence[tuple[str, str]]
_Question = tuple[cache_pb2.MatchPrefixRequest, Metadata, "asyncio.Future[cache_pb2.MatchPrefixResponse]"]


class MatchBatcher:
    """One shard's MatchPrefix questions, batched per turn of the event loop (see the module). One event loop."""

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float, name: str = "cachesvc") -> None:
        self._match = cache_pb2_grpc.CacheServiceStub(channel).MatchPrefix
        # the batch's entries are serialized one by one and joined (see _send): the request goes as bytes
        self._batch = channel.unary_unary(BATCH_METHOD, request_serializer=None,
                                          response_deserializer=cache_pb2.MatchPrefixBatchResponse.FromString)
        self.timeout_s = timeout_s
        self.name = name
        self.batched = True   # False once the shard answered UNIMPLEMENTED: it predates MatchPrefixBatch
        self.calls = 0        # calls made, either kind
        self.questions = 0    # questions asked
        self._waiting: list[_Question] = []
        self._sending: set[asyncio.Task[None]] = set()

    async def ask(self, request: cache_pb2.MatchPrefixRequest, metadata: Metadata) -> cache_pb2.MatchPrefixResponse:
        """``request``'s answer, as a MatchPrefix call with ``metadata`` gives it (its ``AioRpcError`` when the
        call, or the batch it went in, failed)."""
        self.questions += 1
        if not self.batched:
            return await self._single(request, metadata)
        future: asyncio.Future[cache_pb2.MatchPrefixResponse] = asyncio.get_running_loop().create_future()
        if not self._waiting:
            asyncio.get_running_loop().call_soon(self._flush)
        self._waiting.append((request, metadata, future))
        return await future

    def _flush(self) -> None:
        waiting, self._waiting = self._waiting, []
        for lo in range(0, len(waiting), MAX_BATCH):
            task = asyncio.ensure_future(self._send(waiting[lo:lo + MAX_BATCH]))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, questions: list[_Question]) -> None:
        if len(questions) == 1 or not self.batched:
            await asyncio.gather(*(self._answer_alone(q) for q in questions))
            return
        self.calls += 1
        try:
            reply = await self._batch(_batch_bytes(questions), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                if self.batched:
                    self.batched = False
                    log.info("%s predates MatchPrefixBatch: asking it one prompt a call", self.name)
                await asyncio.gather(*(self._answer_alone(q) for q in questions))
            else:
                _fail(questions, e)
            return
        except Exception as e:  # noqa: BLE001 - handed to each question, as its own call would have raised it
            _fail(questions, e)
            return
        except asyncio.CancelledError:  # the router stops: nobody waits for this call
            for _, _, future in questions:
                future.cancel()
            raise
        if len(reply.responses) != len(questions):
            _fail(questions, grpc.aio.AioRpcError(
                grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                f"{self.name} answered {len(reply.responses)} of a MatchPrefixBatch of {len(questions)}"))
            return
        for (_, _, future), answer in zip(questions, reply.responses, strict=True):
            if not future.done():  # its request went away meanwhile
                future.set_result(answer)

    async def _answer_alone(self, question: _Question) -> None:
        request, metadata, future = question
        try:
            answer = await self._single(request, metadata)
        except Exception as e:  # noqa: BLE001 - handed to the question's caller
            _fail([question], e)
            return
        except asyncio.CancelledError:
            future.cancel()
            raise
        if not future.done():
            future.set_result(answer)

    async def _single(self, request: cache_pb2.MatchPrefixRequest,
                      metadata: Metadata) -> cache_pb2.MatchPrefixResponse:
        self.calls += 1
        return await self._match(request, timeout=self.timeout_s, metadata=tuple(metadata))


def _fail(questions: list[_Question], error: Exception) -> None:
    for _, _, future in questions:
        if not future.done():  # its request went away meanwhile
            future.set_exception(error)


def _batch_bytes(questions: list[_Question]) -> bytes:
    """The serialized ``MatchPrefixBatchRequest`` of ``questions``, each with its metadata: its entries
    serialized and joined as field 1 (a repeated message is its entries back to back, each tagged and
    length-prefixed), which costs a quarter of copying the entries into a batch message and serializing that."""
    parts: list[bytes] = []
    for request, metadata, _ in questions:
        request.metadata.update(metadata)
        entry = request.SerializeToString()
        parts += (delimited_head(1, len(entry)), entry)
    return b"".join(parts)

