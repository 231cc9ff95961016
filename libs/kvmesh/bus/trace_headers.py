"""Trace context on NATS headers (W3C ``traceparent`` / ``tracestate``).

The bus calls ``inject_trace_headers`` on every publish and ``extract_trace_headers`` on every delivery. A
publish made while a span is current carries that span's context; a handler turns the headers it is given back
into a parent with ``trace_context``. Messages published outside any span (heartbeats) carry no trace headers.
"""

from __future__ import annotations

from nats.aio.msg import Msg
from opentelemetry.context import Context

from kvmesh.telemetry import tracing

TRACEPARENT = tracing.TRACEPARENT
TRACESTATE = tracing.TRACESTATE


def inject_trace_headers(headers: dict[str, str] | None) -> dict[str, str]:
    """The headers to publish: a copy of ``headers`` plus the current span's trace context, if there is one.
    A ``traceparent`` already in ``headers`` (the caller chose the parent) is kept."""
    out = dict(headers or {})
    if TRACEPARENT not in out:
        tracing.inject(None, out)
    return out


def extract_trace_headers(msg: Msg) -> dict[str, str]:
    """The headers a handler sees: a copy of the message's headers, trace context included as sent."""
    return dict(msg.headers or {})


def trace_context(headers: dict[str, str] | None) -> Context | None:
    """The sender's span as a remote parent, or None when the message carried no trace context."""
    return tracing.extract(headers)
