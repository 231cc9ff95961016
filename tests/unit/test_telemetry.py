"""Tracing plumbing: the JSONL exporter, W3C propagation (gRPC metadata, NATS headers), engine timestamps."""

from __future__ import annotations

import asyncio
import json
from typing import ClassVar

import pytest
from kvmesh.bus.trace_headers import extract_trace_headers, inject_trace_headers, trace_context
from kvmesh.telemetry import tracing
from kvmesh.telemetry.jsonl import JsonlSpanExporter
from kvmesh.telemetry.spans import read_spans
from opentelemetry import trace
from opentelemetry.trace import SpanKind

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def provider(tmp_path):
    """A tracer provider writing to a JSONL file (not installed globally)."""
    path = tmp_path / "spans.jsonl"
    p = tracing.make_provider("router", "router-1", 1.0, [(JsonlSpanExporter(path), 10.0)])
    p.path = path
    yield p
    p.shutdown()


def flushed(provider):
    provider.force_flush()
    return read_spans(provider.path)


def test_exported_spans_keep_names_parents_attributes_events_and_service(provider):
    t = provider.get_tracer("test")
    root = tracing.start("router.request", None, SpanKind.SERVER, {"kvmesh.request_id": "r1"}, tracer_=t)
    tracing.record("router.tokenize", root, 1_000, 2_000, {"kvmesh.tokens.prompt": 7}, tracer_=t)
    root.add_event("first_token", {"k": 1})
    root.end()
    spans = {s.name: s for s in flushed(provider)}
    assert set(spans) == {"router.request", "router.tokenize"}
    child, parent = spans["router.tokenize"], spans["router.request"]
    assert child.parent_id == parent.span_id and child.trace_id == parent.trace_id
    assert parent.parent_id is None
    assert (child.start_ns, child.end_ns, child.attributes) == (1_000, 2_000, {"kvmesh.tokens.prompt": 7})
    assert parent.service == "router" and parent.instance == "router-1" and parent.kind == "SERVER"
    assert parent.request_id == "r1" and parent.event_ns("first_token") is not None


def test_each_export_appends_whole_lines(provider, tmp_path):
    t = provider.get_tracer("test")
    for i in range(3):
        tracing.start(f"s{i}", None, tracer_=t).end()
        provider.force_flush()
    lines = provider.path.read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(line)["name"].startswith("s") for line in lines)


def test_a_line_being_written_is_skipped_by_the_reader(tmp_path):
    path = tmp_path / "t.jsonl"
    good = {"trace_id": "a" * 32, "span_id": "b" * 16, "parent_id": None, "name": "x", "service": "router",
            "start_ns": 1, "end_ns": 2}
    path.write_text(json.dumps(good) + "\n" + '{"trace_id": "a", "spa')
    assert [s.name for s in read_spans(path)] == ["x"]


def test_grpc_metadata_carries_the_span_and_the_server_side_continues_it(provider):
    t = provider.get_tracer("test")
    client = tracing.start("router.dispatch", None, SpanKind.CLIENT, tracer_=t)
    md = tracing.grpc_metadata(client)
    assert dict(md)["traceparent"] == tracing.traceparent(client)

    class Ctx:
        def invocation_metadata(self):
            return (("authorization", "x"), *md)

    server = tracing.start("prefill.request", tracing.from_grpc(Ctx()), SpanKind.SERVER, tracer_=t)
    assert server.get_span_context().trace_id == client.get_span_context().trace_id
    assert server.parent.span_id == client.get_span_context().span_id


def test_a_callers_traceparent_becomes_the_parent_and_none_starts_a_new_trace(provider):
    t = provider.get_tracer("test")
    span = tracing.start("router.request", tracing.extract({"traceparent": TP}), tracer_=t)
    assert f"{span.get_span_context().trace_id:032x}" == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert f"{span.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert tracing.extract({}) is None and tracing.extract({"traceparent": "garbage"}) is None


def test_nats_headers_carry_the_current_span_and_keep_what_the_caller_set(provider):
    t = provider.get_tracer("test")
    assert inject_trace_headers({"a": "1"}) == {"a": "1"}  # no span current: nothing added
    span = tracing.start("prefill.request", None, tracer_=t)
    with trace.use_span(span):
        headers = inject_trace_headers({"a": "1"})
        assert headers["traceparent"] == tracing.traceparent(span) and headers["a"] == "1"
        assert inject_trace_headers({"traceparent": TP})["traceparent"] == TP
    ctx = trace_context(headers)
    assert trace.get_current_span(ctx).get_span_context().span_id == span.get_span_context().span_id
    assert trace_context({}) is None


def test_delivered_headers_are_a_copy_of_what_was_sent():
    class Msg:
        headers: ClassVar[dict[str, str]] = {"traceparent": TP, "x": "y"}

    got = extract_trace_headers(Msg())
    assert got == Msg.headers and got is not Msg.headers


def test_without_setup_spans_are_noops_but_an_incoming_context_passes_through():
    span = tracing.start("decode.request", tracing.extract({"traceparent": TP}))
    assert not span.is_recording()
    assert tracing.inject(span)["traceparent"].split("-")[1] == "4bf92f3577b34da6a3ce929d0e0e4736"


