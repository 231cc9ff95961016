"""Waterfalls for people: a text table, an HTML timeline, a PNG timeline, the slowest requests."""

from __future__ import annotations

import datetime as dt
import html
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmesh.telemetry.spans import SpanRecord
from kvmesh.telemetry.waterfall import Segment, Waterfall, depths

if TYPE_CHECKING:
    from matplotlib.artist import Artist

BAR = 40
SERVICE_COLORS = {"router": "#4e79a7", "cachesvc": "#76b7b2", "prefill": "#f28e2b", "decode": "#59a14f",
                  "both": "#b07aa1"}
SELF_NOTE = {"router.dispatch": "in transit between services (gRPC hops, event-loop handoffs)",
             "router.request": "router overhead outside its other spans",
             "prefill.request": "prefill handoffs between its steps",
             "router.route": "block keys and the choice"}


def ms(ns: float) -> str:
    return f"{ns / 1e6:.1f}"


def _mb(n: Any) -> str:
    return f"{float(n) / 2**20:.2f} MiB"


def detail(span: SpanRecord) -> str:
    """The few attributes that explain a segment's duration."""
    a = span.attributes
    name = span.name
    if name == "router.tokenize":
        return f"{a.get('kvmesh.tokens.prompt', '?')} prompt tokens"
    if name == "router.route":
        def among(role: str) -> Any:  # a span of a large fleet lists some candidates and says how many there were
            return a.get(f"kvmesh.route.{role}.candidates_total", len(a.get(f"kvmesh.route.{role}.candidates", [])))

        parts = [f"{role} → {a[f'kvmesh.route.{role}.choice']} (of {among(role)})"
                 for role in ("prefill", "decode", "both") if f"kvmesh.route.{role}.choice" in a]
        return ", ".join(parts)
    if name == "cachesvc.match_prefix":
        matched = a.get("kvmesh.matched", [])
        hits = ", ".join(matched) if matched else "no hits"
        return f"{a.get('kvmesh.blocks', '?')} blocks asked; {hits}"
    if name == "prefill.fetch":
        return (f"{a.get('kvmesh.tier', '?')}: {a.get('kvmesh.blocks', 0)} blocks"
                + (f", {_mb(a['kvmesh.bytes'])}" if "kvmesh.bytes" in a else "")
                + (f" ({a['kvmesh.outcome']})" if "kvmesh.outcome" in a else ""))
    if name == "prefill.queue":
        return f"engine busy {a.get('kvmesh.engine_wait_ms', 0):.1f} ms"
    if name == "prefill.compute":
        return (f"{a.get('kvmesh.tokens.computed', '?')} tokens computed, "
                f"{a.get('kvmesh.tokens.reused', '?')} reused"
                + (f", {a['kvmesh.preemptions']} preemptions" if a.get("kvmesh.preemptions") else ""))
    if name == "kv.push":
        return (f"{a.get('kvmesh.blocks', '?')} blocks, {_mb(a.get('kvmesh.bytes', 0))}, "
                f"{a.get('kvmesh.gbps', 0):.2f} GB/s, {a.get('kvmesh.transfer_backend', '')}"
                + (f"; {a['kvmesh.parts']} parts, {a.get('kvmesh.critical_ms', 0):.1f} ms of "
                   f"{a.get('kvmesh.push_ms', 0):.1f} after the compute" if a.get("kvmesh.parts", 1) > 1 else ""))
    if name == "kv.ready":
        return f"{a.get('kvmesh.prefill_instance', '?')} → {a.get('kvmesh.instance', '?')}" + (
            "" if a.get("kvmesh.ok", True) else " (prefill failed)")
    if name == "decode.load":
        return f"{a.get('kvmesh.blocks', '?')} blocks, {_mb(a.get('kvmesh.bytes', 0))}"
    if name == "decode.kv_fallback":
        return str(a.get("kvmesh.reason", ""))
    if span.name in SELF_NOTE:
        return SELF_NOTE[span.name]
    return ""


