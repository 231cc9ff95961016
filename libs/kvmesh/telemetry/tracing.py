"""Tracing in one service process: the tracer provider and its exporters, W3C trace context in and out.

Instrumentation passes parents explicitly (``start(name, parent)``, ``grpc_metadata(span)``) instead of
relying on the current-span context variable: most of the request path is async generators, and a generator
must not hold a current span across ``yield``. Without ``setup`` (tests, tracing off) every span is a no-op,
yet an incoming trace context still passes through to the next hop.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvmesh.settings import TelemetrySettings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# Attribute names every kvmesh span may carry.
REQUEST_ID, MODEL, TENANT = "kvmesh.request_id", "kvmesh.model", "kvmesh.tenant"
DISPATCH_ID = "kvmesh.dispatch_id"  # the id the instances know a request by (the router's, unique per dispatch)
# Set to False on a span that is not a TTFT segment: one that waits for others (their spans explain its time)
# or that runs after the first token. The waterfall never attributes TTFT to such a span.
SEGMENT = "kvmesh.segment"
# Set to True on a span that runs alongside a sibling doing the real work (a KV push overlapping the prefill
# compute): while both are active the sibling gets the time; the span only where it runs on alone.
BACKGROUND = "kvmesh.background"
SENT_HEADER = "kvmesh-sent-ns"  # NATS header: publish time (epoch ns), for publish → receive spans

_propagator = TraceContextTextMapPropagator()
_tracer = trace.get_tracer("kvmesh")
_provider: Any = None
Parent = Span | Context | None


def setup(service: str, instance: str = "", cfg: TelemetrySettings | None = None) -> bool:
    """Install the SDK tracer provider of this process: the JSONL exporter when ``cfg.trace_file`` is set,
    OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) is. Returns whether spans are
    recorded."""
    global _provider
    cfg = cfg or TelemetrySettings()
    if not cfg.tracing:
        log.info("tracing off")
        return False
    exporters: list[tuple[Any, float | None]] = []
    if cfg.trace_file:
        from kvmesh.telemetry.jsonl import JsonlSpanExporter

        exporters.append((JsonlSpanExporter(cfg.trace_file), float(cfg.trace_flush_ms)))
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        exporters.append((_otlp_exporter(), None))
    if not exporters:
        log.info("tracing: no exporter configured (set KVMESH_TELEMETRY_TRACE_FILE or OTEL_EXPORTER_OTLP_ENDPOINT)")
        return False
    _provider = make_provider(service, instance, cfg.trace_sample_ratio, exporters)
    trace.set_tracer_provider(_provider)
    log.info("tracing to %s", ", ".join(type(e).__name__ + (f" {cfg.trace_file}" if d is not None else "")
                                        for e, d in exporters))
    return True


def make_provider(service: str, instance: str, sample_ratio: float,
                  exporters: Iterable[tuple[Any, float | None]]) -> Any:
    """A tracer provider (not installed globally) exporting through ``(exporter, flush_ms)`` pairs."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create({"service.name": service, "service.namespace": "kvmesh",
                                "service.instance.id": instance or service})
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
    for exporter, flush_ms in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=flush_ms))
    return provider


