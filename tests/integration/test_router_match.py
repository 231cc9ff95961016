"""The router's MatchPrefix against a real cachesvc.

Whose index holds nothing yet (a fresh cluster): one call a request, answered as no match and not as a failure. An
index with no holders sends no names (it has none), and the router used to read that as "the names are missing",
asked again, and marked the request's ``cachesvc.match_prefix`` span an error: two calls and an error on every
request until some KV was indexed.

The prompts that reach their MatchPrefix in one turn of the event loop go out as one ``MatchPrefixBatch`` call,
each keeping its own answer and its own trace."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvmesh.bus import Bus, Subjects
from kvmesh.contracts.events import BlockStored
from kvmesh.contracts.messages import KVEventBatch
from kvmesh.telemetry import tracing
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from .test_router_bad_input import TinyMesh, tiny_model_dir


@pytest.fixture(scope="module")
def mesh(nats_server, tmp_path_factory) -> Iterator[TinyMesh]:
    model: Path = tiny_model_dir(tmp_path_factory.mktemp("model"))
    # instance_timeout_s: cachesvc keeps the blocks of an instance that never beats (the test's "x")
    with TinyMesh(nats_server.url, model, cachesvc=True, roles=(), pool={"instance_timeout_s": 60.0}) as m:
        yield m


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    before, tracing._tracer = tracing._tracer, provider.get_tracer("kvmesh")
    yield exporter
    tracing._tracer = before
    provider.shutdown()


def test_an_empty_index_is_asked_once_and_answers_no_match(mesh, spans):
    batcher = mesh.router.shards.batchers[0]
    before = batcher.calls
    for _ in range(3):
        assert mesh.call(mesh.router.matched_blocks([11, 12, 13])) == {}
    assert batcher.calls - before == 3  # one call a request (it was two: the second asking for names again)
    matched = [s for s in spans.get_finished_spans() if s.name == "cachesvc.match_prefix"]
    assert len(matched) == 3 and all(s.status.status_code is not StatusCode.ERROR for s in matched)


def test_the_prompts_of_one_turn_share_one_call_each_with_its_answer_and_trace(mesh, spans):
    keys = [101, 102, 103, 104]

    async def held_by_x() -> None:
        bus = await Bus.connect(mesh.shared.nats_url, "test-x")
        await bus.publish_event(Subjects(mesh.cluster).kv_events("x"), KVEventBatch("x", 1, time.time(), (
            BlockStored(block_keys=tuple(keys[:3]), parent_key=None, token_count=48, tier="device"),)))
        await bus.close()
        deadline = time.monotonic() + 20
        while await mesh.router.matched_blocks(keys) != {"x": 3}:
            assert time.monotonic() < deadline, "cachesvc never indexed x's blocks"
            await asyncio.sleep(0.05)

    mesh.call(held_by_x())
    batcher = mesh.router.shards.batchers[0]
    before = batcher.calls
    spans.clear()
    prompts = [keys, keys[:2], [9, 9], [101, 5], keys[:3]]

    async def one_turn() -> list[dict[str, int]]:
        return await asyncio.gather(*(mesh.router.matched_blocks(p, None, {"kvmesh.request_id": f"r{i}"})
                                      for i, p in enumerate(prompts)))

    assert mesh.call(one_turn()) == [{"x": 3}, {"x": 2}, {}, {"x": 1}, {"x": 3}]
    assert batcher.calls - before == 1
    finished = spans.get_finished_spans()
    client = {s.context.span_id: s for s in finished if s.name == "cachesvc.match_prefix"}
    server = [s for s in finished if s.name == "cachesvc.MatchPrefix"]
    assert len(client) == len(server) == len(prompts)
    assert {s.parent.span_id for s in server} == set(client)  # each under its own request's span
    assert sorted(s.attributes["kvmesh.request_id"] for s in server) == [f"r{i}" for i in range(len(prompts))]
    assert {s.attributes["kvmesh.batch"] for s in server} == {len(prompts)}
