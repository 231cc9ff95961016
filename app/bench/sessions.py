"""Session-aware eviction against the offline optimum, on the conversation trace and on a synthetic agentic one.

    python -m app.bench.sessions table --trace ../shared/data/traces/conversation_trace.jsonl
    python -m app.bench.sessions table --trace app/bench/data/agentic_trace.jsonl --capacities 100,300,1000
    python -m app.bench.sessions synth   # rewrites app/bench/data/agentic_trace.jsonl (fixed seed)

Every cell is ``kvmesh sim --trace T --instances 1 --policy round_robin --capacity-blocks C --pool-blocks 0
--eviction NAME --session-end-share P`` (one cache; deterministic, the clock counts block accesses), for the
shares 1 (every client says when its sessions end), 0.5 and 0; a strategy that reads no session signal is run
once. ``table`` writes its trace's section of docs/benchmarks.md (``--no-write``: print only).
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from pathlib import Path

from kvmesh.contracts.names import Eviction

from app.bench.eviction import shared_prefixes
from app.bench.report import load_average, publish
from app.bench.trace import TraceRequest, dump_trace, load_trace, with_sessions
from app.sim import simulate

SECTION = {"conversation": "Session-aware eviction, conversation trace",
           "agentic": "Session-aware eviction, agentic trace"}
AGENTIC = Path(__file__).resolve().parent / "data" / "agentic_trace.jsonl"
SHARES = (1.0, 0.5, 0.0)
SESSION_AWARE = (Eviction.SESSION, Eviction.SESSION_DUEL)
BASELINES = (Eviction.LRU, Eviction.DUEL)


def synth(out: str | Path = AGENTIC, sessions: int = 600, seed: int = 11) -> int:
    """An agentic, multi-tenant trace with tool-call pauses. 6 agent apps, each with a long system / tool
    preamble (20-60 blocks) shared by all its tasks (Pareto-skewed popularity); a task (a session) runs 2-10
    steps, each appending its tool's output (1-4 blocks) to the context, and every step but the last ends in a
    tool call (``pause``); the last ends the session. Tools take 1-15 s mostly, but one call in six is a slow
    one (a build, a crawl: 1-10 min), so a paused task may be away far longer than its neighbours' steps.
    Tasks start over an hour, about 10 a minute."""
    rng = random.Random(seed)
    preambles, next_id = shared_prefixes(rng, 6)
    events: list[TraceRequest] = []
    for task in range(sessions):
        app = min(int(rng.paretovariate(1.3)) - 1, 5)
        ctx = [0, *preambles[app]]
        t = rng.uniform(0, 3600.0)
        steps = rng.randint(2, 10)
        for step in range(steps):
            grow = rng.randint(1, 4)
            ctx = ctx + list(range(next_id, next_id + grow))
            next_id += grow
            last = step == steps - 1
            events.append(TraceRequest(t, 512 * len(ctx) - 100, 150, tuple(ctx), f"a{task}", last, not last))
            ctx = ctx[:-1]  # the last block is partial: the next step's version of it differs
            t += rng.uniform(60, 600) if rng.random() < 1 / 6 else rng.uniform(1, 15)
    events.sort(key=lambda r: r.arrival_s)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    dump_trace(events, out)
    return len(events)


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def measure(trace: list[TraceRequest], capacity: int) -> dict[str, dict[str, float]]:
    """Hit rate per strategy and share (``"1"``, ``"0.5"``, ``"0"``, ``"0.5 named"``; one ``"*"`` for a
    strategy that reads no signal)."""
    out: dict[str, dict[str, float]] = {}
    for name in (*BASELINES, Eviction.BELADY):
        out[name] = {"*": simulate(trace, 1, "round_robin", capacity, 0, eviction=name)["hit_rate"]}
    for name in SESSION_AWARE:
        cells = {}
        for share in SHARES:
            cells[f"{share:g}"] = simulate(with_sessions(trace, share), 1, "round_robin", capacity, 0,
                                           eviction=name)["hit_rate"]
        cells["0.5 named"] = simulate(with_sessions(trace, 0.5, "named"), 1, "round_robin", capacity, 0,
                                      eviction=name)["hit_rate"]
        out[name] = cells
    return out


def capacity_table(hits: dict[str, dict[str, float]], title: str) -> str:
    """One capacity's table of :func:`measure`'s hit rates, with the share of the LRU→Belady gap each
    session-aware strategy closes per column."""
    lru, opt = hits[Eviction.LRU]["*"], hits[Eviction.BELADY]["*"]
    rows = []
    for name, cells in hits.items():
        if "*" in cells:
            rows.append(f"| {name} | " + " | ".join([_pct(cells["*"])] * 3) + " | |")
        else:
            rows.append(f"| {name} | " + " | ".join(_pct(cells[f"{s:g}"]) for s in SHARES)
                        + f" | {_pct(cells['0.5 named'])} |")
    for name in SESSION_AWARE:
        rows.append(f"| gap closed, {name} | " + " | ".join(
            f"{gap_closed(hits[name][f'{s:g}'], lru, opt) * 100:.0f}%" if opt > lru else "-" for s in SHARES) + " | |")
    return (f"{title}:\n\n| eviction | all ends signalled | half | none | half, named |\n|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n")


def gap_closed(hit: float, lru: float, belady: float) -> float:
    """The share of the LRU→Belady gap a hit rate closes."""
    return (hit - lru) / (belady - lru)


def table(trace_path: str, capacities: list[int], max_requests: int | None = None) -> str:
    trace = load_trace(trace_path, max_requests)
    sessions = with_sessions(trace)
    turns = Counter(r.session_id for r in sessions)
    multi = sum(1 for n in turns.values() if n > 1)
    t0, load0 = time.monotonic(), load_average()
    rebuilt = "" if any(r.session_id for r in trace) else ", rebuilt from the prefix chains"
    head = (f"{len(trace):,} requests, {len(turns):,} sessions ({multi:,} with more than one request{rebuilt}), "
            f"{sum(r.pause for r in sessions):,} tool-call pauses. Block hit rate of one cache; the columns say "
            "which share of the sessions' clients signal their end (the others' requests carry no session id; "
            "`0.5 named`: they carry it, and pauses, but never an end). Gap closed: (hit - lru) / (belady - lru).\n")
    parts = [head]
    for cap in capacities:
        parts.append(capacity_table(measure(trace, cap), f"{cap:,} blocks"))
    parts.append(f"Took {time.monotonic() - t0:.0f} s; load average {load0} at the start, {load_average()} at "
                 "the end (the figures do not depend on it).")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.bench.sessions", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table", help="hit rate per strategy, share of sessions signalled and capacity")
    t.add_argument("--trace", required=True)
    t.add_argument("--capacities", default="1000,6000,20000")
    t.add_argument("--max-requests", type=int)
    t.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md as it is")
    s = sub.add_parser("synth", help="write the agentic trace (fixed seed)")
    s.add_argument("--out", default=str(AGENTIC))
    args = p.parse_args(argv)
    if args.cmd == "synth":
        print(f"{synth(args.out)} requests written to {args.out}")
        return 0
    body = table(args.trace, [int(x) for x in args.capacities.split(",")], args.max_requests)
    which = "agentic" if "agentic" in Path(args.trace).name else "conversation"
    command = f"python -m app.bench.sessions table --trace {args.trace} --capacities {args.capacities}"
    publish(SECTION[which], command, body, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