def _otlp_exporter() -> SpanExporter:
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"))
    if protocol.startswith("http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

        return HTTPExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GRPCExporter

    return GRPCExporter()


def shutdown() -> None:
    """Export what is buffered and stop the exporters (call once, when the service stops)."""
    if _provider is not None:
        _provider.shutdown()


def tracer() -> trace.Tracer:
    return _tracer


# ---- spans -------------------------------------------------------------------------------------------------

def context_of(parent: Parent) -> Context | None:
    return trace.set_span_in_context(parent) if isinstance(parent, Span) else parent


def start(name: str, parent: Parent, kind: SpanKind = SpanKind.INTERNAL,
          attributes: Mapping[str, Any] | None = None, start_ns: int | None = None,
          tracer_: trace.Tracer | None = None) -> Span:
    """A span under ``parent`` (a span, a context, or None for a new trace); end it yourself."""
    return (tracer_ or _tracer).start_span(name, context_of(parent), kind, attributes, start_time=start_ns)


def record(name: str, parent: Parent, start_ns: int, end_ns: int, attributes: Mapping[str, Any] | None = None,
           kind: SpanKind = SpanKind.INTERNAL, tracer_: trace.Tracer | None = None) -> Span:
    """A finished span from timestamps taken elsewhere (the engine thread, another process)."""
    span = start(name, parent, kind, attributes, start_ns, tracer_)
    span.end(max(end_ns, start_ns))
    return span


def mono_ns(t: float) -> int:
    """Epoch nanoseconds of a ``time.monotonic()`` reading (span timestamps are wall-clock)."""
    return time.time_ns() - time.monotonic_ns() + int(t * 1e9)


def traceparent(span: Span) -> str:
    """The W3C ``traceparent`` naming ``span`` ('' when it has no valid context)."""
    sc = span.get_span_context()
    if not sc.is_valid:
        return ""
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def trace_id(span: Span) -> str:
    sc = span.get_span_context()
    return f"{sc.trace_id:032x}" if sc.is_valid else ""


# ---- propagation -------------------------------------------------------------------------------------------

def inject(parent: Parent = None, carrier: dict[str, str] | None = None) -> dict[str, str]:
    """``carrier`` (a new dict by default) plus the W3C headers of ``parent`` (default: the current span)."""
    carrier = {} if carrier is None else carrier
    _propagator.inject(carrier, context=context_of(parent))
    return carrier


def extract(carrier: Mapping[str, str] | None) -> Context | None:
    """The remote parent named by W3C headers in ``carrier``, or None when there is none (a new trace)."""
    if not carrier or TRACEPARENT not in carrier:
        return None
    ctx = _propagator.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def grpc_metadata(parent: Parent) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying ``parent``'s trace context."""
    return tuple(inject(parent).items())


# a request's id, model and tenant travel as gRPC metadata so downstream services can label their spans
_SAFE = "".join(c for c in map(chr, range(0x20, 0x7F)) if c != "%")
REQUEST_METADATA = {"kvmesh.request_id": "x-request-id", "kvmesh.model": "x-kvmesh-model",
                    "kvmesh.tenant": "x-kvmesh-tenant"}


def request_metadata(attrs: Mapping[str, Any] | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying a request's id, model and tenant (from span attributes), percent-encoded: a
    metadata value must be printable ASCII, and a tenant's cache salt need not be."""
    return tuple((key, quote(str(attrs[name]), safe=_SAFE)) for name, key in REQUEST_METADATA.items()
                 if attrs and name in attrs)


def request_attributes(context: Any) -> dict[str, str]:
    """The inverse of ``request_metadata`` on the serving side (a ``grpc.aio.ServicerContext``)."""
    return attributes_of(dict(context.invocation_metadata() or ()))


def attributes_of(metadata: Mapping[str, str]) -> dict[str, str]:
    """``request_attributes`` of metadata carried some other way (a batched call's entry)."""
    return {name: unquote(metadata[key]) for name, key in REQUEST_METADATA.items() if key in metadata}


def from_grpc(context: Any) -> Context | None:
    """The remote parent sent in a gRPC call's metadata (a ``grpc.aio.ServicerContext``)."""
    md = context.invocation_metadata() or ()
    return extract({k: v for k, v in md if k in (TRACEPARENT, TRACESTATE)})


# ---- attributes --------------------------------------------------------------------------------------------

ITL_BOUNDS_MS = (5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000)
MAX_RAW_ITL = 256


def itl_attributes(seconds: list[float]) -> dict[str, Any]:
    """Inter-token latencies of one stream as span attributes (one span per stream, never one per token):
    count, mean, p50/p90/p99/max, a histogram (``kvmesh.itl_ms.buckets[i]`` counts ITLs <= bounds[i], the last
    bucket those above), and the raw values in ms when there are at most 256 of them."""
    if not seconds:
        return {"kvmesh.itl.count": 0}
    ms = sorted(x * 1e3 for x in seconds)
    n = len(ms)

    def q(p: float) -> float:
        return round(ms[min(n - 1, int(p * n))], 3)

    buckets = [0] * (len(ITL_BOUNDS_MS) + 1)
    for x in ms:
        buckets[next((i for i, b in enumerate(ITL_BOUNDS_MS) if x <= b), len(ITL_BOUNDS_MS))] += 1
    out: dict[str, Any] = {"kvmesh.itl.count": n, "kvmesh.itl_ms.mean": round(sum(ms) / n, 3),
                           "kvmesh.itl_ms.p50": q(0.5), "kvmesh.itl_ms.p90": q(0.9),
                           "kvmesh.itl_ms.p99": q(0.99), "kvmesh.itl_ms.max": round(ms[-1], 3),
                           "kvmesh.itl_ms.bounds": list(ITL_BOUNDS_MS), "kvmesh.itl_ms.buckets": buckets}
    if n <= MAX_RAW_ITL:
        out["kvmesh.itl_ms"] = [round(x * 1e3, 3) for x in seconds]
    return out
