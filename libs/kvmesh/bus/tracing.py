"""Trace context on NATS headers (W3C ``traceparent`` / ``tracestate``).

Pass-throughs for now: the bus calls ``inject_trace_headers`` on every publish and ``extract_trace_headers`` on
every delivery, so OpenTelemetry propagation plugs in here without touching the bus.
"""

from __future__ import annotations

from nats.aio.msg import Msg

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"


def inject_trace_headers(headers: dict[str, str] | None) -> dict[str, str]:
    """The headers to publish: a copy of ``headers`` (later: plus the current span's context)."""
    return dict(headers or {})


def extract_trace_headers(msg: Msg) -> dict[str, str]:
    """The headers a handler sees: a copy of the message's headers, trace context included as sent."""
    return dict(msg.headers or {})
