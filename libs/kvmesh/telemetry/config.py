"""Telemetry settings (``KVMESH_<FIELD>`` env vars or the ``[telemetry]`` TOML section); the OTLP exporter
reads the standard ``OTEL_EXPORTER_OTLP_*`` variables."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TelemetryConfig:
    tracing: bool = True               # off: no tracing SDK (no-op spans; trace context still passes through)
    trace_file: str = ""               # JSONL span file ("" = none); `kvmesh up`: <state dir>/traces.jsonl
    trace_sample_ratio: float = 1.0    # share of new traces recorded (a caller's sampled flag wins)
    trace_flush_ms: int = 200          # the JSONL exporter writes its batch at least this often

    def __post_init__(self) -> None:
        if not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ValueError(f"trace_sample_ratio must be in [0, 1], not {self.trace_sample_ratio}")
        if self.trace_flush_ms < 1:
            raise ValueError(f"trace_flush_ms must be >= 1, not {self.trace_flush_ms}")
