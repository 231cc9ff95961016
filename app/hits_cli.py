"""Hit attribution from a stack's span file: ``kvmesh trace --why ID`` (one request in words) and
``kvmesh report hits`` (the fleet over a window).

    kvmesh report hits [--state-dir D | --file F] [--last S] [--capacity-blocks N] [--json]

The router puts each finished request's attribution on its root span (``kvmesh.hit.*``,
``services/router/hits.py``): predicted and delivered hit, missed tokens by cause, and the prompt's block keys.
The report sums the causes (they add up to the missed prefill tokens exactly, request by request) and replays
the recorded block keys, in arrival order, through the offline optimum: an infinite cache shared by the fleet
(every block any earlier request had), and, with ``--capacity-blocks``, Belady's cache of that many blocks
(``kvmesh.routing.hits``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvmesh import state
from kvmesh.routing.hits import belady_hits, infinite_cache_hits
from kvmesh.telemetry.spans import SpanRecord, find, read_spans, roots, trace_file


def request_ident(ident: str) -> str:
    """A response's id (``chatcmpl-<request id>``, ``cmpl-<request id>``) as the request id it carries."""
    for prefix in ("chatcmpl-", "cmpl-"):
        if ident.startswith(prefix):
            return ident[len(prefix):]
    return ident


def why_text(root: SpanRecord) -> str:
    """One request's hit attribution in words."""
    a = root.attributes
    if "kvmesh.hit.prompt_tokens" not in a:
        return f"request {root.request_id}: no hit attribution recorded (it did not finish, or its router is older)"
    prompt, missed = int(a["kvmesh.hit.prompt_tokens"]), int(a["kvmesh.hit.missed_tokens"])
    lines = [f"request {root.request_id} on {a.get('kvmesh.hit.instance', '?')}: {prompt} prompt tokens",
             f"  predicted hit: {a['kvmesh.hit.predicted_tokens']} tokens (the router's view when it routed)",
             f"  delivered hit: {a['kvmesh.hit.delivered_tokens']} tokens (what the engine reused)",
             f"  missed:        {missed} tokens computed" + (", because:" if missed else "")]
    lines += [f"    - {line}" for line in a.get("kvmesh.hit.why", [])]
    return "\n".join(lines)


def _causes(root: SpanRecord) -> dict[str, int]:
    out = {}
    for item in root.attributes.get("kvmesh.hit.causes", []):
        cause, _, n = str(item).partition("=")
        out[cause] = int(n)
    return out


def report(spans: list[SpanRecord], since_ns: int = 0, capacity_blocks: int | None = None) -> dict[str, Any]:
    """The fleet's hit attribution over the requests that started at or after ``since_ns``."""
    reqs = [r for r in roots(spans) if "kvmesh.hit.prompt_tokens" in r.attributes and r.start_ns >= since_ns]
    block_size = int(reqs[0].attributes.get("kvmesh.hit.block_size", 16)) if reqs else 16
    prompt = sum(int(r.attributes["kvmesh.hit.prompt_tokens"]) for r in reqs)
    delivered = sum(int(r.attributes["kvmesh.hit.delivered_tokens"]) for r in reqs)
    predicted = sum(int(r.attributes["kvmesh.hit.predicted_tokens"]) for r in reqs)
    causes: dict[str, int] = {}
    for r in reqs:
        for c, n in _causes(r).items():
            causes[c] = causes.get(c, 0) + n
    stream = [([int(k, 16) for k in str(r.attributes.get("kvmesh.hit.keys", "")).split()],
               int(r.attributes["kvmesh.hit.prompt_tokens"])) for r in reqs]
    return summary(len(reqs), prompt, predicted, delivered, causes, stream, block_size, capacity_blocks)


