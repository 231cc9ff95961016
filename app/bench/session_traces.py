"""Session-structured traces of different shapes, and the session-aware eviction measured on each of them.

    python -m app.bench.session_traces write --shape coding --out PATH [--sessions N --seed S]
    python -m app.bench.session_traces table [--shapes coding,fanout,chat,tenants] [--fractions 0.25,0.5,1] [--seed S]

Each shape is a seeded generator (:data:`SHAPES`) whose parameters are drawn from the distributions its docstring
states, written once from what such a workload looks like and not fitted to any result. The traces are
Mooncake-format (:mod:`app.bench.trace`) with kvmesh's session fields: every request carries its session's id
(``tenant/id``, as the router names sessions: the tenant is the agent app, the chat product or the tenant), a
request after which the session waits (on a tool, on sub-agents, on its user) carries ``pause``, the last request
of a session carries ``session_end`` (except a chat the user abandoned: nobody says it is over), and a sub-agent's
requests carry ``parent_session_id``. Block ids are 512-token blocks, prefix-chained: block 0 is shared by every
request, a preamble's ids are shared by every session that starts with it, and a request's last block is
partial (the next request of its session has a new version of it).

``table`` generates every shape in memory and runs the strategy grid of ``python -m app.bench.sessions table`` on
it, at capacities that are fractions of the trace's live working set (:func:`live_working_set`), so that a
fraction means the same pressure on every shape.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.contracts.names import Eviction

from app.bench.report import load_average, publish
from app.bench.trace import TRACE_BLOCK_TOKENS, TraceRequest, dump_trace, last_requests, with_every_end, with_sessions

SECTION = "Session-aware eviction, session-structured traces of four shapes"
DECODE_TOK_S = 40.0  # how fast a response is written: the time between a request and its session's tool call


@dataclass
class _Trace:
    """Block ids and requests of a trace being generated (block 0: the prefix every request shares)."""

    rng: random.Random
    next_id: int = 1
    out: list[TraceRequest] = field(default_factory=list)

    def blocks(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def request(self, t: float, ctx: list[int], session: str, output: int, *, end: bool = False,
                pause: bool = False, parent: str = "") -> float:
        """One request of ``session`` at ``t`` with context ``ctx`` (its last block partial); the time its
        response is written."""
        length = TRACE_BLOCK_TOKENS * (len(ctx) - 1) + self.rng.randint(1, TRACE_BLOCK_TOKENS)
        self.out.append(TraceRequest(t, length, output, tuple(ctx), session, end, pause, parent))
        return t + output / DECODE_TOK_S

    def done(self) -> list[TraceRequest]:
        return sorted(self.out, key=lambda r: r.arrival_s)


def _zipf(rng: random.Random, n: int, s: float) -> int:
    """An index in ``[0, n)`` with probability proportional to ``1 / (k + 1) ** s``."""
    return rng.choices(range(n), weights=[1 / (k + 1) ** s for k in range(n)])[0]


def _lognormal(rng: random.Random, median: float, sigma: float, cap: float) -> float:
    return min(cap, rng.lognormvariate(math.log(median), sigma))


def coding(sessions: int = 120, seed: int = 1, duration_s: float = 3600.0) -> list[TraceRequest]:
    """Coding agents. 4 agent apps, each with a large system / tool preamble of 24-64 blocks (12-32k tokens,
    uniform) shared by all its tasks; a task picks its app Zipf-skewed (weights 1, 1/2, 1/3, 1/4). Tasks start
    as a Poisson process over ``duration_s``. A task starts with its instructions (1-4 blocks) and runs
    ``4 + Exp(mean 12)`` steps (at most 60); each step's response is 50-600 tokens (uniform, written at 40
    tokens/s) and ends in a tool call whose output appends ``1 + LogNormal(0, 1)`` blocks (a file, a diff, a
    test log; at most 24) to the context, which grows step by step. The tool runs ``LogNormal(median 4 s,
    sigma 0.7)`` (at most 60 s) with probability 0.88, else minutes: ``60 s x Pareto(1.2)`` (a build, a test
    suite, a person approving; at most 30 min). Every step but the last pauses; the last ends the task."""
    tr = _Trace(random.Random(seed))
    rng = tr.rng
    preambles = [tr.blocks(rng.randint(24, 64)) for _ in range(4)]
    t0 = 0.0
    for task in range(sessions):
        t0 += rng.expovariate(sessions / duration_s)
        app = _zipf(rng, 4, 1.0)
        ctx = [0, *preambles[app], *tr.blocks(rng.randint(1, 4))]
        t, steps = t0, min(60, 4 + int(rng.expovariate(1 / 12)))
        for step in range(steps):
            last = step == steps - 1
            t = tr.request(t, ctx, f"app{app}/c{task}", rng.randint(50, 600), end=last, pause=not last)
            slow = rng.random() >= 0.88
            t += min(1800.0, 60.0 * rng.paretovariate(1.2)) if slow else _lognormal(rng, 4.0, 0.7, 60.0)
            ctx = [*ctx[:-1], *tr.blocks(1 + min(23, int(rng.lognormvariate(0.0, 1.0))))]
    return tr.done()


def fanout(sessions: int = 90, seed: int = 2, duration_s: float = 1200.0) -> list[TraceRequest]:
    """A planner agent that forks sub-agents. 3 apps with a preamble of 20-60 blocks each (uniform), picked
    Zipf-skewed (1, 1/2, 1/3); planner tasks (``sessions`` of them) start as a Poisson process over
    ``duration_s`` with their instructions (1-3 blocks). A planner runs 1-4 rounds (uniform): it writes a plan
    (its response appends 1-2 blocks) and forks 2-6 sub-agents (uniform), then pauses until they all finish. A
    sub-agent starts 0-2 s after the fork (uniform) with the planner's context as its prefix plus its own
    instructions (1 block), its requests carry the planner's session as ``parent_session_id``, and it runs 1-4
    steps (uniform), each appending 1-3 blocks of tool output after a tool call of ``LogNormal(median 3 s, sigma
    0.8)`` (at most 60 s); its last step ends it. The planner resumes 1-5 s after the last of them (uniform), its
    context grown by one block of each sub-agent's result; after its last round one more request writes the
    answer and ends it. Responses are 50-400 tokens (uniform, at 40 tokens/s)."""
    tr = _Trace(random.Random(seed))
    rng = tr.rng
    preambles = [tr.blocks(rng.randint(20, 60)) for _ in range(3)]
    t0 = 0.0
    for task in range(sessions):
        t0 += rng.expovariate(sessions / duration_s)
        app = _zipf(rng, 3, 1.0)
        planner = f"app{app}/p{task}"
        ctx = [0, *preambles[app], *tr.blocks(rng.randint(1, 3))]
        t, sub = t0, 0
        for _ in range(rng.randint(1, 4)):
            t = tr.request(t, ctx, planner, rng.randint(50, 400), pause=True)
            ctx = [*ctx[:-1], *tr.blocks(rng.randint(1, 2))]  # the plan: the forks' common prefix
            finished = []
            for _ in range(rng.randint(2, 6)):
                name, sub = f"{planner}.{sub}", sub + 1
                sctx, st = [*ctx, *tr.blocks(1)], t + rng.uniform(0.0, 2.0)
                steps = rng.randint(1, 4)
                for step in range(steps):
                    last = step == steps - 1
                    st = tr.request(st, sctx, name, rng.randint(50, 400), end=last, pause=not last, parent=planner)
                    if not last:
                        st += _lognormal(rng, 3.0, 0.8, 60.0)
                        sctx = [*sctx[:-1], *tr.blocks(rng.randint(1, 3))]
                finished.append(st)
            t = max(finished) + rng.uniform(1.0, 5.0)
            ctx = [*ctx, *tr.blocks(len(finished))]  # one block of each sub-agent's result
        tr.request(t, ctx, planner, rng.randint(50, 400), end=True)
    return tr.done()


def chat(sessions: int = 1500, seed: int = 3, duration_s: float = 3600.0) -> list[TraceRequest]:
    """People chatting. 3 system prompts of 1-4 blocks (uniform), used with weights 0.6 / 0.3 / 0.1;
    conversations start as a Poisson process over ``duration_s``. The first message is ``1 + LogNormal(0,
    0.8)`` blocks (a pasted document now and then; at most 16); every later turn appends the previous answer and
    the new message, 1-3 blocks (uniform). Answers are 100-800 tokens (uniform, at 40 tokens/s). After each
    answer the user reads and types for ``LogNormal(median 40 s, sigma 0.9)`` (at most 20 min) and goes on
    with probability 0.7 (so 3.3 turns on average, one in three conversations a single turn). A conversation
    that stops is closed by its user with probability 0.4: the client says so with its last request
    (``session_end``); the others are abandoned, and nobody says they are over.

    The wait for the user is signalled like a tool call: the chat client knows the answer is done and the
    conversation waits on its user, so every answer that is not the last of a closed conversation pauses its
    session; an abandoned conversation's last answer pauses it too, for good."""
    tr = _Trace(random.Random(seed))
    rng = tr.rng
    prompts = [[0, *tr.blocks(rng.randint(1, 4))] for _ in range(3)]
    t0 = 0.0
    for conv in range(sessions):
        t0 += rng.expovariate(sessions / duration_s)
        first = 1 + min(15, int(rng.lognormvariate(0.0, 0.8)))
        product = rng.choices(range(3), weights=(0.6, 0.3, 0.1))[0]
        ctx = [*prompts[product], *tr.blocks(first)]
        t = t0
        while True:
            more = rng.random() < 0.7
            closed = not more and rng.random() < 0.4
            t = tr.request(t, ctx, f"chat{product}/h{conv}", rng.randint(100, 800), end=closed, pause=not closed)
            if not more:
                break
            t += _lognormal(rng, 40.0, 0.9, 1200.0)
            ctx = [*ctx[:-1], *tr.blocks(rng.randint(1, 3))]
    return tr.done()


