"""``kvmesh bench load --faults``: the load test with processes killed (SIGKILL) or frozen (SIGSTOP) at set
times during the run.

    kvmesh bench load --faults decode-0@20,prefill-0@40,router-1@60,cachesvc@80,nats@100 --duration 120
                      [--clients 16] [--decode 2] [--routers 2] [--restart-after 8] [--max-tokens 16]
    kvmesh bench load --faults decode-0@20:stop30 ...      (SIGSTOP decode-0 at 20 s, SIGCONT at 50 s)

A stack of 1 prefill, ``--decode`` decode instances and ``--routers`` router replicas; closed-loop streaming
clients of the SDK (``AsyncKvmeshClient``, every router's address, each client starting at another one), so a
client fails over when its router dies and resumes a cut stream on the other one. Before the load every prompt is
answered once, greedy and alone: the reference. At each time of the schedule a service is SIGKILLed (``nats``:
the NATS server), and started again ``--restart-after`` seconds later (a supervisor's restart; cachesvc, NATS and
a router on the address they had); or, written ``SERVICE@SECONDS:stopSECONDS``, SIGSTOPped for that long and
SIGCONTed (no restart: a process that hangs whole, heartbeats and all). Reported: requests lost (ended in an error,
after the client's failover and resume), outputs that differ from their reference (token ids or text), the
router's migrations, and TTFT / ITL p99 of the load before the first fault against each fault's recovery window
(from the signal until 5 s after the service serves again). Per fault, too: what the victim's engine held just
before the signal (its ``/metrics`` queue depth), the streams the routers moved off it (their ``router.migrate``
spans in the stack's span file), how those ended, and how long after the signal each was re-dispatched and got
its next token, against the routers' limits (``instance_timeout_s``, ``inter_token_timeout_s``).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.client import AsyncKvmeshClient, KvmeshError, Overloaded
from kvmesh.telemetry.spans import SpanRecord, read_spans, trace_file

from app.bench.report import load_average, markdown_table, write_section
from app.bench.stats import percentile
from app.bench.workloads import SHORT_PROMPTS as PROMPTS
from app.bench.workloads import prose
from app.launcher import Stack, StackOptions

SECTION = "Load under faults"
SETTLE_S = 5.0  # a fault's recovery window ends this long after the service serves again
SETTLED_S = 30.0  # a service down longer than this: its last stretch down is reported on its own
CONTEXTS = 8  # --system-words: the long system prompts requests take in turn (one a prompt)


@dataclass(frozen=True)
class Fault:
    service: str           # a service of the stack (decode-0, router-1, cachesvc, ...) or "nats"
    at_s: float            # seconds into the load
    freeze_s: float = 0.0  # > 0: SIGSTOP for this long, then SIGCONT; 0: SIGKILL, then a restart

    def __str__(self) -> str:
        return f"SIGSTOP {self.service} for {self.freeze_s:g} s" if self.freeze_s else f"kill -9 {self.service}"


FORMAT = "SERVICE@SECONDS or SERVICE@SECONDS:stopSECONDS (e.g. decode-0@20, decode-0@20:stop30)"


def parse_schedule(text: str) -> list[Fault]:
    """``SERVICE@SECONDS[:stopSECONDS],...`` in time order; ValueError naming what to fix."""
    faults = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        service, sep, when = part.partition("@")
        at, colon, how = when.partition(":")
        at_s = _seconds(at)
        freeze_s = _seconds(how.removeprefix("stop")) if how.startswith("stop") else -1.0
        if not sep or not service or at_s < 0:
            raise ValueError(f"--faults: {part!r} is not {FORMAT}")
        if colon and freeze_s <= 0:
            raise ValueError(f"--faults: {part!r}: after the ':' write stop and the freeze's seconds, > 0 (e.g. "
                             f"{service}@{at}:stop30)")
        if colon and service == "nats":
            raise ValueError(f"--faults: {part!r}: only the stack's own services freeze (nats@SECONDS kills NATS)")
        faults.append(Fault(service, at_s, freeze_s if colon else 0.0))
    if not faults or [f.at_s for f in faults] != sorted(f.at_s for f in faults):
        raise ValueError(f"--faults: give at least one {FORMAT}, in time order")
    return faults


def _seconds(text: str) -> float:
    """``text`` as seconds; -1 when it is not a number."""
    try:
        value = float(text)
    except ValueError:
        return -1.0
    return value if math.isfinite(value) else -1.0


@dataclass
class Outcome:
    """One request as its client saw it: when it started and its chunks arrived (seconds into the load)."""

    prompt: str
    start_s: float
    chunk_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    error: str = ""
    rejected: int = 0       # 429s before it was admitted (the client backs off and sends it again)
    request_ids: set[str] = field(default_factory=set)  # the routers' ids (a stream resumed elsewhere has two)
    chunk_n: list[int] = field(default_factory=list)    # the tokens received by each chunk's arrival
    prompt_tokens: int = 0  # from the last chunk's usage
    cached_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] - self.start_s if self.chunk_s else None

    def after(self, carried: int) -> float | None:
        """When the first token past the first ``carried`` arrived (a migration's seam; None: none did)."""
        return next((t for t, n in zip(self.chunk_s, self.chunk_n, strict=True) if n > carried), None)


@dataclass(frozen=True)
class Held:
    """What the victim's engine held just before the signal (its ``kvmesh_worker_queue_depth``)."""

    running: int
    waiting: int

    def __str__(self) -> str:
        return f"{self.running} running, {self.waiting} waiting"


@dataclass(frozen=True)
class Moved:
    """A stream a router moved off an instance (its ``router.migrate`` span): when, and why."""

    request_id: str
    instance: str
    wall_s: float   # the span's start (time.time()): the re-dispatch, once a migration slot was free
    reason: str
    carried: int    # the tokens the client had before the seam


@dataclass
class Window:
    """A fault's recovery window: the signal, the moment the service served again, and the window's end."""

    fault: Fault
    hit_s: float
    back_s: float = float("nan")
    wall_s: float = 0.0         # the signal, as time.time() (what the span file's clock reads)
    held: Held | None = None    # an engine's queue just before the signal

    @property
    def end_s(self) -> float:
        return self.back_s + SETTLE_S


@dataclass(frozen=True)
class Limits:
    """The routers' limits on a silent or stalled instance (``[router]`` settings)."""

    instance_timeout_s: float      # no heartbeat for this long: the instance is dropped, its streams move
    inter_token_timeout_s: float   # no token and no engine step for this long: the stream moves (the watchdog)


@dataclass
class FaultRun:
    outcomes: list[Outcome]
    windows: list[Window]
    references: dict[str, tuple[list[int], str]]
    migrations: float
    duration_s: float
    load_before: str
    load_after: str
    moved: list[Moved]
    limits: Limits
    max_num_seqs: int   # the engines' cap on running sequences
    prefill: int = 1
    cachesvc: int = 1   # shards
    system_words: int = 0
    pool_copies: int = 1
    prefill_blocks: int = 0  # each prefill (and both) instance's KV blocks (0: the engine's default)
    both: int = 0
    repair: bool = True  # a restarted cachesvc shard refills its pool from the other copies
    from_bus: bool = False  # engines and routers find the shards by their beats (cachesvc_address "nats")

    def wrong(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.error and (o.tokens, o.text) != self.references[o.prompt]]

    def lost(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error]

    def moved_off(self, w: Window) -> list[Moved]:
        """The streams moved off the window's victim from its signal to the window's end."""
        until = w.wall_s + (w.end_s - w.hit_s)
        return [m for m in self.moved if m.instance == w.fault.service and w.wall_s <= m.wall_s < until]


def contexts(system_words: int) -> list[str]:
    """The system prompts the load's requests take in turn (none without ``system_words``): a few long ones, so
    requests share prefixes the pool can serve to an instance that lacks them."""
    if not system_words:
        return [""]
    rng = random.Random(0)
    return [f"You are assistant {i} of a small town library. Rules and notes follow. " + prose(rng, system_words)
            for i in range(CONTEXTS)]


def messages(prompt: str, system: str) -> list[dict[str, str]]:
    return [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": prompt}]


async def _references(targets: list[str], max_tokens: int, systems: list[str]) -> dict[str, tuple[list[int], str]]:
    async with AsyncKvmeshClient(targets, timeout_s=120) as client:
        out = {}
        for i, p in enumerate(PROMPTS):
            done = await client.complete(messages=messages(p, systems[i % len(systems)]), max_tokens=max_tokens,
                                         temperature=0)
            out[p] = (done.token_ids, done.text)
        return out


async def _clients(targets: list[str], clients: int, duration_s: float, max_tokens: int, t0: float,
                   outcomes: list[Outcome], systems: list[str]) -> None:
    """``clients`` closed-loop clients until ``duration_s`` (a request under way finishes); client i starts at
    router i mod n and fails over to the others."""
    counter = itertools.count()

    async def client(i: int) -> None:
        order = targets[i % len(targets):] + targets[:i % len(targets)]
        async with AsyncKvmeshClient(order, timeout_s=180, retries=8, backoff_s=0.2) as c:
            while time.monotonic() - t0 < duration_s:
                n = next(counter) % len(PROMPTS)
                prompt, system = PROMPTS[n], systems[n % len(systems)]
                o = Outcome(prompt, time.monotonic() - t0)
                outcomes.append(o)
                while True:
                    try:
                        async with c.generate(messages=messages(prompt, system), max_tokens=max_tokens,
                                              temperature=0) as stream:
                            async for chunk in stream:
                                if chunk.usage is not None:
                                    o.prompt_tokens = chunk.usage.prompt_tokens
                                    o.cached_tokens = chunk.usage.cached_tokens
                                o.chunk_s.append(time.monotonic() - t0)
                                o.tokens += chunk.token_ids
                                o.chunk_n.append(len(o.tokens))
                                o.request_ids.add(chunk.request_id)
                                o.text += chunk.text
                        break
                    except Overloaded:
                        if o.tokens:  # never after a token: the router refuses only at admission
                            o.error = "429 mid-stream"
                            break
                        o.rejected += 1
                        await asyncio.sleep(0.05)
                    except KvmeshError as e:
                        o.error = f"{type(e).__name__}: {e}"
                        break

    await asyncio.gather(*(client(i) for i in range(clients)))


async def _schedule(stack: Stack, faults: list[Fault], restart_after_s: float, t0: float,
                    windows: list[Window]) -> None:
    """Each fault at its time, whatever the others are doing (a restart may still be under way)."""
    loop = asyncio.get_running_loop()

    async def one(fault: Fault) -> None:
        await asyncio.sleep(max(0.0, t0 + fault.at_s - time.monotonic()))
        held = await loop.run_in_executor(None, _held, stack, fault.service)
        window = Window(fault, time.monotonic() - t0, wall_s=time.time(), held=held)
        windows.append(window)
        if fault.freeze_s:
            stack.freeze(fault.service)
            print(f"[{window.hit_s:6.1f} s] froze {fault.service}{_holding(held)}", flush=True)
            await asyncio.sleep(fault.freeze_s)
            stack.thaw(fault.service)
            window.back_s = time.monotonic() - t0
            print(f"[{window.back_s:6.1f} s] thawed {fault.service}", flush=True)
            return
        await loop.run_in_executor(None, stack.kill, fault.service)
        print(f"[{window.hit_s:6.1f} s] killed {fault.service}{_holding(held)}", flush=True)
        await asyncio.sleep(restart_after_s)
        await loop.run_in_executor(None, stack.restart, fault.service)
        window.back_s = time.monotonic() - t0
        print(f"[{window.back_s:6.1f} s] {fault.service} serves again", flush=True)

    await asyncio.gather(*(one(f) for f in faults))
    windows.sort(key=lambda w: w.hit_s)


def _held(stack: Stack, name: str) -> Held | None:
    """An engine's running and waiting sequences, from its /metrics (None for a service that is no engine)."""
    if name == "nats" or name.startswith("cachesvc") or not (url := stack.service(name).endpoints.get("metrics", "")):
        return None
    depth = 'kvmesh_worker_queue_depth{state="%s"}'
    try:
        return Held(int(_metric(url, depth % "running")), int(_metric(url, depth % "waiting")))
    except OSError:
        return None


def _holding(held: Held | None) -> str:
    return f" holding {held}" if held else ""


def _moved(spans: list[SpanRecord]) -> list[Moved]:
    return [Moved(s.request_id, str(s.attributes.get("kvmesh.migration.from", "")), s.start_ns / 1e9,
                  str(s.attributes.get("kvmesh.reason", "")), int(s.attributes.get("kvmesh.migration.tokens", 0)))
            for s in spans if s.name == "router.migrate"]


def run(faults: list[Fault], clients: int = 16, duration_s: float = 120.0, max_tokens: int = 16, decode: int = 2,
        routers: int = 2, restart_after_s: float = 8.0, state_dir: Path | None = None,
        max_num_seqs: int | None = None, prefill: int = 1, cachesvc: int = 1, system_words: int = 0,
        pool_copies: int = 1, prefill_blocks: int = 0, both: int = 0, repair: bool = True,
        from_bus: bool = False) -> FaultRun:
    engine = {"max_num_seqs": max_num_seqs} if max_num_seqs else {}
    systems = contexts(system_words)
    # small prefill caches: the prompts' prefixes are evicted and come back from the pool
    computing = [f"prefill-{i}" for i in range(prefill)] + [f"both-{i}" for i in range(both)]
    small = {name: {"KVMESH_ENGINE_NUM_BLOCKS": str(prefill_blocks)} for name in computing} if prefill_blocks else {}
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(state_dir or Path(tmp), StackOptions.local("faults", prefill=prefill, decode=decode, both=both,
                                                                 routers=routers, cachesvc=cachesvc,
                                                                 cachesvc_from_bus=from_bus,
                                                                 settings={"engine": engine,
                                                                           "cachesvc": {"pool_copies": pool_copies,
                                                                                        **({} if repair else
                                                                                           {"repair_mb_s": 0})}},
                                                                 instance_env=small))
        names = {"nats", *computing} | {f"decode-{i}" for i in range(decode)} | \
            ({f"router-{i}" for i in range(routers)} if routers > 1 else {"router"}) | \
            ({f"cachesvc-{i}" for i in range(cachesvc)} if cachesvc > 1 else {"cachesvc"})
        unknown = [f.service for f in faults if f.service not in names]
        if unknown:
            raise ValueError(f"--faults: no service {', '.join(unknown)} in this stack ({', '.join(sorted(names))})")
        stack.start(timeout_s=300)
        try:
            targets = [r.endpoints["grpc"] for r in stack.routers]
            refs = asyncio.run(_references(targets, max_tokens, systems))
            load_before = load_average()
            outcomes: list[Outcome] = []
            windows: list[Window] = []

            async def load_and_faults() -> float:
                t0 = time.monotonic()
                await asyncio.gather(_clients(targets, clients, duration_s, max_tokens, t0, outcomes, systems),
                                     _schedule(stack, faults, restart_after_s, t0, windows))
                return time.monotonic() - t0

            took = asyncio.run(load_and_faults())
            migrations = sum(_metric(r.endpoints["metrics"], 'kvmesh_router_migrations_total{outcome="migrated"}')
                             for r in stack.routers)
            load_after = load_average()
        finally:
            stack.stop()
        router = stack.cfg.router
        return FaultRun(outcomes, windows, refs, migrations, took, load_before, load_after,
                        _moved(read_spans(trace_file(stack.state_dir))),
                        Limits(router.instance_timeout_s, router.inter_token_timeout_s),
                        stack.cfg.engine.max_num_seqs, prefill, cachesvc, system_words, pool_copies,
                        prefill_blocks, both, repair, from_bus)


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))


