"""The router's MatchPrefix against a real cachesvc whose index holds nothing yet (a fresh cluster): one call a
request, answered as no match and not as a failure. An index with no holders sends no names (it has none), and
the router used to read that as "the names are missing", asked again, and marked the request's
``cachesvc.match_prefix`` span an error: two calls and an error on every request until some KV was indexed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kvmesh.telemetry import tracing
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from .test_router_bad_input import TinyMesh, tiny_model_dir


@pytest.fixture(scope="module")
def mesh(nats_server, tmp_path_factory) -> Iterator[TinyMesh]:
    model: Path = tiny_model_dir(tmp_path_factory.mktemp("model"))
    with TinyMesh(nats_server.url, model, cachesvc=True, roles=()) as m:
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
    stub = mesh.router.shards.stubs[0]
    real, calls = stub.MatchPrefix, []

    def counted(request, **kw):
        calls.append(request.holders_epoch)
        return real(request, **kw)

    stub.MatchPrefix = counted
    try:
        for _ in range(3):
            assert mesh.call(mesh.router.matched_blocks([11, 12, 13])) == {}
    finally:
        stub.MatchPrefix = real
    assert calls == [0, 0, 0]  # one call a request (it was two: the second asking for names again)
    matched = [s for s in spans.get_finished_spans() if s.name == "cachesvc.match_prefix"]
    assert len(matched) == 3 and all(s.status.status_code is not StatusCode.ERROR for s in matched)
