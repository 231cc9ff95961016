"""``kvmesh bench load --faults``: the load test with processes killed (SIGKILL) at set times during the run.

    kvmesh bench load --faults decode-0@20,prefill-0@40,router-1@60,cachesvc@80,nats@100 --duration 120
                      [--clients 16] [--decode 2] [--routers 2] [--restart-after 8] [--max-tokens 16]

A stack of 1 prefill, ``--decode`` decode instances and ``--routers`` router replicas; closed-loop streaming
clients of the SDK (``AsyncKvmeshClient``, every router's address, each client starting at another one), so a
client fails over when its router dies and resumes a cut stream on the other one. Before the load every prompt is
answered once, greedy and alone: the reference. At each time of the schedule a service is SIGKILLed (``nats``:
the NATS server), and started again ``--restart-after`` seconds later (a supervisor's restart; cachesvc, NATS and
a router on the address they had). Reported: requests lost (ended in an error, after the client's failover and
resume), outputs that differ from their reference (token ids or text), the router's migrations, and TTFT / ITL
p99 of the load before the first fault against each fault's recovery window (from the kill until 5 s after the
service serves again).
"""

from __future__ import annotations

import asyncio
import itertools
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.client import AsyncKvmeshClient, KvmeshError, Overloaded

from app.bench.report import load_average, markdown_table, write_section
from app.bench.stats import percentile
from app.bench.workloads import SHORT_PROMPTS as PROMPTS
from app.launcher import Stack, StackOptions

SECTION = "Load under faults"
SETTLE_S = 5.0  # a fault's recovery window ends this long after the service serves again


@dataclass(frozen=True)
class Fault:
    service: str    # a service of the stack (decode-0, router-1, cachesvc, ...) or "nats"
    at_s: float     # seconds into the load


def parse_schedule(text: str) -> list[Fault]:
    """``SERVICE@SECONDS,...`` in time order; ValueError naming what to fix."""
    faults = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        service, sep, at = part.partition("@")
        try:
            at_s = float(at)
        except ValueError:
            at_s = -1.0
        if not sep or not service or at_s < 0:
            raise ValueError(f"--faults: {part!r} is not SERVICE@SECONDS (e.g. decode-0@20)")
        faults.append(Fault(service, at_s))
    if not faults or [f.at_s for f in faults] != sorted(f.at_s for f in faults):
        raise ValueError("--faults: give at least one SERVICE@SECONDS, in time order")
    return faults


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

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] - self.start_s if self.chunk_s else None


@dataclass
class Window:
    """A fault's recovery window: the kill, the moment the service served again, and the window's end."""

    fault: Fault
    killed_s: float
    back_s: float = float("nan")

    @property
    def end_s(self) -> float:
        return self.back_s + SETTLE_S


@dataclass
class FaultRun:
    outcomes: list[Outcome]
    windows: list[Window]
    references: dict[str, tuple[list[int], str]]
    migrations: float
    duration_s: float
    load_before: str
    load_after: str

    def wrong(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.error and (o.tokens, o.text) != self.references[o.prompt]]

    def lost(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error]


async def _references(targets: list[str], max_tokens: int) -> dict[str, tuple[list[int], str]]:
    async with AsyncKvmeshClient(targets, timeout_s=120) as client:
        out = {}
        for p in PROMPTS:
            done = await client.complete(messages=[{"role": "user", "content": p}], max_tokens=max_tokens,
                                         temperature=0)
            out[p] = (done.token_ids, done.text)
        return out


async def _clients(targets: list[str], clients: int, duration_s: float, max_tokens: int, t0: float,
                   outcomes: list[Outcome]) -> None:
    """``clients`` closed-loop clients until ``duration_s`` (a request under way finishes); client i starts at
    router i mod n and fails over to the others."""
    counter = itertools.count()

    async def client(i: int) -> None:
        order = targets[i % len(targets):] + targets[:i % len(targets)]
        async with AsyncKvmeshClient(order, timeout_s=180, retries=8, backoff_s=0.2) as c:
            while time.monotonic() - t0 < duration_s:
                prompt = PROMPTS[next(counter) % len(PROMPTS)]
                o = Outcome(prompt, time.monotonic() - t0)
                outcomes.append(o)
                while True:
                    try:
                        async with c.generate(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                              temperature=0) as stream:
                            async for chunk in stream:
                                o.chunk_s.append(time.monotonic() - t0)
                                o.tokens += chunk.token_ids
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
        window = Window(fault, time.monotonic() - t0)
        windows.append(window)
        await loop.run_in_executor(None, stack.kill, fault.service)
        print(f"[{window.killed_s:6.1f} s] killed {fault.service}", flush=True)
        await asyncio.sleep(restart_after_s)
        await loop.run_in_executor(None, stack.restart, fault.service)
        window.back_s = time.monotonic() - t0
        print(f"[{window.back_s:6.1f} s] {fault.service} serves again", flush=True)

    await asyncio.gather(*(one(f) for f in faults))
    windows.sort(key=lambda w: w.killed_s)