def _p99(values: list[float]) -> str:
    return f"{percentile(values, 99) * 1e3:.0f}" if values else "-"


def _figures(outcomes: list[Outcome], inside: Callable[[float], bool]) -> dict[str, str | int]:
    """TTFT of the requests that started in the window, ITL of the gaps that ended in it, and the requests."""
    started = [o for o in outcomes if inside(o.start_s)]
    ttft = [o.ttft_s for o in started if o.ttft_s is not None and not o.error]
    itl = [b - a for o in outcomes for a, b in itertools.pairwise(o.chunk_s) if inside(b)]
    return {"requests": len(started), "lost": sum(bool(o.error) for o in started),
            "TTFT p99 ms": _p99(ttft), "ITL p99 ms": _p99(itl), "cached share": _cached(started)}


def _cached(outcomes: list[Outcome]) -> str:
    """The share of prompt tokens whose KV was reused, over the requests that finished."""
    done = [o for o in outcomes if not o.error and o.prompt_tokens]
    return f"{sum(o.cached_tokens for o in done) / sum(o.prompt_tokens for o in done):.1%}" if done else "-"


def report(res: FaultRun, clients: int, decode: int, routers: int, restart_after_s: float) -> str:
    wrong, lost = res.wrong(), res.lost()
    first = res.windows[0].hit_s if res.windows else res.duration_s
    before = _figures(res.outcomes, lambda t: t < first)
    rows = [{"window": f"before the first fault (0-{first:.0f} s)", **before,
             "TTFT p99 vs before": "1.00x", "ITL p99 vs before": "1.00x"}]
    for w in res.windows:
        fig = _figures(res.outcomes, lambda t, w=w: w.hit_s <= t < w.end_s)
        back = "SIGCONT" if w.fault.freeze_s else "back"
        rows.append({"window": f"{w.fault} at {w.hit_s:.0f} s, {back} at {w.back_s:.0f} s",
                     **fig, "TTFT p99 vs before": _ratio(fig["TTFT p99 ms"], before["TTFT p99 ms"]),
                     "ITL p99 vs before": _ratio(fig["ITL p99 ms"], before["ITL p99 ms"])})
        if w.back_s - w.hit_s > SETTLED_S:  # still down 30 s on: what the fleet settled to without it
            late = _figures(res.outcomes, lambda t, w=w: w.hit_s + SETTLED_S <= t < w.back_s)
            rows.append({"window": f"{w.fault}: its last {w.back_s - w.hit_s - SETTLED_S:.0f} s down "
                                   f"({SETTLED_S:g} s after the signal on)",
                         **late, "TTFT p99 vs before": _ratio(late["TTFT p99 ms"], before["TTFT p99 ms"]),
                         "ITL p99 vs before": _ratio(late["ITL p99 ms"], before["ITL p99 ms"])})
    done = [o for o in res.outcomes if not o.error]
    summary = [{"requests": len(res.outcomes), "completed": len(done), "lost": len(lost), "wrong outputs": len(wrong),
                "migrations": f"{res.migrations:.0f}", "429s (retried)": sum(o.rejected for o in res.outcomes),
                "tokens/s": f"{sum(len(o.tokens) for o in done) / max(res.duration_s, 1e-9):.1f}"}]
    victims = [_victim(res, w) for w in res.windows]
    lim = res.limits
    body = (f"{clients} closed-loop streaming clients (the SDK, every router's address; a client fails over and "
            f"resumes a cut stream on another router) for {res.duration_s:.0f} s against {_fleet(res, decode)} "
            f"(max_num_seqs {res.max_num_seqs} each), {routers} routers"
            f"{_shards(res)} (the real model, 1 thread "
            f"each); greedy, {len(PROMPTS)} short prompts{_systems(res.system_words)}, each answer compared "
            "with its reference taken alone "
            f"before the load (token ids and text). Each service of the schedule is "
            f"{_actions([w.fault for w in res.windows], restart_after_s)}; a fault's recovery "
            f"window runs from the signal until {SETTLE_S:g} s after the service serves again. Load average (1, 5, "
            f"15 min) {res.load_before} at the start, {res.load_after} at the end (the machine is shared).\n\n"
            + markdown_table(summary, list(summary[0])) + "\n\n"
            + markdown_table(rows, ["window", "requests", "lost", "TTFT p99 ms", "TTFT p99 vs before", "ITL p99 ms",
                                    "ITL p99 vs before", "cached share"]) + "\n\n"
            "Each fault's victim: what its engine held just before the signal (its /metrics), the streams the "
            "routers moved off it once it had sent them tokens (their `router.migrate` spans), how those ended, and "
            "how long after the signal each was dispatched again and its client got the first token past the seam "
            "(the client's clock: its loop runs every stream). The routers drop an instance silent for "
            f"instance_timeout_s ({lim.instance_timeout_s:g} s without a heartbeat) and move a stream that got no "
            "token while its instance showed no engine step for inter_token_timeout_s "
            f"({lim.inter_token_timeout_s:g} s, the inter-token watchdog).\n\n"
            + markdown_table(victims, list(victims[0]) if victims else []))
    return body