def tenants(sessions: int = 400, seed: int = 4, duration_s: float = 3600.0) -> list[TraceRequest]:
    """Several tenants on one cache. 8 tenants, each with its own preamble of 8-80 blocks (uniform) and its
    own workload, drawn per tenant: the share of one-shot requests (a session of one request, which ends it)
    ``U(0.1, 0.6)``, the mean length of its other sessions ``U(2, 20)`` steps (each session ``2 + Exp`` of
    that mean less 2, at most 60), and its pause (a tool or a user: ``LogNormal(median m, sigma 1)``, at most
    20 min, with ``m`` log-uniform in 2-60 s). A session's tenant is Zipf-skewed (``1 / rank ** 1.2``);
    sessions start as a Poisson process over ``duration_s``. A session starts with 1-4 blocks of its own
    (uniform) after its tenant's preamble and each step appends 1-4 (uniform); responses are 50-500 tokens
    (uniform, at 40 tokens/s). Every step but the last pauses; the last ends the session."""
    tr = _Trace(random.Random(seed))
    rng = tr.rng
    kinds = []
    for _ in range(8):
        kinds.append((tr.blocks(rng.randint(8, 80)), rng.uniform(0.1, 0.6), rng.uniform(2.0, 20.0),
                      math.exp(rng.uniform(math.log(2.0), math.log(60.0)))))
    t0 = 0.0
    for n in range(sessions):
        t0 += rng.expovariate(sessions / duration_s)
        tenant = _zipf(rng, 8, 1.2)
        preamble, one_shot, mean_steps, pause_s = kinds[tenant]
        ctx = [0, *preamble, *tr.blocks(rng.randint(1, 4))]
        steps = 1 if rng.random() < one_shot else min(60, 2 + int(rng.expovariate(1 / max(0.5, mean_steps - 2))))
        t = t0
        for step in range(steps):
            last = step == steps - 1
            t = tr.request(t, ctx, f"tenant{tenant}/s{n}", rng.randint(50, 500), end=last, pause=not last)
            t += _lognormal(rng, pause_s, 1.0, 1200.0)
            ctx = [*ctx[:-1], *tr.blocks(rng.randint(1, 4))]
    return tr.done()


