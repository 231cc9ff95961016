"""TTFT as the sum of its segments.

TTFT is measured at the router: from the moment its ``router.request`` span starts (request received) to that
span's ``first_token`` event (first token sent). Every instant of that window is attributed to exactly one
span: among the spans active then that count as segments, the deepest in the tree (ties: one that is not
``kvmesh.background``, i.e. not running alongside the real work like a KV push overlapping its prefill, then
the one that started last). So the segments always add up to the TTFT; time no finer span explains lands on its parent's
own ("self") time, e.g. ``router.dispatch`` (self) is time in transit between services. A span that waits for
others (``kvmesh.segment = false``: decode's request span while it waits for ``kv.ready``,
``decode.generate``) never takes time from the spans it waits for.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from itertools import pairwise

from kvmesh.telemetry.spans import FIRST_TOKEN, ROOT, SpanRecord

SEGMENT_ATTR = "kvmesh.segment"
BACKGROUND_ATTR = "kvmesh.background"


@dataclass
class Segment:
    span: SpanRecord
    ttft_ns: int                        # the part of TTFT attributed to this span
    share: float                        # of TTFT
    first_ns: int                       # when its first attributed piece began
    has_children: bool = False          # some of its time went to finer spans: ttft_ns is its self time

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def label(self) -> str:
        return f"{self.name} (self)" if self.has_children else self.name


@dataclass
class Waterfall:
    root: SpanRecord | None
    spans: list[SpanRecord]             # the request's spans, by start
    t0_ns: int
    ttft_ns: int | None                 # None: no first token (failed request, or no router span)
    segments: list[Segment] = field(default_factory=list)   # by first attributed piece
    pieces: list[tuple[int, int, SpanRecord]] = field(default_factory=list)  # (start, end, span) over TTFT
    unattributed_ns: int = 0            # TTFT time no segment span covers (0 when the router span is there)

    @property
    def dominant(self) -> Segment | None:
        return max(self.segments, key=lambda s: s.ttft_ns, default=None)

    @property
    def attributed_ns(self) -> int:
        return sum(s.ttft_ns for s in self.segments)

    @property
    def end_ns(self) -> int:
        return max((s.end_ns for s in self.spans), default=self.t0_ns)

    def span(self, name: str) -> SpanRecord | None:
        return next((s for s in self.spans if s.name == name), None)

    def attr(self, key: str, default: object = "") -> object:
        return self.root.attributes.get(key, default) if self.root is not None else default


def depths(spans: list[SpanRecord]) -> dict[str, int]:
    """Depth of each span below the topmost one(s) of ``spans`` (one whose parent is not in ``spans``: 0)."""
    by_id = {s.span_id: s for s in spans}
    out: dict[str, int] = {}

    def depth(s: SpanRecord, hops: int = 0) -> int:
        if s.span_id not in out:
            parent = by_id.get(s.parent_id) if s.parent_id else None
            out[s.span_id] = 0 if parent is None or hops > len(spans) else depth(parent, hops + 1) + 1
        return out[s.span_id]

    for s in spans:
        depth(s)
    return out


def counts(span: SpanRecord) -> bool:
    return span.attributes.get(SEGMENT_ATTR, True) is not False


def attribute(spans: list[SpanRecord], t0: int, t1: int) -> tuple[list[tuple[int, int, SpanRecord]], int]:
    """Split ``[t0, t1]`` into pieces, each attributed to one span; returns the pieces (adjacent ones of the
    same span merged) and the time no segment span covers."""
    depth = depths(spans)
    cands = [s for s in spans if counts(s) and s.end_ns > t0 and s.start_ns < t1]
    cuts = sorted({t0, t1, *(min(max(s.start_ns, t0), t1) for s in cands),
                   *(min(max(s.end_ns, t0), t1) for s in cands)})
    pieces: list[tuple[int, int, SpanRecord]] = []
    gap = 0
    for a, b in pairwise(cuts):
        active = [s for s in cands if s.start_ns <= a and s.end_ns >= b]
        if not active:
            gap += b - a
            continue
        best = max(active, key=lambda s: (depth[s.span_id], s.attributes.get(BACKGROUND_ATTR) is not True,
                                          s.start_ns))
        if pieces and pieces[-1][2] is best and pieces[-1][1] == a:
            pieces[-1] = (pieces[-1][0], b, best)
        else:
            pieces.append((a, b, best))
    return pieces, gap


def waterfall(root: SpanRecord | None, spans: list[SpanRecord]) -> Waterfall:
    """The TTFT breakdown of one request (``root``: its ``router.request`` span; ``spans``: its subtree)."""
    spans = sorted(spans, key=lambda s: (s.start_ns, -s.end_ns))
    if root is None:
        root = next((s for s in spans if s.name == ROOT), None)
    if root is None:  # no router span: no TTFT, just the spans
        return Waterfall(None, spans, min((s.start_ns for s in spans), default=0), None)
    t0 = root.start_ns
    first = root.event_ns(FIRST_TOKEN)
    wf = Waterfall(root, spans, t0, None if first is None else first - t0)
    if first is None:
        return wf
    wf.pieces, wf.unattributed_ns = attribute(spans, t0, first)
    total: dict[str, int] = defaultdict(int)
    first_at: dict[str, int] = {}
    by_id = {s.span_id: s for s in spans}
    for a, b, s in wf.pieces:
        total[s.span_id] += b - a
        first_at.setdefault(s.span_id, a)
    parents: set[str] = set()  # spans some of whose time went to a descendant
    for _, _, s in wf.pieces:
        p = s.parent_id
        while p in by_id and p not in parents:
            parents.add(p)
            p = by_id[p].parent_id
    ttft = max(1, first - t0)
    wf.segments = sorted((Segment(by_id[sid], ns, ns / ttft, first_at[sid], sid in parents)
                          for sid, ns in total.items()), key=lambda g: g.first_ns)
    return wf
