"""A scripted, in-process stand-in for the router's ``kvmesh.v1.Kvmesh`` service, used by the client tests
(no tests here). It runs a grpc.aio server on 127.0.0.1 in a background thread, so sync clients can call it
from the test thread and async clients from their own ``asyncio.run`` loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import grpc.aio
from kvmesh.proto.v1 import api_pb2, api_pb2_grpc, common_pb2

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRAILING = {"x-request-id": "req-from-trailer", "traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}


def prompt_words(request: api_pb2.GenerateRequest | api_pb2.ChatRequest) -> list[str]:
    """The fake's "tokens" of a prompt: its words (chat: every message's content, in order)."""
    if isinstance(request, api_pb2.ChatRequest):
        return " ".join(m.content for m in request.messages).split()
    if request.WhichOneof("prompt") == "messages":
        return " ".join(m.content for m in request.messages.messages).split()
    if request.WhichOneof("prompt") == "token_ids":
        return [str(t) for t in request.token_ids.ids]
    return request.text.split()


@dataclass
class FakeKvmesh(api_pb2_grpc.KvmeshServicer):
    """Answers every prompt with ``reply``, one word per chunk, then a finished chunk with usage; trailing
    metadata ``trailing``. ``cached_tokens`` is the prompt's common word prefix with the previous request's
    prompt and reply (what a real stack's KV reuse would report). Knobs script failures."""

    reply: str = "Hello there, friend."
    trailing: dict[str, str] = field(default_factory=lambda: dict(TRAILING))
    fail_before_first: list[grpc.StatusCode] = field(default_factory=list)  # next calls abort with these
    fail_after_first: grpc.StatusCode | None = None       # abort every Generate after its first chunk
    cut_after_first: int = 0                              # the next N Generate calls: UNAVAILABLE after one chunk
    assign_id: str = ""                                   # the request id chunks carry when the request has none
    delay_s: float = 0.0                                  # wait before the first chunk
    chunk_delay_s: float = 0.001                          # wait after each chunk
    detail: str = "scripted failure"
    prompt_scores: int = 0                                # prompt logprobs (20 alternatives each) on the answer
    requests: list[api_pb2.GenerateRequest | api_pb2.ChatRequest] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    cancelled: int = 0                                    # Generate calls cancelled by the client
    _kv: list[str] = field(default_factory=list)

    def _accept(self, request, context: grpc.aio.ServicerContext) -> tuple[int, int]:
        self.requests.append(request)
        self.metadata.append({k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)})
        words = prompt_words(request)
        shared = min(len(words), len(self._kv))
        cached = next((i for i in range(shared) if words[i] != self._kv[i]), shared)
        self._kv = words + self.reply.split()
        return len(words), cached

    async def Generate(self, request, context) -> AsyncIterator[api_pb2.GenerateChunk]:
        prompt_tokens, cached = self._accept(request, context)
        try:
            await asyncio.sleep(self.delay_s)
            if self.fail_before_first:
                await context.abort(self.fail_before_first.pop(0), self.detail)
            words = self.reply.split()
            cut, self.cut_after_first = self.cut_after_first > 0, max(0, self.cut_after_first - 1)
            rid = request.request_id or self.assign_id
            for i, word in enumerate(words):
                if i < len(request.resume_token_ids):  # a resumed stream: these went out before the cut
                    continue
                yield api_pb2.GenerateChunk(request_id=rid, token_ids=[100 + i], text=word if i == 0 else " " + word,
                                            prompt_logprobs=self._scores() if i == 0 else ())
                if self.fail_after_first is not None:
                    await context.abort(self.fail_after_first, self.detail)
                if cut:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the router went away (scripted)")
                await asyncio.sleep(self.chunk_delay_s)
            context.set_trailing_metadata(tuple(self.trailing.items()))
            usage = common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=len(words),
                                     cached_tokens=cached)
            yield api_pb2.GenerateChunk(request_id=rid, finished=True, finish_reason="stop", usage=usage)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def Chat(self, request, context) -> api_pb2.ChatResponse:
        prompt_tokens, cached = self._accept(request, context)
        if self.fail_before_first:
            await context.abort(self.fail_before_first.pop(0), self.detail)
        context.set_trailing_metadata(tuple(self.trailing.items()))
        words = self.reply.split()
        usage = common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=len(words),
                                 cached_tokens=cached)
        return api_pb2.ChatResponse(request_id=request.request_id or "chat-1", text=self.reply,
                                    token_ids=[100 + i for i in range(len(words))], finish_reason="stop",
                                    usage=usage, prompt_logprobs=self._scores())

    def _scores(self) -> list[common_pb2.TokenLogprobs]:
        return [common_pb2.TokenLogprobs(token_id=40000 + i % 9000, logprob=-1.5, top_token_ids=range(40000, 40020),
                                         top_logprobs=[-0.1 * k for k in range(20)], rank=7)
                for i in range(self.prompt_scores)]

    async def ListModels(self, request, context) -> api_pb2.ListModelsResponse:
        model = api_pb2.Model(id="tiny", fingerprint="f00d", max_model_len=2048)
        return api_pb2.ListModelsResponse(models=[model])

    async def Health(self, request, context) -> api_pb2.HealthResponse:
        self.metadata.append({k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)})
        return api_pb2.HealthResponse(ok=True, instances=[
            api_pb2.Instance(instance_id="prefill-0", role="prefill", grpc_address="127.0.0.1:1", age_s=0.5,
                             load={"queue": 1.0}),
            api_pb2.Instance(instance_id="decode-0", role="decode", grpc_address="127.0.0.1:2", age_s=0.2)])


@contextmanager
def serve(fake: api_pb2_grpc.KvmeshServicer) -> Iterator[str]:
    """Run ``fake`` on 127.0.0.1 (a free port) in a background event loop; yields its ``host:port``."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers: list[grpc.aio.Server] = []

    async def start() -> int:
        server = grpc.aio.server()
        servers.append(server)
        api_pb2_grpc.add_KvmeshServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return port

    try:
        yield f"127.0.0.1:{asyncio.run_coroutine_threadsafe(start(), loop).result(10)}"
    finally:
        asyncio.run_coroutine_threadsafe(servers[0].stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