SHAPES: dict[str, Callable[..., list[TraceRequest]]] = {
    "coding": coding, "fanout": fanout, "chat": chat, "tenants": tenants}


def live_working_set(trace: list[TraceRequest]) -> int:
    """The peak number of distinct blocks held by the sessions in progress: a session holds the blocks of its
    latest request from its first request to its last (a request without a session holds its own while it
    runs), and a block several of them hold counts once. The cache that holds this much keeps every session
    that is under way whole."""
    last = last_requests(trace)
    held: Counter[int] = Counter()
    context: dict[str, tuple[int, ...]] = {}
    peak = 0
    for n, r in enumerate(trace):
        old = context.pop(r.session_id, ()) if r.session_id else ()
        held.update(r.hash_ids)
        held.subtract(old)
        for b in set(old) - set(r.hash_ids):
            if held[b] <= 0:
                del held[b]
        peak = max(peak, len(held))
        if r.session_id and last[r.session_id] != n:
            context[r.session_id] = r.hash_ids
        else:
            held.subtract(r.hash_ids)
            for b in set(r.hash_ids):
                if held[b] <= 0:
                    del held[b]
    return peak


def describe(trace: list[TraceRequest]) -> str:
    sessions = {r.session_id for r in trace}
    subs = {r.session_id for r in trace if r.parent_session_id}
    blocks = sum(len(r.hash_ids) for r in trace)
    return (f"{len(trace):,} requests, {len(sessions):,} sessions ({len(subs):,} of them sub-agents), "
            f"{sum(r.pause for r in trace):,} pauses, {sum(r.session_end for r in trace):,} ends, {blocks:,} blocks "
            f"({len({b for r in trace for b in r.hash_ids}):,} distinct), live working set "
            f"{live_working_set(trace):,} blocks")