def _fleet(res: FaultRun, decode: int) -> str:
    parts = [f"{n} {role}" for role, n in (("prefill", res.prefill), ("decode", decode), ("both", res.both)) if n]
    return " + ".join(parts) + " instances"


def _shards(res: FaultRun) -> str:
    if res.cachesvc == 1:
        return ""
    copies = f"{res.pool_copies} cop{'y' if res.pool_copies == 1 else 'ies'} of each pooled block"
    if res.pool_copies > 1:
        copies += ", a restarted shard refilled from the others" if res.repair else ", no repair"
    small = f", {res.prefill_blocks} KV blocks a computing instance" if res.prefill_blocks else ""
    found = ", found by the engines and routers through their beats on NATS" if res.from_bus else ""
    return f" and {res.cachesvc} cachesvc shards ({copies}{small}{found})"


def _systems(words: int) -> str:
    return f", each after one of {CONTEXTS} system prompts of {words} words" if words else ""


def _actions(faults: list[Fault], restart_after_s: float) -> str:
    kill = (f"SIGKILLed at its time and started again {restart_after_s:g} s later (NATS, cachesvc and a router on "
            "their old address)")
    freeze = "SIGSTOPped at its time and SIGCONTed when its freeze is over (no restart)"
    return " or ".join(a for a, used in ((kill, any(not f.freeze_s for f in faults)),
                                         (freeze, any(f.freeze_s for f in faults))) if used)


