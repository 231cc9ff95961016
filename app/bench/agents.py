"""``kvmesh bench agents``: multi-step agents with tool pauses and sub-agents on the stack, with the agent hints
and without, and with one instance overloaded, sessions kept on it or moved.

    kvmesh bench agents [--tasks 6] [--steps 5] [--seed 7] [--rounds 1] [--scenarios hints,overload,order]
                        [--prefill-order arrival|least_work] [--no-write]

The stack: 2 role-both instances of the default model (1 thread each) whose device KV (``ENGINE``) is smaller
than the agents' working set, a host tier and the pool behind them (``POOL``), session-aware eviction in both.

The workload (``workload``, fixed seed): each task is one of two agent kinds (its system prompt, shared by every
task of that kind), its own instructions, then steps; after every step but the last a tool runs: a search, a test
run or a build, each with a lognormal duration around its own median (heavy-tailed, capped at 30 s), and its
output joins the context of the next step. Every other task forks sub-agents after its second step: each starts
from the parent's context plus its own instructions, runs two steps with tool pauses, and the parent resumes once
all are back, with their results in its context. Responses are forced tool calls (the response format), the last
step's a short answer; each response joins the context as its token ids (``return_token_ids``), before the
tool's output.

``hints``: the same workload on a fresh stack per run, the arms one after the other in the order A B C C B A
(``--rounds`` times: a drift in the machine's load weighs on every arm alike), each arm's runs pooled. The arms do not
run at the same time: two stacks side by side put four one-thread engines on this machine's two cores, and every
resumed step's TTFT became queueing behind the other stack (16-18 s at p50), which no hint can remove.
"without hints": requests carry no session fields (routing is cache-aware only, eviction ranks as its base
strategies: ``duel`` on the engines, LRU in the pool). "without hints, default eviction": the same on the eviction
an install runs unless told otherwise (LRU on the engines' tiers and in the pool), what a client that sends no
hints meets on a stack set up without them. "with hints": every request carries its ``session_id`` (sub-agents
their ``parent_session_id``), the pause its tool will take as the harness knows it (``session_pause_s``: the tool
kind's median),
``session_retention: demote`` before a long tool (a build; the device goes to the other agents meanwhile) and the
last step's ``session_end``.

``order``: with hints, the engines' ``prefill_order`` ``arrival`` against ``least_work`` (a prompt whose context
is cached goes before a long cold one that came shortly before it), the arms in the same order.

``overload``: with hints, the two arms in the same order, while a hog streams long prompts straight into instance
both-0 (its Decode RPC, as a router would, so the router sees that instance's queue only through its heartbeats):
"keep" leaves every session on its instance however loaded (``session_overload`` 1000 and no margin the cost model
could beat), "move" lets it go to the other one (the defaults: sticky until saturated, by the queue or by the cost
model's estimate; its KV follows through the pool).

Reported for the resumed steps (every step after an agent's first): TTFT p50 / p90 at the client (the arms'
ratio with a 95% interval from drawing each arm's runs again with replacement: a run, not a step, is what varies
from sitting to sitting), the share of their prompt tokens served from cache, the blocks warmed back from the host
tier before a step returned (prefetched, then used or wasted) and the MB fetched from the pool ahead of a request
and by requests, the router's session placements (resumed: a paused session's instance told to warm its KV at once;
moved; forked: a sub-agent started where its parent ran), and the eviction gap: the cached share an offline
optimum would have served on the same request stream (Belady over the fleet's device blocks, and an unbounded
cache), from the prompts as sent.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import re
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from kvmesh.contracts.keys import block_keys
from kvmesh.contracts.names import Eviction, PrefillOrder
from kvmesh.routing.hits import belady_hits, infinite_cache_hits

from app.bench.report import load_average, markdown_table, publish
from app.bench.stats import RequestRecord, percentile

SECTION = "Agents on the stack"
SECTION_OVERLOAD = "Agents on the stack, one instance overloaded"
SECTION_ORDER = "Agents on the stack: least work first vs arrival"
DEFAULTS_ARM = "without hints, default eviction (lru)"
VOCAB = 49152  # SmolLM2's
BLOCK = 16
TOOL_CALL = '<tool_call>{"name": "run", "arguments": {}}</tool_call>'
ENGINE: dict[str, Any] = {"threads": 1, "num_blocks": 64, "host_cache_mb": 16, "eviction": "session_duel",
                          "session_pause_s": 3.0, "prefill_order": str(PrefillOrder.ARRIVAL)}
POOL = {"pool_capacity_mb": 64, "pool_eviction": "session"}
# a tool kind: its median seconds and the spread of log(duration); how often an agent calls it
TOOLS = {"search": (1.5, 0.5, 0.5), "tests": (4.0, 0.4, 0.35), "build": (10.0, 0.3, 0.15)}
LONG_TOOL_S = 8.0  # a tool announced at least this long: the harness lets the session's KV move down meanwhile
MAX_TOOL_S = 30.0


@dataclass(frozen=True)
class Step:
    added: tuple[int, ...]   # the tokens this step adds to the context (its instructions, or the tool output)
    tool: str                # the tool run after it ("" after the last)
    tool_s: float            # how long that run takes
    last: bool


@dataclass(frozen=True)
class Agent:
    name: str
    steps: tuple[Step, ...]
    fork_after: int = -1                      # the step after which it forks its sub-agents (-1: none)
    children: tuple[Agent, ...] = ()
    start_s: float = 0.0


def workload(tasks: int = 6, steps: int = 5, seed: int = 7, subagents: int = 2, preamble: int = 256,
             instructions: int = 96, tool_output: int = 64) -> tuple[list[tuple[int, ...]], list[Agent]]:
    """The system prompts (one per agent kind) and ``tasks`` agent tasks started 2 s apart (every other one
    forking ``subagents`` sub-agents after its second step)."""
    rng = random.Random(seed)

    def ids(k: int) -> tuple[int, ...]:
        return tuple(rng.randrange(100, VOCAB - 100) for _ in range(k))

    def tool() -> tuple[str, float]:
        kinds = list(TOOLS)
        kind = rng.choices(kinds, [TOOLS[k][2] for k in kinds])[0]
        median, sigma, _ = TOOLS[kind]
        return kind, min(MAX_TOOL_S, rng.lognormvariate(math.log(median), sigma))

    def plan(name: str, n: int, first: tuple[int, ...]) -> tuple[Step, ...]:
        out = []
        for s in range(n):
            last = s == n - 1
            kind, secs = ("", 0.0) if last else tool()
            out.append(Step(first if s == 0 else ids(tool_output), kind, secs, last))
        return tuple(out)

    systems = [ids(preamble), ids(preamble)]
    agents = []
    for t in range(tasks):
        name = f"task{t}"
        forks = t % 2 == 1 and steps > 2
        children = tuple(Agent(f"{name}.sub{c}", plan(f"{name}.sub{c}", 2, ids(instructions // 2)))
                         for c in range(subagents)) if forks else ()
        agents.append(Agent(name, plan(name, steps, ids(instructions)), 1 if forks else -1, children, 2.0 * t))
    return systems, agents


@dataclass
class Sent:
    """One request as sent: what the optimum replays, and its record (resumed steps are counted)."""

    prompt: tuple[int, ...]
    record: RequestRecord
    resumed: bool


@dataclass
class Run:
    mode: str
    sent: list[Sent] = field(default_factory=list)
    # loaded / used / wasted blocks warmed from the host tier, both instances; pool_ahead: blocks warmed from the
    # pool before a request (RESUME, due), pool_bytes: every byte fetched from the pool (ahead and at requests)
    prefetch: dict[str, int] = field(default_factory=dict)
    placements: dict[str, int] = field(default_factory=dict)  # the router's: resumed / moved / forked
    block_bytes: int = 0
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def resumed(self) -> list[RequestRecord]:
        return [s.record for s in self.sent if s.resumed and not s.record.error]


HINT_SETS = ("none", "ids", "full")  # no session fields; session_id and session_end only; every agent hint


def body(prompt: tuple[int, ...], step: Step, agent: Agent, parent: str, hints: str) -> dict[str, Any]:
    # the forced tool call is 43 tokens under the grammar: a smaller budget cuts it ("length"), and a cut call is
    # no pause
    # return_token_ids: the response joins the next step's context as the tokens the engine computed
    out: dict[str, Any] = {"prompt": list(prompt), "max_tokens": 48, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}, "return_token_ids": True}
    if step.last:
        out.update(ignore_eos=True, max_tokens=4)
    else:
        out["guided_choice"] = [TOOL_CALL]
    if hints != "none":
        out["session_id"] = agent.name
        if step.last:
            out["session_end"] = True
    if hints == "full":
        if parent:
            out["parent_session_id"] = parent
        if not step.last:
            announced = TOOLS[step.tool][0]  # the harness knows the kind's usual time, not this run's
            out["session_pause_s"] = announced
            if announced >= LONG_TOOL_S:
                out["session_retention"] = "demote"
    return out


async def drive(url: str, systems: list[tuple[int, ...]], agents: list[Agent], hints: str) -> list[Sent]:
    import aiohttp

    from app.bench.serve import stream_request

    sent: list[Sent] = []

    async def run_agent(http: aiohttp.ClientSession, agent: Agent, context: tuple[int, ...], parent: str = "",
                        delay: float = 0.0) -> tuple[int, ...]:
        await asyncio.sleep(delay)
        for n, step in enumerate(agent.steps):
            context = context + step.added
            rec = RequestRecord(f"{agent.name}/{n}")
            sent.append(Sent(context, rec, n > 0))
            await stream_request(http, f"{url}/v1/completions", body(context, step, agent, parent, hints), rec,
                                 600.0, {})
            context = context + tuple(rec.token_ids)  # the model's response, as an agent's transcript keeps it
            if n == agent.fork_after:
                results = await asyncio.gather(*(run_agent(http, c, context, agent.name) for c in agent.children))
                context = context + tuple(t for r in results for t in r[-16:])  # each sub-agent's result
            await asyncio.sleep(step.tool_s)
        return context

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        await asyncio.gather(*(run_agent(http, a, systems[i % len(systems)], delay=a.start_s)
                               for i, a in enumerate(agents)))
    return sent


class Hog:
    """Long prompts streamed straight into one instance's Decode RPC (as a router would call it, with a router's
    mesh identity), ``streams`` at a time, until stopped: that instance is overloaded, and the router learns it
    only from its heartbeats."""

    def __init__(self, stack: Any, instance: str, streams: int = 3, prompt_tokens: int = 700) -> None:
        self.stack, self.instance, self.streams, self.prompt_tokens = stack, instance, streams, prompt_tokens
        self.tls = stack.mesh_settings("router", "hog")  # issued once, here: the threads only read the files
        self.stop = threading.Event()
        self.served = 0
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(streams)]

    def __enter__(self) -> Self:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _loop(self, i: int) -> None:
        from kvmesh import tls
        from kvmesh.contracts.sampling import SamplingParams, sampling_to_proto
        from kvmesh.proto.v1 import worker_pb2, worker_pb2_grpc

        rng = random.Random(100 + i)
        address = self.stack.service(self.instance).grpc_address
        with tls.channel(address, cfg=self.tls) as ch:
            stub = worker_pb2_grpc.DecodeStub(ch)
            n = 0
            while not self.stop.is_set():
                prompt = [rng.randrange(100, VOCAB - 100) for _ in range(self.prompt_tokens)]
                work = worker_pb2.WorkRequest(request_id=f"hog.{i}.{n}", prompt_token_ids=prompt,
                                              sampling=sampling_to_proto(SamplingParams(max_tokens=48,
                                                                                        ignore_eos=True)))
                try:
                    for _ in stub.Decode(worker_pb2.DecodeRequest(work=work, prefill_locally=True), timeout=300):
                        pass
                    self.served += 1
                except Exception as e:  # noqa: BLE001 - a refused or cut hog request only lightens the load
                    if not self.stop.is_set():
                        time.sleep(0.5)
                    del e
                n += 1


def _metric(text: str, name: str, label: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(label)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def run(mode: str, systems: list[tuple[int, ...]], agents: list[Agent], hints: str, overload: int | None = None,
        hog: bool = False, engine: dict[str, Any] | None = None, pool: dict[str, Any] | None = None) -> Run:
    from app.launcher import Stack, StackOptions

    result = Run(mode)
    # keep: neither a queue (session_overload) nor an estimate (session_move_margin_s) moves a session
    router = {"session_overload": overload, "session_move_margin_s": 1e6 if overload >= 1000 else 0.25} \
        if overload is not None else {}
    opts = StackOptions.local(f"agents{abs(hash(mode)) % 10_000}", prefill=0, decode=0, both=2, pool=True,
                              settings={"engine": {**ENGINE, **(engine or {})}, "cachesvc": {**POOL, **(pool or {})},
                                        "router": router})
    with tempfile.TemporaryDirectory(prefix="kvmesh-agents-") as d:
        stack = Stack(Path(d), opts)
        stack.start()
        try:
            hogging = Hog(stack, "both-0") if hog else None
            if hogging is not None:
                hogging.__enter__()
                time.sleep(3.0)  # its load reaches the router's view through a heartbeat or two
            t0 = time.monotonic()
            try:
                result.sent = asyncio.run(drive(stack.router_http, systems, agents, hints))
            finally:
                if hogging is not None:
                    hogging.__exit__()
            result.wall_s = time.monotonic() - t0
            result.errors = [f"{s.record.key}: {s.record.error}" for s in result.sent if s.record.error]
            time.sleep(1.5)  # the last counts reach the metrics
            for name in ("both-0", "both-1"):
                text = _scrape(stack.service(name).endpoints["metrics"])
                for o in ("loaded", "used", "wasted"):
                    result.prefetch[o] = result.prefetch.get(o, 0) + int(
                        _metric(text, "kvmesh_worker_kv_prefetch_blocks_total", f'{{outcome="{o}"}}'))
                result.block_bytes = int(_metric(text, "kvmesh_worker_kv_block_bytes"))
                ahead = sum(_metric(text, "kvmesh_worker_session_warm_blocks_total", f'{{trigger="{t}"}}')
                            for t in ("resume", "due"))
                fetched = _metric(text, "kvmesh_worker_kv_transfer_bytes_total", '{direction="pool_fetch"}')
                result.prefetch["pool_ahead"] = result.prefetch.get("pool_ahead", 0) + int(ahead)
                result.prefetch["pool_bytes"] = result.prefetch.get("pool_bytes", 0) + int(fetched)
            text = _scrape(stack.router_metrics)
            result.placements = {k: int(_metric(text, "kvmesh_router_session_placements_total", f'{{kind="{k}"}}'))
                                 for k in ("resumed", "moved", "forked")}
        finally:
            stack.stop()
    return result


def optimum(r: Run, capacity: int) -> tuple[int, int, int]:
    """The resumed steps' prompt tokens an offline optimum would have served from cache on ``r``'s request
    stream, in the order sent: Belady over ``capacity`` blocks, and an unbounded cache; and their prompt tokens.
    Each request leaves its prompt's and its response's blocks (the next step's prompt holds the response)."""
    stream = [(block_keys(0, [*s.prompt, *s.record.token_ids], BLOCK), len(s.prompt)) for s in r.sent]
    resumed = [i for i, s in enumerate(r.sent) if s.resumed]
    bel, inf = belady_hits(stream, BLOCK, capacity), infinite_cache_hits(stream, BLOCK)
    return (sum(bel[i] for i in resumed), sum(inf[i] for i in resumed),
            sum(len(r.sent[i].prompt) for i in resumed))


def pooled(runs: list[Run]) -> Run:
    """One arm's runs as one: their requests, counters and times together (each run's stream is its own, so
    the optimum is taken per run, not over the concatenation: see ``row``)."""
    out = Run(runs[0].mode, block_bytes=runs[0].block_bytes)
    for r in runs:
        out.sent += r.sent
        out.errors += r.errors
        out.wall_s += r.wall_s
        for counts, add in ((out.prefetch, r.prefetch), (out.placements, r.placements)):
            for k, v in add.items():
                counts[k] = counts.get(k, 0) + v
    return out


def abba(arms: list[str], rounds: int) -> list[str]:
    """The order the arms run in: A B B A (three arms: A B C C B A), ``rounds`` times (a linear drift in the
    machine's load falls on every arm alike)."""
    return [*arms, *reversed(arms)] * rounds


def row(runs: list[Run]) -> dict[str, Any]:
    r = pooled(runs)
    recs = r.resumed
    ttfts = [x.ttft_s for x in recs if x.ttft_s is not None]
    prompt = sum(x.prompt_tokens or 0 for x in recs)
    cached = sum(x.cached_tokens or 0 for x in recs)
    mb = r.block_bytes / 2**20
    hits = [optimum(x, 2 * ENGINE["num_blocks"]) for x in runs]
    total = sum(h[2] for h in hits) or 1
    belady, unbounded = sum(h[0] for h in hits) / total, sum(h[1] for h in hits) / total
    return {"run": r.mode, "runs": len(runs), "resumed steps": len(recs),
            "TTFT p50 s": f"{percentile(ttfts, 50):.2f}" if ttfts else "-",
            "TTFT p90 s": f"{percentile(ttfts, 90):.2f}" if ttfts else "-",
            "cached share": f"{cached / prompt:.1%}" if prompt else "-",
            "optimum (device / unbounded)": f"{belady:.1%} / {unbounded:.1%}",
            "prefetched MB (used / wasted)": f"{r.prefetch.get('loaded', 0) * mb:.1f} "
                                             f"({r.prefetch.get('used', 0) * mb:.1f} / "
                                             f"{r.prefetch.get('wasted', 0) * mb:.1f})",
            "from the pool MB (ahead / at the request)":
                f"{r.prefetch.get('pool_ahead', 0) * mb:.1f} / "
                f"{max(0.0, r.prefetch.get('pool_bytes', 0) / 2**20 - r.prefetch.get('pool_ahead', 0) * mb):.1f}",
            "resumed / moved / forked": "{resumed} / {moved} / {forked}".format(**{
                k: r.placements.get(k, 0) for k in ("resumed", "moved", "forked")}),
            "wall s": f"{r.wall_s / len(runs):.0f}", "errors": len(r.errors)}


COLUMNS = ["run", "runs", "resumed steps", "TTFT p50 s", "TTFT p90 s", "cached share", "optimum (device / unbounded)",
           "prefetched MB (used / wasted)", "from the pool MB (ahead / at the request)", "resumed / moved / forked",
           "wall s", "errors"]


def _ttfts(runs: list[Run]) -> list[float]:
    return [x.ttft_s for x in pooled(runs).resumed if x.ttft_s is not None]


def ratio(arms: list[list[Run]], q: int) -> float | None:
    """The second arm's resumed steps' TTFT ``q``-th percentile over the first's, each arm's runs pooled."""
    a, b = (_ttfts(runs) for runs in arms)
    return percentile(b, q) / percentile(a, q) if a and b and percentile(a, q) else None


def interval(arms: list[list[Run]], q: int, draws: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """The 95% interval of :func:`ratio` when each arm's runs are drawn again with replacement (a bootstrap over
    runs, not steps: the steps of one run share its placements and the machine's moment, so a run is the unit
    that varies). None with one run an arm."""
    if min(len(runs) for runs in arms) < 2:
        return None
    rng = random.Random(seed)
    out = sorted(r for _ in range(draws)
                 if (r := ratio([rng.choices(runs, k=len(runs)) for runs in arms], q)) is not None)
    return (out[int(0.025 * len(out))], out[int(0.975 * len(out)) - 1]) if out else None


def _ratio(arms: list[list[Run]], q: int) -> str:
    r = ratio(arms, q)
    if r is None:
        return "-"
    span = interval(arms, q)
    return f"{r:.2f}x" + (f" (95% interval over runs {span[0]:.2f}-{span[1]:.2f}x)" if span else "")


def describe(tasks: int, steps: int, rounds: int, load0: str, order: str, arms: int = 2) -> str:
    """The run's setup in words; ``order``: the engines' prefill order in words; ``arms``: how many take turns."""
    tools = ", ".join(f"{k} ~{m:g} s ({w:.0%})" for k, (m, _, w) in TOOLS.items())
    return (f"{tasks} agent tasks of {steps} steps, started 2 s apart, two agent kinds (a 256-token system prompt "
            f"each), 96 tokens of instructions, then a step's response (its token ids) and 64 tokens of tool output "
            f"join the context; tools: {tools}, lognormal, capped "
            f"at {MAX_TOOL_S:g} s; every other task forks 2 sub-agents of 2 steps after its second step. Stack: 2 "
            f"role-both instances of the default model (1 thread each, {ENGINE['num_blocks']} device blocks = "
            f"{ENGINE['num_blocks'] * BLOCK} tokens each, {ENGINE['host_cache_mb']} MB host tier, a "
            f"{POOL['pool_capacity_mb']} MB pool; eviction {ENGINE['eviction']} / pool {POOL['pool_eviction']}"
            + (f", in the default-eviction arm {Eviction.LRU} / {Eviction.LRU}" if arms > 2 else "")
            + f"; prefill order {order}). A fresh stack per run; the arms one after the other in the order "
            f"{' '.join(abba(list('ABC'[:arms]), 1))}, {rounds} time(s), each arm's {2 * rounds} runs pooled. "
            f"Resumed steps: every step after an agent's first. Optimum: each "
            f"run's stream through an offline cache (Belady over the fleet's {2 * ENGINE['num_blocks']} device "
            f"blocks / unbounded). Load average {load0} at the start, {load_average()} at the end (the machine is "
            f"shared: TTFTs move with it).")


def in_turn(arms: list[tuple[str, dict[str, Any]]], rounds: int) -> list[list[Run]]:
    """Each arm's ``run`` on a fresh stack, one at a time in the order ``abba``: every arm's runs, in ``arms``'
    order."""
    kw = dict(arms)
    out: dict[str, list[Run]] = {mode: [] for mode, _ in arms}
    for mode in abba([mode for mode, _ in arms], rounds):
        out[mode].append(run(mode, **kw[mode]))
    return [out[mode] for mode, _ in arms]


def _errors(arms: list[list[Run]]) -> str:
    errors = [e for runs in arms for r in runs for e in r.errors][:5]
    return "\n\nErrors: " + "; ".join(errors) if errors else ""


def bench_hints(tasks: int, steps: int, seed: int, rounds: int, order: str = str(PrefillOrder.ARRIVAL)) -> str:
    systems, agents = workload(tasks, steps, seed)
    load0 = load_average()
    common = {"systems": systems, "agents": agents, "engine": {"prefill_order": order}}
    defaults = {**common, "hints": "none", "engine": {"prefill_order": order, "eviction": str(Eviction.LRU)},
                "pool": {"pool_eviction": str(Eviction.LRU)}}
    without, lru, hinted = in_turn([("without hints", {**common, "hints": "none"}),
                                    (DEFAULTS_ARM, defaults),
                                    ("with hints", {**common, "hints": "full"})], rounds)
    return (describe(tasks, steps, rounds, load0, order, arms=3) + "\n\n"
            + markdown_table([row(r) for r in (without, lru, hinted)], COLUMNS)
            + f"\n\nWith hints / without: resumed steps' TTFT p50 {_ratio([without, hinted], 50)}, p90 "
            f"{_ratio([without, hinted], 90)}. With hints / without hints on the default eviction: p50 "
            f"{_ratio([lru, hinted], 50)}, p90 {_ratio([lru, hinted], 90)}."
            + _errors([without, lru, hinted]))


def bench_overload(tasks: int, steps: int, seed: int, rounds: int, order: str = str(PrefillOrder.ARRIVAL)) -> str:
    systems, agents = workload(tasks, steps, seed)
    load0 = load_average()
    common = {"systems": systems, "agents": agents, "hints": "full", "hog": True,
              "engine": {"prefill_order": order}}
    arms = in_turn([("keep (session_overload 1000)", {**common, "overload": 1000}),
                    ("move (session_overload 2)", {**common, "overload": 2})], rounds)
    return (describe(tasks, steps, rounds, load0, order) + " With hints; a hog streams 3 prompts of 700 tokens at a "
            "time (48 tokens out each) straight into both-0's Decode RPC for the whole of each run.\n\n"
            + markdown_table([row(r) for r in arms], COLUMNS)
            + f"\n\nMove / keep: resumed steps' TTFT p50 {_ratio(arms, 50)}, p90 {_ratio(arms, 90)}."
            + _errors(arms))


def bench_order(tasks: int, steps: int, seed: int, rounds: int) -> str:
    systems, agents = workload(tasks, steps, seed)
    load0 = load_average()
    common = {"systems": systems, "agents": agents, "hints": "full"}
    arms = in_turn([(f"prefill order {o}", {**common, "engine": {"prefill_order": str(o)}}) for o in PrefillOrder],
                   rounds)
    return (describe(tasks, steps, rounds, load0, order="each arm's") + " With hints.\n\n"
            + markdown_table([row(r) for r in arms], COLUMNS)
            + f"\n\nleast_work / arrival: resumed steps' TTFT p50 {_ratio(arms, 50)}, p90 {_ratio(arms, 90)}."
            + _errors(arms))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench agents", description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=6)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--scenarios", default="hints,overload",
                   help="comma-separated: hints, overload, order (with hints: prefill order arrival vs least_work)")
    p.add_argument("--rounds", type=int, default=1, help="A B B A rounds: each arm runs 2x this many times")
    p.add_argument("--prefill-order", choices=[str(o) for o in PrefillOrder], default=str(PrefillOrder.ARRIVAL),
                   help="the engines' engine.prefill_order in every arm (a run with least_work is written to "
                        "sections of its own)")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md as it is")
    args = p.parse_args(argv)
    chosen = {s.strip() for s in args.scenarios.split(",") if s.strip()}
    if not chosen or chosen - {"hints", "overload", "order"}:
        p.error("--scenarios: choose from hints, overload, order")
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    base = f"kvmesh bench agents --tasks {args.tasks} --steps {args.steps} --seed {args.seed} --rounds {args.rounds}"
    ordered, suffix = base, ""  # the order scenario's arms set the order themselves
    if args.prefill_order != PrefillOrder.ARRIVAL:
        ordered += f" --prefill-order {args.prefill_order}"
        suffix = f", prefill order {args.prefill_order}"
    if "hints" in chosen:
        publish(SECTION + suffix, f"{ordered} --scenarios hints",
                bench_hints(args.tasks, args.steps, args.seed, args.rounds, args.prefill_order),
                write=not args.no_write)
    if "order" in chosen:
        publish(SECTION_ORDER, f"{base} --scenarios order",
                bench_order(args.tasks, args.steps, args.seed, args.rounds), write=not args.no_write)
    if "overload" in chosen:
        publish(SECTION_OVERLOAD + suffix, f"{ordered} --scenarios overload",
                bench_overload(args.tasks, args.steps, args.seed, args.rounds, args.prefill_order),
                write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