def unsaid_ends(trace: list[TraceRequest]) -> int:
    """How many sessions end with nobody saying so (their last request pauses: a chat its user abandoned)."""
    return sum(not trace[n].session_end for n in last_requests(trace).values())


def every_end_known(trace: list[TraceRequest], capacity: int, hits: dict[str, dict[str, float]], unsaid: int) -> str:
    """A line under a capacity's table: the session-aware strategies with every session's end said, the
    ``unsaid`` ones a client cannot know too (:func:`~app.bench.trace.with_every_end`): what that information
    is worth, beside what ranking the signals that are given achieves."""
    from app.bench.sessions import SESSION_AWARE, gap_closed
    from app.sim import simulate

    lru, opt = hits[Eviction.LRU]["*"], hits[Eviction.BELADY]["*"]
    told = with_sessions(with_every_end(trace), 1.0)
    cells = []
    for name in SESSION_AWARE:
        h = simulate(told, 1, "round_robin", capacity, 0, eviction=name)["hit_rate"]
        gap = f", gap closed {gap_closed(h, lru, opt) * 100:.0f}%" if opt > lru else ""
        cells.append(f"{name} {h * 100:.1f}%{gap}")
    return (f"With every end said, the {unsaid:,} sessions nobody closes included (information no client has): "
            + "; ".join(cells) + ".\n")


def table(shapes: list[str], fractions: list[float], seed: int | None = None) -> str:
    from app.bench.sessions import capacity_table, measure

    t0, load0 = time.monotonic(), load_average()
    which = "its default size and seed" if seed is None else f"its default size, seed {seed}"
    parts = [(f"Each shape generated in memory (`app/bench/session_traces.py`, {which}), replayed "
             "through one cache per strategy as in the tables above; the capacities are fractions of the trace's "
             "live working set (the most distinct blocks the sessions in progress held at once). The columns say "
             "which share of the sessions' clients signal (their ids, pauses and ends; the others' requests carry "
             "no session id; `half, named`: they carry it and the pauses, never an end). Gap closed: (hit - lru) / "
             "(belady - lru).\n")]
    for shape in shapes:
        trace = SHAPES[shape](**({"seed": seed} if seed is not None else {}))
        lws = live_working_set(trace)
        parts.append(f"#### {shape}\n\n{describe(trace)}.\n")
        unsaid = unsaid_ends(trace)
        for f in fractions:
            cap = max(1, round(f * lws))
            hits = measure(trace, cap)
            parts.append(capacity_table(hits, f"{f:g}x live working set, {cap:,} blocks"))
            if unsaid:
                parts.append(every_end_known(trace, cap, hits, unsaid))
    parts.append(f"Took {time.monotonic() - t0:.0f} s; load average {load0} at the start, {load_average()} at "
                 "the end (the figures do not depend on it).")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.bench.session_traces", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write one shape's trace (Mooncake JSONL with session fields)")
    w.add_argument("--shape", required=True, choices=sorted(SHAPES))
    w.add_argument("--out", required=True)
    w.add_argument("--sessions", type=int, help="default: the shape's own")
    w.add_argument("--seed", type=int, help="default: the shape's own")
    t = sub.add_parser("table", help="the session-aware strategies vs LRU, duel and Belady on every shape")
    t.add_argument("--shapes", default=",".join(SHAPES))
    t.add_argument("--fractions", default="0.25,0.5,1", help="capacities, as fractions of the live working set")
    t.add_argument("--seed", type=int, help="every shape with this seed (default: each its own)")
    t.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md as it is")
    args = p.parse_args(argv)
    if args.cmd == "write":
        kw = {k: v for k, v in (("sessions", args.sessions), ("seed", args.seed)) if v is not None}
        trace = SHAPES[args.shape](**kw)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        dump_trace(trace, args.out)
        print(f"{args.shape}: {describe(trace)}; written to {args.out}")
        return 0
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape {unknown[0]!r}; choose from {', '.join(SHAPES)}")
    body = table(shapes, [float(x) for x in args.fractions.split(",")], args.seed)
    command = f"python -m app.bench.session_traces table --shapes {args.shapes} --fractions {args.fractions}" + (
        f" --seed {args.seed}" if args.seed is not None else "")
    publish(SECTION, command, body, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
