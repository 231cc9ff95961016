"""Telemetry shared by every kvmesh service: OpenTelemetry tracing (W3C trace context over gRPC metadata and
NATS headers, OTLP and JSONL exporters), Prometheus metrics, and the span reader behind ``kvmesh trace``.

The reading side (``spans``, ``waterfall``, ``render``) does not import OpenTelemetry, so ``kvmesh trace``
stays fast and works where only the span file is.
"""
