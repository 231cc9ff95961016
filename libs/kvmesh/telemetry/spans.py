"""Reading the JSONL span file: spans, traces, and one request's part of a trace. No OpenTelemetry import."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = "router.request"  # the router's span of one client request: TTFT is measured on it
FIRST_TOKEN = "first_token"  # the root's event at the moment the first token was sent to the client
TRACE_FILE = "traces.jsonl"  # its name in a stack's state directory


@dataclass(frozen=True)
class SpanRecord:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    kind: str = "INTERNAL"
    instance: str = ""
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    links: list[dict[str, Any]] = field(default_factory=list)
    status: str = "UNSET"
    status_message: str = ""

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def request_id(self) -> str:
        return str(self.attributes.get("kvmesh.request_id", ""))

    def event_ns(self, name: str) -> int | None:
        return next((int(e["time_ns"]) for e in self.events if e.get("name") == name), None)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpanRecord:
        return cls(trace_id=d["trace_id"], span_id=d["span_id"], parent_id=d.get("parent_id"), name=d["name"],
                   service=d.get("service", ""), start_ns=int(d["start_ns"]), end_ns=int(d["end_ns"]),
                   kind=d.get("kind", "INTERNAL"), instance=d.get("instance", ""),
                   attributes=d.get("attributes") or {}, events=d.get("events") or [],
                   links=d.get("links") or [], status=d.get("status", "UNSET"),
                   status_message=d.get("status_message", ""))


def trace_file(state_dir: str | os.PathLike) -> Path:
    return Path(state_dir) / TRACE_FILE


def read_spans(path: str | os.PathLike) -> list[SpanRecord]:
    """Every span in the file, in file order; a line that does not parse (one being written) is skipped."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                out.append(SpanRecord.from_dict(json.loads(line)))
            except (ValueError, KeyError, TypeError):
                continue
    return out


def by_trace(spans: list[SpanRecord]) -> dict[str, list[SpanRecord]]:
    traces: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        traces[s.trace_id].append(s)
    return traces


def roots(spans: list[SpanRecord]) -> list[SpanRecord]:
    """The router's request spans, oldest first."""
    return sorted((s for s in spans if s.name == ROOT), key=lambda s: s.start_ns)


def subtree(trace: list[SpanRecord], root: SpanRecord) -> list[SpanRecord]:
    """``root`` and its descendants (a caller's trace may hold several kvmesh requests), sorted by start."""
    children: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in trace:
        if s.parent_id:
            children[s.parent_id].append(s)
    out, todo = [], [root]
    while todo:
        s = todo.pop()
        out.append(s)
        todo.extend(children.get(s.span_id, ()))
    return sorted(out, key=lambda s: (s.start_ns, -s.end_ns))


def find(spans: list[SpanRecord], ident: str) -> tuple[SpanRecord | None, list[SpanRecord]]:
    """The request named by ``ident`` (a request id, a trace id, or a unique prefix of either): its root span
    (None when the trace has no router span) and its spans. ``(None, [])`` when nothing matches."""
    ident = ident.strip().lower()
    traces = by_trace(spans)
    for match in (lambda v: v == ident, lambda v: len(ident) >= 6 and v.startswith(ident)):
        hits = [r for r in roots(spans) if match(r.request_id.lower())]
        if hits:
            root = hits[-1]
            return root, subtree(traces[root.trace_id], root)
        ids = [t for t in traces if match(t)]
        if len(ids) == 1:
            trace = traces[ids[0]]
            trace_roots = roots(trace)
            if trace_roots:
                return trace_roots[-1], subtree(trace, trace_roots[-1])
            return None, sorted(trace, key=lambda s: s.start_ns)
    return None, []