def summary(requests: int, prompt: int, predicted: int, delivered: int, causes: dict[str, int],
            stream: list[tuple[list[int], int]], block_size: int, capacity_blocks: int | None) -> dict[str, Any]:
    """The report's figures (shared with ``kvmesh sim``): causes, their shares, and the optimum's hits."""
    missed = prompt - delivered
    out: dict[str, Any] = {
        "requests": requests, "prompt_tokens": prompt, "predicted_hit_tokens": predicted,
        "delivered_hit_tokens": delivered, "missed_tokens": missed,
        "missed_by_cause": dict(sorted(causes.items(), key=lambda kv: -kv[1])),
        "missed_share_by_cause": {c: n / missed for c, n in sorted(causes.items(), key=lambda kv: -kv[1])}
        if missed else {},
        "causes_add_up": sum(causes.values()) == missed,
        "optimum_infinite_hit_tokens": sum(infinite_cache_hits(stream, block_size)),
    }
    if capacity_blocks is not None:
        out["capacity_blocks"] = capacity_blocks
        out["optimum_belady_hit_tokens"] = sum(belady_hits(stream, block_size, capacity_blocks))
    return out


def text(r: dict[str, Any]) -> str:
    if not r["requests"]:
        return "no finished requests with hit attribution in the window"
    p = max(1, r["prompt_tokens"])
    lines = [f"{r['requests']} requests, {r['prompt_tokens']} prompt tokens",
             (f"  predicted hit {r['predicted_hit_tokens']} ({r['predicted_hit_tokens'] / p:.1%}), "
             f"delivered {r['delivered_hit_tokens']} ({r['delivered_hit_tokens'] / p:.1%})"),
             f"  missed {r['missed_tokens']} tokens, by cause (they add up: {r['causes_add_up']}):"]
    lines += [f"    {c:<18} {n:>10}  {r['missed_share_by_cause'][c]:6.1%}" for c, n in r["missed_by_cause"].items()]
    lines.append(f"  offline optimum, infinite fleet cache: {r['optimum_infinite_hit_tokens']} tokens "
                 f"({r['optimum_infinite_hit_tokens'] / p:.1%}); gap "
                 f"{r['optimum_infinite_hit_tokens'] - r['delivered_hit_tokens']} tokens")
    if "optimum_belady_hit_tokens" in r:
        lines.append(f"  offline optimum, Belady over {r['capacity_blocks']} blocks: {r['optimum_belady_hit_tokens']}"
                     f" tokens ({r['optimum_belady_hit_tokens'] / p:.1%}); gap "
                     f"{r['optimum_belady_hit_tokens'] - r['delivered_hit_tokens']} tokens")
    return "\n".join(lines)


def _spans(args: argparse.Namespace) -> tuple[Path, list[SpanRecord]]:
    path = Path(args.file) if args.file else trace_file(state.state_dir(args.state_dir))
    try:
        return path, read_spans(path)
    except FileNotFoundError:
        raise SystemExit(f"kvmesh: no span file at {path} (start a stack with `kvmesh up`, or pass --state-dir / "
                         "--file)") from None


def why_main(ident: str, path: Path, wait_s: float) -> int:
    """``kvmesh trace --why ID``."""
    deadline = time.monotonic() + wait_s
    while True:
        root, _ = find(read_spans(path), request_ident(ident)) if path.exists() else (None, [])
        if (root is not None and "kvmesh.hit.prompt_tokens" in root.attributes) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if root is None:
        print(f"kvmesh trace: no request {ident!r} in {path}", file=sys.stderr)
        return 1
    print(why_text(root))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh report hits", description=__doc__.split("\n\n")[0])
    p.add_argument("--state-dir", help="the stack's state directory (default: $KVMESH_STATE_DIR, else .kvmesh/)")
    p.add_argument("--file", help="read this span file instead of <state dir>/traces.jsonl")
    p.add_argument("--last", type=float, metavar="S", help="only requests of the last S seconds")
    p.add_argument("--capacity-blocks", type=int, help="also Belady's optimum over a cache of this many blocks")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    _, spans = _spans(args)
    since = time.time_ns() - int(args.last * 1e9) if args.last else 0
    r = report(spans, since, args.capacity_blocks)
    print(json.dumps(r, indent=1) if args.json else text(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