def _victim(res: FaultRun, w: Window) -> dict[str, str | int]:
    """One fault's victim: what it held, the streams moved off it, how they ended and how soon they moved."""
    moved = res.moved_off(w)
    by_id = {rid: o for o in res.outcomes for rid in o.request_ids}
    pairs = [(m, o) for m in moved if (o := by_id.get(m.request_id)) is not None]
    outcomes = {id(o): o for _, o in pairs}.values()
    redispatched = [m.wall_s - w.wall_s for m in moved]
    next_token = [t - w.hit_s for m, o in pairs if (t := o.after(m.carried)) is not None]
    held = f"{w.held.running} + {w.held.waiting}" if w.held else "-"
    return {"fault": f"{w.fault} at {w.hit_s:.0f} s", "held (running + waiting)": held,
            "streams moved": len(moved), "of them completed": sum(not o.error for o in outcomes),
            "lost": sum(bool(o.error) for o in outcomes),
            "wrong": sum(not o.error and (o.tokens, o.text) != res.references[o.prompt] for o in outcomes),
            "moved because": ", ".join(f"{n} {why}" for why, n in Counter(_why(m.reason) for m in moved).items())
                             or "-",
            "dispatched again after s (p50 / max)": _p50_max(redispatched),
            "next token after s (p50 / max)": _p50_max(next_token)}


