"""``kvmesh trace``: one request's TTFT waterfall, or the slowest requests, from a stack's span file.

    kvmesh trace [ID] [--state-dir D | --file F] [--spans] [--json] [--html FILE] [--png FILE]
    kvmesh trace --slowest N [--json]
    kvmesh trace --why ID      (the request's predicted and delivered hit, and why each missed token was computed)

ID is a request id (``x-request-id``) or a trace id (from ``traceparent``), or a unique prefix of either;
without one, the latest request. The span file is ``traces.jsonl`` in the state directory (``--state-dir``,
else ``$KVMESH_STATE_DIR``, else ``.kvmesh/``), which ``kvmesh up`` has every service write.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvmesh import state
from kvmesh.telemetry import render
from kvmesh.telemetry.spans import SpanRecord, by_trace, find, read_spans, roots, subtree, trace_file
from kvmesh.telemetry.waterfall import Waterfall, waterfall


def _load(path: Path) -> list[SpanRecord]:
    try:
        return read_spans(path)
    except FileNotFoundError:
        raise SystemExit(f"kvmesh trace: no span file at {path} (start a stack with `kvmesh up`, or pass "
                         "--state-dir / --file)") from None


def _find(path: Path, ident: str | None, wait_s: float) -> tuple[list[SpanRecord], Waterfall | None]:
    """The request's spans and waterfall; waits up to ``wait_s`` for spans still being flushed."""
    deadline = time.monotonic() + wait_s
    while True:
        spans = _load(path)
        if ident is None:
            rs = roots(spans)
            root, tree = (rs[-1], subtree(by_trace(spans)[rs[-1].trace_id], rs[-1])) if rs else (None, [])
        else:
            root, tree = find(spans, ident)
        complete = root is not None and any(s.name == "decode.generate" for s in tree)
        if complete or time.monotonic() >= deadline:
            return tree, (waterfall(root, tree) if tree else None)
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("id", nargs="?",
                   help="request id or trace id (or a unique prefix); default: the latest request")
    p.add_argument("--state-dir",
                   help="the stack's state directory (default: $KVMESH_STATE_DIR, else .kvmesh/)")
    p.add_argument("--file", help="read this span file instead of <state dir>/traces.jsonl")
    p.add_argument("--why", metavar="ID", help="the request's hit attribution in words (ID: its x-request-id or "
                                               "the response's id)")
    p.add_argument("--slowest", type=int, metavar="N", help="list the N requests with the worst TTFT")
    p.add_argument("--spans", action="store_true", help="also print every span of the request as a tree")
    p.add_argument("--json", action="store_true",
                   help="print the request's spans (with --slowest: the list) as JSON")
    p.add_argument("--html", metavar="FILE", help="write a timeline of the request as an HTML page")
    p.add_argument("--png", metavar="FILE", help="write a timeline of the request as a PNG picture")
    p.add_argument("--wait", type=float, default=2.0, metavar="S",
                   help="wait up to S seconds for spans still being written (default 2)")
    args = p.parse_args(argv)
    path = Path(args.file) if args.file else trace_file(state.state_dir(args.state_dir))
    if args.why:
        from app.hits_cli import why_main

        return why_main(args.why, path, args.wait)

    if args.slowest is not None:
        spans = _load(path)
        traces = by_trace(spans)
        wfs = [waterfall(r, subtree(traces[r.trace_id], r)) for r in roots(spans)]
        wfs = sorted((w for w in wfs if w.ttft_ns is not None), key=lambda w: -(w.ttft_ns or 0))
        wfs = wfs[:args.slowest]
        if not wfs:
            print(f"kvmesh trace: no finished requests in {path}", file=sys.stderr)
            return 1
        print(json.dumps([render.summary(w) for w in wfs], indent=1) if args.json else render.slowest(wfs))
        return 0

    tree, wf = _find(path, args.id, args.wait)
    if wf is None:
        what = f"request or trace {args.id!r}" if args.id else "any request"
        print(f"kvmesh trace: no spans of {what} in {path}", file=sys.stderr)
        return 1
    if args.json:
        print(render.spans_json(tree))
    else:
        print(render.text(wf, spans_tree=args.spans))
    if args.html:
        Path(args.html).write_text(render.html_page(wf), encoding="utf-8")
        print(f"timeline written to {args.html}", file=sys.stderr)
    if args.png:
        try:
            render.png(wf, args.png)
        except RuntimeError as e:
            print(f"kvmesh trace: {e}", file=sys.stderr)
            return 1
        print(f"timeline written to {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
