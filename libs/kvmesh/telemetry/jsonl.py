"""The JSONL span exporter: one JSON object per finished span, appended to one file that every service of a
stack shares (``O_APPEND``, one ``write`` per batch, so lines of different processes never interleave)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """The JSON form of a span (the format ``kvmesh.telemetry.spans`` reads)."""
    ctx, parent = span.context, span.parent
    res = span.resource.attributes if span.resource is not None else {}
    return {
        "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name, "kind": span.kind.name,
        "service": res.get("service.name", ""), "instance": res.get("service.instance.id", ""),
        "start_ns": span.start_time, "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
                   for e in span.events],
        "links": [{"trace_id": f"{ln.context.trace_id:032x}", "span_id": f"{ln.context.span_id:016x}",
                   "attributes": dict(ln.attributes or {})} for ln in span.links],
        "status": span.status.status_code.name, "status_message": span.status.description or "",
    }


class JsonlSpanExporter(SpanExporter):
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_to_dict(s), separators=(",", ":"), default=str) + "\n" for s in spans)
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            try:
                os.write(self._fd, data.encode())
            except OSError:
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