def _why(reason: str) -> str:
    if "no heartbeat" in reason:
        return "heartbeats stopped"
    if "inter_token_timeout_s" in reason:
        return "watchdog"
    return "call failed"


def _p50_max(values: list[float]) -> str:
    return f"{percentile(values, 50):.1f} / {max(values):.1f}" if values else "-"


def _ratio(x: str | int, base: str | int) -> str:
    try:
        return f"{float(x) / float(base):.2f}x"
    except (TypeError, ValueError, ZeroDivisionError):
        return "-"


def main(args) -> int:
    """``kvmesh bench load --faults ...`` (``args``: load's parsed arguments)."""
    try:
        faults = parse_schedule(args.faults)
    except ValueError as e:
        print(f"kvmesh bench load: {e}")
        return 2
    last = max(faults, key=lambda f: f.at_s + (f.freeze_s or args.restart_after))
    if last.at_s + (last.freeze_s or args.restart_after) >= args.duration:
        print(f"kvmesh bench load: the last fault's end ({last.at_s:g} + {last.freeze_s or args.restart_after:g} s) "
              f"must fall within --duration ({args.duration:g} s)")
        return 2
    res = run(faults, args.clients, args.duration, args.max_tokens, args.decode, args.routers, args.restart_after,
              Path(args.state_dir) if args.state_dir else None, args.max_num_seqs, args.prefill, args.cachesvc,
              args.system_words, args.pool_copies, args.prefill_blocks, args.both, not args.no_repair,
              args.cachesvc_from_bus)
    body = report(res, args.clients, args.decode, args.routers, args.restart_after)
    print(body)
    for o in (res.lost() + res.wrong())[:10]:
        what = o.error or f"got {o.text!r}, expected {res.references[o.prompt][1]!r}"
        print(f"{o.prompt!r} at {o.start_s:.1f} s: {what}")
    if not args.no_write:
        section = args.section or SECTION
        command = (f"kvmesh bench load --faults {args.faults} --clients {args.clients} --duration {args.duration:g} "
                   f"--decode {args.decode} --routers {args.routers} --restart-after {args.restart_after:g} "
                   f"--max-tokens {args.max_tokens}"
                   + (f" --max-num-seqs {args.max_num_seqs}" if args.max_num_seqs else "")
                   + (f" --prefill {args.prefill}" if args.prefill != 1 else "")
                   + (f" --both {args.both}" if args.both else "")
                   + (f" --cachesvc {args.cachesvc}" if args.cachesvc != 1 else "")
                   + (f" --system-words {args.system_words}" if args.system_words else "")
                   + (f" --pool-copies {args.pool_copies}" if args.pool_copies != 1 else "")
                   + (f" --prefill-blocks {args.prefill_blocks}" if args.prefill_blocks else "")
                   + (" --no-repair" if args.no_repair else "")
                   + (" --cachesvc-from-bus" if args.cachesvc_from_bus else "")
                   + (f" --section '{section}'" if args.section else ""))
        print(f"\nwritten to {write_section(section, command, body)}")
    return 0 if not res.lost() and not res.wrong() else 1