def _bar(wf: Waterfall, seg: Segment, width: int = BAR) -> str:
    assert wf.ttft_ns
    cells = [" "] * width
    for a, b, s in wf.pieces:
        if s.span_id != seg.span.span_id:
            continue
        lo = (a - wf.t0_ns) / wf.ttft_ns * width
        hi = (b - wf.t0_ns) / wf.ttft_ns * width
        for i in range(int(lo), min(width, max(int(lo) + 1, int(-(-hi // 1))))):
            cells[i] = "█"
    return "".join(cells)


def header(wf: Waterfall) -> list[str]:
    root = wf.root
    lines = []
    if root is None:
        sc = wf.spans[0] if wf.spans else None
        lines.append(f"trace {sc.trace_id if sc else '?'}: no router span, so no TTFT; its spans:")
        return lines
    a = root.attributes
    when = dt.datetime.fromtimestamp(root.start_ns / 1e9, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines.append(f"request {root.request_id}  trace {root.trace_id}  {when}")
    lines.append(f"model {a.get('kvmesh.model', '?')}  tenant {a.get('kvmesh.tenant') or '-'}  "
                 f"api {a.get('kvmesh.api', '?')}  prompt {a.get('kvmesh.tokens.prompt', '?')} tokens "
                 f"({a.get('kvmesh.tokens.cached', '?')} cached)")
    if root.status == "ERROR":
        lines.append(f"FAILED: {root.status_message}")
    if wf.ttft_ns is None:
        lines.append("no first token was sent")
    else:
        lines.append(f"TTFT {ms(wf.ttft_ns)} ms (router: request received → first token sent); "
                     f"whole request {ms(root.duration_ns)} ms, "
                     f"{a.get('kvmesh.tokens.completion', '?')} tokens")
    return lines


def text(wf: Waterfall, spans_tree: bool = False) -> str:
    lines = header(wf)
    if wf.ttft_ns:
        dom = wf.dominant
        rows = [(g.label, g.span.instance or g.span.service, ms(g.first_ns - wf.t0_ns), ms(g.ttft_ns),
                 f"{g.share * 100:.1f}%") for g in wf.segments]
        w0 = max(len(r[0]) for r in [("segment", "service"), *rows]) + 2
        w1 = max(len(r[1]) for r in [("segment", "service"), *rows])
        lines.append("")
        lines.append(f"  {'segment':<{w0}} {'instance':<{w1}} {'start ms':>9} {'ms':>8} {'share':>6}  "
                     f"|{'0 → TTFT':^{BAR}}|")
        for (name, inst, start, dur, share), g in zip(rows, wf.segments):
            mark = " ◀ dominant" if g is dom else ""
            note = detail(g.span)
            lines.append(f"  {name:<{w0}} {inst:<{w1}} {start:>9} {dur:>8} {share:>6}  |{_bar(wf, g)}|{mark}"
                         + (f"  {note}" if note else ""))
        total = wf.attributed_ns + wf.unattributed_ns
        gap = f"   ({ms(wf.unattributed_ns)} ms not covered by any span)" if wf.unattributed_ns else ""
        lines.append(f"  {'sum of segments':<{w0}} {'':<{w1}} {'':>9} {ms(wf.attributed_ns):>8} "
                     f"{wf.attributed_ns / wf.ttft_ns * 100:>5.1f}%{gap}")
        assert total >= 0
        if any(g.has_children for g in wf.segments):
            lines.append("  (self) = time in a span outside its children")
        lines += _dominant_line(wf)
    lines += after_first_token(wf)
    if spans_tree or not wf.ttft_ns:
        lines.append("")
        lines += tree(wf.spans, wf.t0_ns)
    return "\n".join(lines)


def after_first_token(wf: Waterfall) -> list[str]:
    out = []
    for s in wf.spans:
        a = s.attributes
        if s.name == "decode.generate":
            itl = (f", ITL p50 {a['kvmesh.itl_ms.p50']:.1f} / p90 {a['kvmesh.itl_ms.p90']:.1f} / "
                   f"p99 {a['kvmesh.itl_ms.p99']:.1f} / max {a['kvmesh.itl_ms.max']:.1f} ms"
                   if "kvmesh.itl_ms.p50" in a else "")
            out.append(f"after the first token: decode.generate {ms(s.duration_ns)} ms, "
                       f"{a.get('kvmesh.itl.count', 0)} inter-token gaps{itl}")
        for e in s.events:
            if e.get("name") == "kv_fallback":
                out.append(f"kv fallback: {e.get('attributes', {}).get('kvmesh.reason', '')}")
        if s.status == "ERROR" and s is not wf.root:
            out.append(f"error in {s.name} ({s.instance or s.service}): {s.status_message}")
    return out


def tree(spans: list[SpanRecord], t0: int) -> list[str]:
    depth = depths(spans)
    out = [f"  {'span':<40} {'service':<10} {'start ms':>9} {'ms':>9}"]
    for s in _tree_order(spans):
        name = "  " * depth[s.span_id] + s.name
        out.append(f"  {name:<40} {s.instance or s.service:<10} {ms(s.start_ns - t0):>9} "
                   f"{ms(s.duration_ns):>9}" + (" ERROR" if s.status == "ERROR" else ""))
    return out


def _tree_order(spans: list[SpanRecord]) -> list[SpanRecord]:
    ids = {s.span_id for s in spans}
    kids: dict[str | None, list[SpanRecord]] = {}
    for s in spans:
        kids.setdefault(s.parent_id if s.parent_id in ids else None, []).append(s)
    out: list[SpanRecord] = []

    def walk(parent: str | None) -> None:
        for s in sorted(kids.get(parent, []), key=lambda x: (x.start_ns, -x.end_ns)):
            out.append(s)
            walk(s.span_id)

    walk(None)
    return out


# ---- the slowest requests ----------------------------------------------------------------------------------

def slowest(wfs: list[Waterfall]) -> str:
    rows = [(f"  {'TTFT ms':>9}  {'dominant segment':<34} {'share':>6}  {'when (UTC)':<19}  "
            f"{'request id':<32}  trace id")]
    for wf in wfs:
        dom, root = wf.dominant, wf.root
        assert root is not None and wf.ttft_ns is not None
        when = dt.datetime.fromtimestamp(root.start_ns / 1e9, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        rows.append(f"  {ms(wf.ttft_ns):>9}  {dom.label if dom else '-':<34} "
                    f"{f'{dom.share * 100:.0f}%' if dom else '':>6}  {when:<19}  {root.request_id:<32}  "
                    f"{root.trace_id}")
    return "\n".join(rows)


def summary(wf: Waterfall) -> dict[str, Any]:
    dom, root = wf.dominant, wf.root
    return {"request_id": root.request_id if root else "", "trace_id": root.trace_id if root else "",
            "ttft_ms": None if wf.ttft_ns is None else round(wf.ttft_ns / 1e6, 3),
            "dominant": dom.label if dom else None, "dominant_share": round(dom.share, 4) if dom else None,
            "segments": [{"name": g.label, "service": g.span.service, "instance": g.span.instance,
                          "ms": round(g.ttft_ns / 1e6, 3), "share": round(g.share, 4)} for g in wf.segments]}


def spans_json(spans: list[SpanRecord]) -> str:
    return json.dumps([vars(s) for s in spans], indent=1)


# ---- pictures ----------------------------------------------------------------------------------------------

ROW, LABEL_W, CHART_W, TOP = 22, 330, 760, 86


def _layout(wf: Waterfall) -> tuple[list[SpanRecord], dict[str, int], int, int, Callable[[float], float]]:
    """Rows in tree order and the time axis: zoomed on TTFT (+25%) when there is one; later parts clipped."""
    spans = _tree_order(wf.spans)
    depth = depths(wf.spans)
    t0 = wf.t0_ns
    t1 = max([s.end_ns for s in spans] + [t0 + 1])
    if wf.ttft_ns:
        t1 = min(t1, t0 + int(wf.ttft_ns * 1.25))
    return spans, depth, t0, t1, lambda t: LABEL_W + (min(max(t, t0), t1) - t0) / (t1 - t0) * CHART_W


def _color(s: SpanRecord) -> str:
    return SERVICE_COLORS.get(s.service, "#9c9c9c")


def html_page(wf: Waterfall) -> str:
    spans, depth, t0, t1, x = _layout(wf)
    height = TOP + ROW * len(spans) + 30
    width = LABEL_W + CHART_W + 20
    crit: dict[str, list[tuple[int, int]]] = {}
    for a, b, s in wf.pieces:
        crit.setdefault(s.span_id, []).append((a, b))
    svg = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           'font-family="monospace" font-size="12">')]
    for i in range(5):
        t = t0 + (t1 - t0) * i / 4
        svg.append(f'<line x1="{x(t):.1f}" y1="{TOP - 14}" x2="{x(t):.1f}" y2="{height - 24}" stroke="#ddd"/>'
                   f'<text x="{x(t) + 2:.1f}" y="{TOP - 18}" fill="#666">{ms(t - t0)} ms</text>')
    for i, s in enumerate(spans):
        y = TOP + i * ROW
        attrs = "\n".join(f"{k} = {v}" for k, v in s.attributes.items())
        tip = html.escape(f"{s.name} ({s.instance or s.service})\nstart {ms(s.start_ns - t0)} ms, "
                          f"{ms(s.duration_ns)} ms\n{attrs}")
        w = max(1.5, x(s.end_ns) - x(s.start_ns))
        svg.append(f'<g><title>{tip}</title>'
                   f'<text x="{4 + 12 * depth[s.span_id]}" y="{y + 14}">{html.escape(s.name)}</text>')
        if s.start_ns < t1:
            svg.append(f'<rect x="{x(s.start_ns):.1f}" y="{y + 3}" width="{w:.1f}" height="{ROW - 8}" '
                       f'fill="{_color(s)}" fill-opacity="0.35" stroke="{_color(s)}"/>')
        for a, b in crit.get(s.span_id, ()):
            svg.append(f'<rect x="{x(a):.1f}" y="{y + 3}" width="{max(1.5, x(b) - x(a)):.1f}" '
                       f'height="{ROW - 8}" fill="{_color(s)}"/>')
        svg.append(f'<text x="{min(x(s.end_ns) + 4, width - 60):.1f}" y="{y + 14}" fill="#333">'
                   f'{"▸ " if s.end_ns > t1 else ""}{ms(s.duration_ns)}</text></g>')
    if wf.ttft_ns:
        tx = x(t0 + wf.ttft_ns)
        svg.append(f'<line x1="{tx:.1f}" y1="{TOP - 8}" x2="{tx:.1f}" y2="{height - 24}" stroke="#e15759" '
                   f'stroke-width="2" stroke-dasharray="4 3"/><text x="{tx + 3:.1f}" y="{height - 10}" '
                   f'fill="#e15759">first token ({ms(wf.ttft_ns)} ms)</text>')
    legend = " ".join(f'<span style="color:{c}">■ {n}</span>' for n, c in SERVICE_COLORS.items())
    svg.append("</svg>")
    rows = "".join(
        f"<tr{' class=dom' if g is wf.dominant else ''}><td>{html.escape(g.label)}</td>"
        f"<td>{html.escape(g.span.instance or g.span.service)}</td><td>{ms(g.ttft_ns)}</td>"
        f"<td>{g.share * 100:.1f}%</td><td><div class=bar style='width:{g.share * 300:.0f}px;"
        f"background:{_color(g.span)}'></div></td><td>{html.escape(detail(g.span))}</td></tr>"
        for g in wf.segments)
    head = "<br>".join(html.escape(line) for line in header(wf) + _dominant_line(wf))
    after = "<br>".join(html.escape(line) for line in after_first_token(wf))
    title = html.escape(wf.root.request_id if wf.root else "")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>kvmesh trace {title}</title>
<style>body{{font-family:system-ui,sans-serif;margin:20px;color:#222}}
table{{border-collapse:collapse;margin:12px 0}}
td,th{{padding:3px 10px;text-align:left;font-size:13px}} tr.dom td{{font-weight:bold;background:#fff3cd}}
.bar{{height:10px}} .head{{font-family:monospace;font-size:13px}}</style></head><body>
<h2>kvmesh request timeline</h2><div class=head>{head}</div>
<table><tr><th>TTFT segment</th><th>instance</th><th>ms</th><th>share</th><th></th><th>detail</th></tr>
{rows}</table>
<div class=head>{after}</div>
<p>Every span of the request (solid: the time it holds on the way to the first token; hover for attributes).
{legend}</p>
{''.join(svg)}
</body></html>
"""


def png(wf: Waterfall, path: str | Path) -> Path:
    """The HTML view's timeline as a PNG, drawn with matplotlib (the ``plots`` extra): a bar per span in tree
    order, coloured by service (pale: the whole span; solid: the time it holds on the way to the first token), a
    dashed line at the first token, the time axis in ms zoomed on TTFT."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise RuntimeError("--png needs matplotlib: pip install 'kvmesh[plots]' (--html needs nothing)") from e
    spans, depth, t0, t1, _ = _layout(wf)
    crit: dict[str, list[tuple[int, int]]] = {}
    for a, b, s in wf.pieces:
        crit.setdefault(s.span_id, []).append((a, b))

    def at(t: int) -> float:  # ms since the request came in, clipped to the axis
        return (min(max(t, t0), t1) - t0) / 1e6

    head = header(wf) + _dominant_line(wf)
    fig = Figure(figsize=(13, 1.6 + 0.3 * len(spans) + 0.2 * len(head)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, s in enumerate(spans):
        color = _color(s)
        if s.start_ns < t1:
            ax.barh(i, max(at(s.end_ns) - at(s.start_ns), 1e-3), left=at(s.start_ns), height=0.7,
                    color=color, alpha=0.35, edgecolor=color)
        for a, b in crit.get(s.span_id, ()):
            ax.barh(i, at(b) - at(a), left=at(a), height=0.7, color=color)
        ax.annotate(("▸ " if s.end_ns > t1 else "") + ms(s.duration_ns), (at(s.end_ns), i),
                    xytext=(4, 0), textcoords="offset points", va="center", fontsize=8, color="#333")
    handles: list[Artist] = [Patch(color=c, label=n) for n, c in SERVICE_COLORS.items()
                             if any(s.service == n for s in spans)]
    if wf.ttft_ns:
        handles.append(ax.axvline(wf.ttft_ns / 1e6, color="#e15759", linestyle="--", linewidth=2,
                                  label=f"first token ({ms(wf.ttft_ns)} ms)"))
    names = ["  " * depth[s.span_id] + s.name for s in spans]
    ax.set_yticks(range(len(spans)), names, fontfamily="monospace", fontsize=9, ha="left")
    # left-aligned, so the indent shows the tree: pad by the longest name (monospace, ~0.6 em a character)
    ax.tick_params(axis="y", pad=8 + 0.62 * 9 * max(map(len, names), default=0))
    ax.set_ylim(len(spans) - 0.5, -0.5)  # the root on top, as in the tree
    ax.set_xlim(0, (t1 - t0) / 1e6)
    ax.set_xlabel("ms since the router received the request")
    ax.set_ylabel("span")
    ax.grid(axis="x", color="#ddd")
    ax.set_axisbelow(True)
    ax.set_title("\n".join(head), loc="left", fontsize=9, fontfamily="monospace")
    if handles:
        ax.legend(handles=handles, loc="lower right", fontsize=8)
    path = Path(path)
    fig.savefig(path, format="png", dpi=100)
    return path


def _dominant_line(wf: Waterfall) -> list[str]:
    dom = wf.dominant
    return [f"dominant: {dom.label}, {ms(dom.ttft_ns)} ms = {dom.share * 100:.0f}% of TTFT"] if dom else []
