"""Trace context across a real nats-server: a publish made under a span reaches the handler as its parent, and
``kv.ready`` from a prefill worker becomes decode's publish → receive span."""

from __future__ import annotations

import asyncio
import uuid

from kvmesh.bus import Bus, Subjects
from kvmesh.bus.trace_headers import trace_context
from kvmesh.contracts.messages import KVReady
from kvmesh.telemetry import tracing
from kvmesh.telemetry.jsonl import JsonlSpanExporter
from kvmesh.telemetry.spans import read_spans
from opentelemetry import trace


def test_a_publish_under_a_span_parents_the_receivers_span(nats_server, tmp_path):
    path = tmp_path / "spans.jsonl"
    provider = tracing.make_provider("prefill", "prefill-0", 1.0, [(JsonlSpanExporter(path), 10.0)])
    tracer = provider.get_tracer("test")
    subjects = Subjects(f"t{uuid.uuid4().hex[:10]}")
    ready = KVReady(request_id="r1", decode_instance="d0", transfer_id="t", block_keys=(), num_tokens=3,
                    first_token=1, layout=None, prefill_instance="p0")

    async def body() -> None:
        bus = await Bus.connect(nats_server.url, "test")
        got: asyncio.Queue = asyncio.Queue()

        async def on_ready(msg, headers):
            received = tracing.record("kv.ready", trace_context(headers), int(headers[tracing.SENT_HEADER]),
                                      int(headers[tracing.SENT_HEADER]) + 1, tracer_=tracer)
            await got.put(received)

        await bus.subscribe(subjects.kv_ready("d0"), on_ready)
        sender = tracing.start("prefill.request", None, tracer_=tracer)
        with trace.use_span(sender):  # the bus injects the current span's context
            await bus.publish(subjects.kv_ready("d0"), ready, {tracing.SENT_HEADER: "1000"})
        # outside any span: the receiver starts a new trace
        await bus.publish(subjects.kv_ready("d0"), ready, {tracing.SENT_HEADER: "2000"})
        first, second = await asyncio.wait_for(got.get(), 5), await asyncio.wait_for(got.get(), 5)
        sender.end()
        assert first.parent.span_id == sender.get_span_context().span_id
        assert first.get_span_context().trace_id == sender.get_span_context().trace_id
        assert second.parent is None
        await bus.close()

    asyncio.run(asyncio.wait_for(body(), 20))
    provider.force_flush()
    spans = {s.name: s for s in read_spans(path) if s.start_ns == 1000}
    assert spans["kv.ready"].parent_id is not None and spans["kv.ready"].end_ns == 1001
    provider.shutdown()