def run(faults: list[Fault], clients: int = 16, duration_s: float = 120.0, max_tokens: int = 16, decode: int = 2,
        routers: int = 2, restart_after_s: float = 8.0, state_dir: Path | None = None) -> FaultRun:
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(state_dir or Path(tmp), StackOptions.local("faults", decode=decode, routers=routers))
        names = {"nats", "cachesvc", "prefill-0"} | {f"decode-{i}" for i in range(decode)} | \
            ({f"router-{i}" for i in range(routers)} if routers > 1 else {"router"})
        unknown = [f.service for f in faults if f.service not in names]
        if unknown:
            raise ValueError(f"--faults: no service {', '.join(unknown)} in this stack ({', '.join(sorted(names))})")
        stack.start(timeout_s=300)
        try:
            targets = [r.endpoints["grpc"] for r in stack.routers]
            refs = asyncio.run(_references(targets, max_tokens))
            load_before = load_average()
            outcomes: list[Outcome] = []
            windows: list[Window] = []

            async def both() -> float:
                t0 = time.monotonic()
                await asyncio.gather(_clients(targets, clients, duration_s, max_tokens, t0, outcomes),
                                     _schedule(stack, faults, restart_after_s, t0, windows))
                return time.monotonic() - t0

            took = asyncio.run(both())
            migrations = sum(_metric(r.endpoints["metrics"], 'kvmesh_router_migrations_total{outcome="migrated"}')
                             for r in stack.routers)
            return FaultRun(outcomes, windows, refs, migrations, took, load_before, load_average())
        finally:
            stack.stop()


def _metric(url: str, name: str) -> float:
    import urllib.request

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
            "TTFT p99 ms": _p99(ttft), "ITL p99 ms": _p99(itl)}


def report(res: FaultRun, clients: int, decode: int, routers: int, restart_after_s: float) -> str:
    wrong, lost = res.wrong(), res.lost()
    first = res.windows[0].killed_s if res.windows else res.duration_s
    before = _figures(res.outcomes, lambda t: t < first)
    rows = [{"window": f"before the first fault (0-{first:.0f} s)", **before,
             "TTFT p99 vs before": "1.00x", "ITL p99 vs before": "1.00x"}]
    for w in res.windows:
        fig = _figures(res.outcomes, lambda t, w=w: w.killed_s <= t < w.end_s)
        rows.append({"window": f"kill -9 {w.fault.service} at {w.killed_s:.0f} s, back at {w.back_s:.0f} s",
                     **fig, "TTFT p99 vs before": _ratio(fig["TTFT p99 ms"], before["TTFT p99 ms"]),
                     "ITL p99 vs before": _ratio(fig["ITL p99 ms"], before["ITL p99 ms"])})
    done = [o for o in res.outcomes if not o.error]
    summary = [{"requests": len(res.outcomes), "completed": len(done), "lost": len(lost), "wrong outputs": len(wrong),
                "migrations": f"{res.migrations:.0f}", "429s (retried)": sum(o.rejected for o in res.outcomes),
                "tokens/s": f"{sum(len(o.tokens) for o in done) / max(res.duration_s, 1e-9):.1f}"}]
    body = (f"{clients} closed-loop streaming clients (the SDK, every router's address; a client fails over and "
            f"resumes a cut stream on another router) for {res.duration_s:.0f} s against 1 prefill + {decode} decode "
            f"instances and {routers} routers (the real model, 1 thread each); greedy, {len(PROMPTS)} short prompts, "
            f"each answer compared with its reference taken alone before the load (token ids and text). Each "
            f"service of the schedule is SIGKILLed at its time and started again {restart_after_s:g} s later (NATS, "
            f"cachesvc and a router on their old address); a fault's recovery window runs from the kill until "
            f"{SETTLE_S:g} s after the service serves again. Load average (1, 5, 15 min) {res.load_before} at the "
            f"start, {res.load_after} at the end (the machine is shared).\n\n"
            + markdown_table(summary, list(summary[0])) + "\n\n"
            + markdown_table(rows, ["window", "requests", "lost", "TTFT p99 ms", "TTFT p99 vs before", "ITL p99 ms",
                                    "ITL p99 vs before"]))
    return body


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
    if faults[-1].at_s + args.restart_after >= args.duration:
        print(f"kvmesh bench load: the last fault's restart ({faults[-1].at_s:g} + {args.restart_after:g} s) must "
              f"fall within --duration ({args.duration:g} s)")
        return 2
    res = run(faults, args.clients, args.duration, args.max_tokens, args.decode, args.routers, args.restart_after)
    body = report(res, args.clients, args.decode, args.routers, args.restart_after)
    print(body)
    for o in (res.lost() + res.wrong())[:10]:
        what = o.error or f"got {o.text!r}, expected {res.references[o.prompt][1]!r}"
        print(f"{o.prompt!r} at {o.start_s:.1f} s: {what}")
    if not args.no_write:
        command = (f"kvmesh bench load --faults {args.faults} --clients {args.clients} --duration {args.duration:g} "
                   f"--decode {args.decode} --routers {args.routers} --restart-after {args.restart_after:g} "
                   f"--max-tokens {args.max_tokens}")
        print(f"\nwritten to {write_section(SECTION, command, body)}")
    return 0 if not res.lost() and not res.wrong() else 1
