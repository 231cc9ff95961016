"""``services.router.match_batch``: a turn's MatchPrefix questions to one shard in one call, against a real gRPC
server in this process whose CacheService answers each question with its first key (so an answer shows whose it
is), with or without ``MatchPrefixBatch``, or failing it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from kvmesh.proto.v1 import cache_pb2

from services.router import match_batch
from services.router.match_batch import MatchBatcher

SERVICE = "kvmesh.v1.CacheService"


class Shard:
    """``batch``: "ok" answers MatchPrefixBatch, "absent" has no such method (a cachesvc that predates it),
    "fail" aborts it UNAVAILABLE."""

    def __init__(self, batch: str = "ok") -> None:
        self.batch = batch
        self.singles: list[tuple[int, dict[str, str]]] = []  # (first key, metadata) of each MatchPrefix
        self.batches: list[list[tuple[int, dict[str, str]]]] = []  # (first key, entry metadata) of each batch

    @staticmethod
    def answer(request: cache_pb2.MatchPrefixRequest) -> cache_pb2.MatchPrefixResponse:
        return cache_pb2.MatchPrefixResponse(holders_epoch=request.block_keys[0])

    async def match(self, request: cache_pb2.MatchPrefixRequest, context: Any) -> cache_pb2.MatchPrefixResponse:
        self.singles.append((request.block_keys[0], dict(context.invocation_metadata() or ())))
        return self.answer(request)

    async def match_batch(self, request: cache_pb2.MatchPrefixBatchRequest,
                          context: Any) -> cache_pb2.MatchPrefixBatchResponse:
        self.batches.append([(q.block_keys[0], dict(q.metadata)) for q in request.requests])
        if self.batch == "fail":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "shard down")
        return cache_pb2.MatchPrefixBatchResponse(responses=[self.answer(q) for q in request.requests])

    def handlers(self) -> grpc.GenericRpcHandler:
        def unary(fn: Callable[..., Awaitable[Any]], message: Any, reply: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(fn, request_deserializer=message.FromString,
                                                       response_serializer=reply.SerializeToString)
        methods = {"MatchPrefix": unary(self.match, cache_pb2.MatchPrefixRequest, cache_pb2.MatchPrefixResponse)}
        if self.batch != "absent":
            methods["MatchPrefixBatch"] = unary(self.match_batch, cache_pb2.MatchPrefixBatchRequest,
                                                cache_pb2.MatchPrefixBatchResponse)
        return grpc.method_handlers_generic_handler(SERVICE, methods)


def with_shard(shard: Shard, body: Callable[[MatchBatcher], Awaitable[None]]) -> None:
    async def run() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((shard.handlers(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await asyncio.wait_for(body(MatchBatcher(channel, timeout_s=10.0)), 30)
        finally:
            await server.stop(None)

    asyncio.run(run())


def question(first: int) -> cache_pb2.MatchPrefixRequest:
    return cache_pb2.MatchPrefixRequest(block_keys=[first, 7, 8], packed=True)


async def ask_together(batcher: MatchBatcher, firsts: list[int]) -> list[int]:
    """Ask a question per first key in one turn of the event loop; each answer's first key."""
    answers = await asyncio.gather(*(batcher.ask(question(k), (("x-request-id", f"r{k}"),)) for k in firsts))
    return [a.holders_epoch for a in answers]


def test_a_turn_s_questions_go_in_one_call_each_with_its_answer_and_metadata():
    shard = Shard()

    async def body(batcher: MatchBatcher) -> None:
        assert await ask_together(batcher, [5, 3, 9, 1]) == [5, 3, 9, 1]
        assert shard.batches == [[(k, {"x-request-id": f"r{k}"}) for k in (5, 3, 9, 1)]]
        assert shard.singles == []
        assert await ask_together(batcher, [4]) == [4]  # alone in its turn: a plain MatchPrefix
        assert [(k, md["x-request-id"]) for k, md in shard.singles] == [(4, "r4")]
        assert (batcher.calls, batcher.questions, len(shard.batches)) == (2, 5, 1)

    with_shard(shard, body)


def test_a_shard_without_the_batch_is_asked_one_prompt_a_call_from_then_on(caplog):
    shard = Shard("absent")

    async def body(batcher: MatchBatcher) -> None:
        assert await ask_together(batcher, [1, 2, 3]) == [1, 2, 3]  # the failed batch's questions, asked again
        assert not batcher.batched
        assert await ask_together(batcher, [4, 5]) == [4, 5]
        # each asked once, alone; the calls of one turn run at once, so the shard may see them in any order
        assert sorted(k for k, _ in shard.singles) == [1, 2, 3, 4, 5]
        assert all(md["x-request-id"] == f"r{k}" for k, md in shard.singles)
        assert batcher.calls == 1 + 5  # one batch tried, never again

    with caplog.at_level("INFO", "router"):
        with_shard(shard, body)
    assert sum("predates MatchPrefixBatch" in r.message for r in caplog.records) == 1


def test_a_failed_batch_fails_each_of_its_questions_with_the_call_s_status():
    shard = Shard("fail")

    async def body(batcher: MatchBatcher) -> None:
        got = await asyncio.gather(*(batcher.ask(question(k), ()) for k in (1, 2, 3)), return_exceptions=True)
        assert all(isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAVAILABLE
                   and e.details() == "shard down" for e in got), got
        assert batcher.batched  # a failure is not an old shard: the next turn batches again
        shard.batch = "ok"
        assert await ask_together(batcher, [6, 7]) == [6, 7]
        assert len(shard.batches) == 2

    with_shard(shard, body)


def test_a_question_whose_request_went_away_leaves_the_others_their_answers():
    shard = Shard()

    async def body(batcher: MatchBatcher) -> None:
        tasks = [asyncio.ensure_future(batcher.ask(question(k), ())) for k in (1, 2, 3)]
        await asyncio.sleep(0)  # each has asked: the batch goes out with all three
        tasks[1].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert [d.holders_epoch if isinstance(d, cache_pb2.MatchPrefixResponse) else type(d) for d in done] == \
            [1, asyncio.CancelledError, 3]
        assert [k for k, _ in shard.batches[0]] == [1, 2, 3]

    with_shard(shard, body)


@pytest.mark.parametrize("extra", [1, 5])
def test_a_turn_with_more_questions_than_a_batch_holds_sends_several_calls(extra):
    shard = Shard()
    n = match_batch.MAX_BATCH + extra

    async def body(batcher: MatchBatcher) -> None:
        assert await ask_together(batcher, list(range(1, n + 1))) == list(range(1, n + 1))
        assert sorted(len(b) for b in shard.batches) == sorted([match_batch.MAX_BATCH] + ([extra] if extra > 1 else []))
        assert len(shard.singles) == (1 if extra == 1 else 0)  # a lone remainder goes as a plain call

    with_shard(shard, body)