def test_itl_attributes_summarise_the_stream_without_a_span_per_token():
    a = tracing.itl_attributes([0.010, 0.020, 0.030, 0.040, 1.5])
    assert a["kvmesh.itl.count"] == 5 and a["kvmesh.itl_ms.max"] == 1500.0
    assert a["kvmesh.itl_ms.p50"] == 30.0 and a["kvmesh.itl_ms.mean"] == pytest.approx(320.0)
    assert sum(a["kvmesh.itl_ms.buckets"]) == 5 and a["kvmesh.itl_ms.buckets"][-1] == 1  # 1.5 s > last bound
    assert a["kvmesh.itl_ms"] == [10.0, 20.0, 30.0, 40.0, 1500.0]
    assert "kvmesh.itl_ms" not in tracing.itl_attributes([0.01] * (tracing.MAX_RAW_ITL + 1))
    assert tracing.itl_attributes([]) == {"kvmesh.itl.count": 0}


def test_monotonic_readings_map_to_wall_clock_nanoseconds():
    import time

    m, w = time.monotonic(), time.time_ns()
    assert abs(tracing.mono_ns(m) - w) < 5_000_000


def test_engine_timing_orders_submit_start_add_schedule_and_first_output(tiny_config):
    from kvmesh.contracts.engine import EngineRequest, RequestTiming
    from kvmesh.contracts.sampling import SamplingParams
    from kvmesh.engine.async_engine import AsyncEngine
    from kvmesh.engine.llm_engine import LLMEngine
    from kvmesh.settings import EngineSettings

    async def run() -> RequestTiming:
        engine = AsyncEngine(LLMEngine(EngineSettings(num_blocks=32, block_size=4), model_config=tiny_config),
                             asyncio.get_running_loop())
        timing = RequestTiming()
        try:
            params = SamplingParams(max_tokens=3)
            async for _ in engine.generate(EngineRequest("r", tuple(range(1, 20)), params), timing):
                pass
        finally:
            await engine.close()
        return timing

    t = asyncio.run(run())
    assert 0 < t.submitted <= t.started <= t.added <= t.scheduled <= t.first_output
    assert t.preemptions == 0


def test_worker_metrics_expose_engine_queues_tiers_and_counters_over_http(tiny_config):
    import urllib.request

    from kvmesh.engine.async_engine import AsyncEngine
    from kvmesh.engine.llm_engine import LLMEngine
    from kvmesh.instance.metrics import WorkerMetrics, fallback_reason
    from kvmesh.settings import EngineSettings
    from kvmesh.telemetry.metrics import MetricsServer

    async def run() -> str:
        engine = AsyncEngine(LLMEngine(EngineSettings(num_blocks=32, block_size=4), model_config=tiny_config),
                             asyncio.get_running_loop())
        metrics = WorkerMetrics()
        metrics.watch(engine)
        metrics.transfer_bytes.labels("push").inc(4096)
        metrics.fallbacks.labels(fallback_reason("kv.ready not received within 10s")).inc()
        metrics.prefix.observe(100, 25)
        for n in (7, 64, 256, 64, 256, 128, 32, 512):  # forward steps of 0.02 s + n / 500 s
            engine.pacer.speed_fit.observe(n, 0.02 + n / 500)
        engine.step_totals.add(True, 8, 0.05, 0.04)
        engine.step_totals.add(False, 3, 0.25, 0.125)
        server = MetricsServer(metrics.registry, "127.0.0.1", 0)
        try:
            loop = asyncio.get_running_loop()
            with await loop.run_in_executor(None, urllib.request.urlopen, server.url) as r:
                return r.read().decode()
        finally:
            server.close()
            await engine.close()

    text = asyncio.run(run())
    assert 'kvmesh_worker_kv_blocks{state="capacity",tier="device"} 32.0' in text
    assert 'kvmesh_worker_queue_depth{state="waiting"} 0.0' in text
    assert 'kvmesh_worker_kv_evictions_total{tier="device"} 0.0' in text
    assert 'kvmesh_worker_kv_transfer_bytes_total{direction="push"} 4096.0' in text
    assert 'kvmesh_worker_kv_fallbacks_total{reason="timeout"} 1.0' in text
    assert "kvmesh_worker_prefix_hit_ratio 0.25" in text
    assert "kvmesh_worker_ttft_seconds_bucket" in text and "_created" not in text
    assert "kvmesh_worker_kv_block_bytes " in text
    assert 'kvmesh_worker_engine_steps_total{kind="decode"} 1.0' in text
    assert 'kvmesh_worker_engine_step_rows_total{kind="decode"} 8.0' in text
    assert 'kvmesh_worker_engine_step_seconds_total{kind="prefill"} 0.25' in text
    assert 'kvmesh_worker_engine_step_cpu_seconds_total{kind="prefill"} 0.125' in text
    speed = next(float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith("kvmesh_worker_prefill_tokens_per_second "))
    assert 450 < speed < 550
