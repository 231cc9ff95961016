"""A bounded load test on a real stack: many concurrent streaming clients for a fixed time, on loopback.

    kvmesh bench load [--clients 64] [--duration 60] [--max-concurrent 32] [--max-tokens 16] [--no-write]
    kvmesh bench load --faults SERVICE@SECONDS[:stopSECONDS],... [--decode 2] [--routers 2] [--restart-after 8]
                      [--max-num-seqs N] [--section NAME] ...

With ``--faults`` it is the load under a fault schedule (``app/bench/faults.py``): processes SIGKILLed or frozen
(SIGSTOP) at set times, the requests lost and the wrong outputs counted, the latency of each recovery against
before, and per fault the victim's streams: how many, how they ended, how soon they moved.

Before the load, each prompt is answered once, greedy and alone: the reference. Under load every stream must give
exactly that text and token count (a lost or duplicated token shows as a mismatch), the router must refuse what is
over its ``max_concurrent_requests`` with a fast 429 instead of queueing until it collapses, every request must
end, and the services' memory must stay bounded (resident set sampled every 0.5 s). A single client for the same
time is the baseline of the same run: throughput and TTFT under load are given as ratios to it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import aiohttp

from app.bench.report import markdown_table, write_section
from app.bench.serve import stream_request
from app.bench.stats import RequestRecord, percentile
from app.bench.workloads import SHORT_PROMPTS as PROMPTS
from app.launcher import Stack, StackOptions

SECTION = "Load test"



@dataclass
class Phase:
    """One phase of the run (the solo baseline or the load): every request's outcome, as the clients saw it."""

    clients: int
    duration_s: float = 0.0
    records: list[RequestRecord] = field(default_factory=list)
    rejected_s: list[float] = field(default_factory=list)   # latency of each 429
    mismatches: list[str] = field(default_factory=list)     # streams whose text or token count differ from the ref
    errors: list[str] = field(default_factory=list)         # anything else that failed (not a 429)

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    def summary(self) -> dict:
        ok = self.ok
        tokens = sum(r.output_tokens for r in ok)
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        return {"clients": self.clients, "duration_s": self.duration_s, "completed": len(ok),
                "rejected_429": len(self.rejected_s), "errors": len(self.errors), "mismatches": len(self.mismatches),
                "timeouts": sum(r.timed_out for r in self.records), "tokens_per_s": tokens / max(self.duration_s, 1e-9),
                "requests_per_s": len(ok) / max(self.duration_s, 1e-9),
                "ttft_p50_s": percentile(ttft, 50) if ttft else float("nan"),
                "ttft_p99_s": percentile(ttft, 99) if ttft else float("nan"),
                "reject_p50_s": percentile(self.rejected_s, 50) if self.rejected_s else float("nan"),
                "reject_p99_s": percentile(self.rejected_s, 99) if self.rejected_s else float("nan")}


class MemorySampler:
    """Resident set size (MiB) of each process, sampled every ``interval_s`` on a thread: first, peak, last."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.5) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.first: dict[str, float] = {}
        self.peak: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self.sample()
        self.first = dict(self.last)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        for name, pid in self.pids.items():
            mib = rss_mib(pid)
            if mib is not None:
                self.last[name] = mib
                self.peak[name] = max(self.peak.get(name, 0.0), mib)


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _body(prompt: str, max_tokens: int, stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, "stream_options": {"include_usage": True}}


async def references(url: str, max_tokens: int) -> dict[str, tuple[str, int]]:
    """Each prompt's greedy answer (text, completion tokens), one request at a time."""
    out = {}
    async with aiohttp.ClientSession() as s:
        for p in PROMPTS:
            async with s.post(f"{url}/v1/chat/completions", json=_body(p, max_tokens, False)) as r:
                r.raise_for_status()
                obj = await r.json()
            out[p] = (obj["choices"][0]["message"]["content"], obj["usage"]["completion_tokens"])
    return out


async def run_phase(url: str, clients: int, duration_s: float, max_tokens: int,
                    refs: dict[str, tuple[str, int]], timeout_s: float = 120.0) -> Phase:
    """``clients`` closed-loop streaming clients until ``duration_s`` has passed (a request under way finishes)."""
    phase = Phase(clients)
    counter = itertools.count()
    limits = aiohttp.TCPConnector(limit=clients + 8)
    async with aiohttp.ClientSession(connector=limits) as session:
        t0 = time.perf_counter()

        async def client() -> None:
            while time.perf_counter() - t0 < duration_s:
                prompt = PROMPTS[next(counter) % len(PROMPTS)]
                rec = RequestRecord(key=prompt, start_s=time.perf_counter() - t0)
                await stream_request(session, f"{url}/v1/chat/completions", _body(prompt, max_tokens, True), rec,
                                     timeout_s, {})
                if rec.error and rec.error.startswith("HTTP 429"):
                    phase.rejected_s.append(rec.e2e_s or 0.0)
                    await asyncio.sleep(0.05)  # a well-behaved client backs off a little
                    continue
                phase.records.append(rec)
                if rec.error:
                    phase.errors.append(rec.error)
                elif (rec.text, rec.output_tokens) != refs[prompt]:
                    phase.mismatches.append(f"{prompt!r}: got {rec.text!r} ({rec.output_tokens} tokens), "
                                            f"expected {refs[prompt][0]!r} ({refs[prompt][1]})")

        await asyncio.gather(*(client() for _ in range(clients)))
        phase.duration_s = time.perf_counter() - t0
    return phase


@dataclass
class LoadResult:
    solo: Phase
    load: Phase
    memory: MemorySampler
    served_after: bool


def run(clients: int = 64, duration_s: float = 60.0, max_concurrent: int = 32, max_tokens: int = 16,
        baseline_s: float | None = None, state_dir: Path | None = None) -> LoadResult:
    """Start a stack (1 prefill + 1 decode, the real model), take the references, run the solo baseline and the
    load, then check the stack still answers."""
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(state_dir or Path(tmp), StackOptions.local(
            "load", env={"KVMESH_ROUTER_MAX_CONCURRENT_REQUESTS": str(max_concurrent)}))
        stack.start(timeout_s=300)
        try:
            url = f"http://127.0.0.1:{stack.http_port}"
            refs = asyncio.run(references(url, max_tokens))
            solo = asyncio.run(run_phase(url, 1, baseline_s or min(duration_s, 20.0), max_tokens, refs))
            with MemorySampler({s.name: s.proc.pid for s in stack.services}) as mem:
                load = asyncio.run(run_phase(url, clients, duration_s, max_tokens, refs))
            after = asyncio.run(references(url, max_tokens))
        finally:
            stack.stop()
    return LoadResult(solo, load, mem, after == refs)


def report(res: LoadResult, max_concurrent: int) -> str:
    s, l = res.solo.summary(), res.load.summary()
    rows = []
    for name, x in (("1 client (baseline)", s), (f"{l['clients']} clients", l)):
        rows.append({"phase": name, "completed": x["completed"], "429": x["rejected_429"],
                     "errors": x["errors"], "lost/dup tokens": x["mismatches"], "timeouts": x["timeouts"],
                     "tokens/s": f"{x['tokens_per_s']:.1f}", "req/s": f"{x['requests_per_s']:.2f}",
                     "TTFT p50 ms": f"{x['ttft_p50_s'] * 1e3:.0f}", "TTFT p99 ms": f"{x['ttft_p99_s'] * 1e3:.0f}",
                     "429 p99 ms": "-" if x["rejected_429"] == 0 else f"{x['reject_p99_s'] * 1e3:.1f}"})
    rows.append({"phase": "load / baseline", "tokens/s": f"{l['tokens_per_s'] / max(s['tokens_per_s'], 1e-9):.2f}x",
                 "TTFT p50 ms": f"{l['ttft_p50_s'] / s['ttft_p50_s']:.2f}x",
                 "TTFT p99 ms": f"{l['ttft_p99_s'] / s['ttft_p99_s']:.2f}x"})
    cols = ["phase", "completed", "429", "errors", "lost/dup tokens", "timeouts", "tokens/s", "req/s", "TTFT p50 ms",
            "TTFT p99 ms", "429 p99 ms"]
    m = res.memory
    mem_rows = [{"service": n, "RSS at start MiB": f"{m.first.get(n, 0):.0f}", "peak MiB": f"{m.peak.get(n, 0):.0f}",
                 "at end MiB": f"{m.last.get(n, 0):.0f}"} for n in sorted(m.peak)]
    return (f"{l['clients']} closed-loop streaming clients for {l['duration_s']:.0f} s against 1 prefill + 1 decode "
            f"(the real model, 1 thread each), router `max_concurrent_requests = {max_concurrent}`; greedy, "
            f"{len(PROMPTS)} short prompts, each answer compared with its reference taken alone before the load "
            f"(text and token count). The stack answered the references identically after the load: "
            f"{'yes' if res.served_after else 'NO'}.\n\n"
            + markdown_table(rows, cols) + "\n\nMemory (resident set, sampled every 0.5 s during the load):\n\n"
            + markdown_table(mem_rows, ["service", "RSS at start MiB", "peak MiB", "at end MiB"]))


def ramp(spec: str, directory: str | None, max_tokens: int) -> int:
    """Closed-loop phases against a running stack (its router's HTTP API, from stack.json): each phase's
    outcome on one line, with the time since the start, so what a planner did meanwhile can be set beside it."""
    from kvmesh import state

    try:
        phases = [(int(c), float(s)) for c, _, s in (part.partition(":") for part in spec.split(","))]
        url = state.StackInfo.read(state.state_dir(directory)).router_http
    except (ValueError, OSError) as e:
        print(f"kvmesh bench load: --ramp {spec!r}: {e} (expected CLIENTS:SECONDS,...)")
        return 2
    refs = asyncio.run(references(url, max_tokens))
    t0, lost = time.monotonic(), 0
    for clients, seconds in phases:
        start = time.monotonic() - t0
        s = asyncio.run(run_phase(url, clients, seconds, max_tokens, refs)).summary()
        lost += s["errors"] + s["mismatches"] + s["timeouts"]
        print(f"{start:6.0f}-{time.monotonic() - t0:4.0f} s  {clients:3d} clients: {s['completed']} completed, "
              f"{s['errors']} errors, {s['mismatches']} lost/dup, {s['rejected_429']} 429, "
              f"{s['requests_per_s']:.1f} req/s, TTFT p50 {s['ttft_p50_s'] * 1e3:.0f} ms "
              f"p99 {s['ttft_p99_s'] * 1e3:.0f} ms", flush=True)
    return 1 if lost else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench load")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (the baseline runs min(this, 20))")
    p.add_argument("--max-concurrent", type=int, default=32, help="the router's max_concurrent_requests")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--ramp", metavar="CLIENTS:SECONDS,...",
                   help="phases of closed-loop clients (e.g. 1:60,12:120,1:90) against the stack already running "
                        "in --state-dir (`kvmesh up`), one line per phase; nothing is written")
    p.add_argument("--state-dir", help="with --ramp: the running stack's state directory; with --faults: where "
                                       "the stack keeps its logs and span file (default: a temporary directory)")
    p.add_argument("--faults", metavar="SERVICE@SECONDS[:stopSECONDS],...",
                   help="kill -9 these services at these times into the load (decode-0, prefill-0, router-1, "
                        "cachesvc or cachesvc-1, nats, ...), each started again --restart-after seconds later; with "
                        ":stopN, SIGSTOP it instead and SIGCONT it N seconds later (decode-0@20:stop30)")
    p.add_argument("--prefill", type=int, default=1, help="with --faults: prefill instances")
    p.add_argument("--decode", type=int, default=2, help="with --faults: decode instances")
    p.add_argument("--cachesvc", type=int, default=1, help="with --faults: cachesvc shards (cachesvc-0, ...)")
    p.add_argument("--pool-copies", type=int, default=1, help="with --faults and --cachesvc: copies of each pooled "
                                                               "block (cachesvc.pool_copies)")
    p.add_argument("--prefill-blocks", type=int, default=0, help="with --faults: each prefill (and both) instance's "
                                                                  "KV blocks (small: prefixes come back from the pool)")
    p.add_argument("--no-repair", action="store_true", help="with --faults and --pool-copies > 1: a restarted "
                   "cachesvc shard does not refill its pool from the other copies (cachesvc.repair_mb_s 0)")
    p.add_argument("--cachesvc-from-bus", action="store_true", help="with --faults and --cachesvc: engines and "
                   "routers find the shards by their beats on NATS (kvmesh up --cachesvc-from-bus)")
    p.add_argument("--both", type=int, default=0, help="with --faults: instances that prefill and decode")
    p.add_argument("--system-words", type=int, default=0,
                   help="with --faults: requests take one of a few system prompts this many words long in turn "
                        "(prefixes the instances and the pool reuse)")
    p.add_argument("--routers", type=int, default=2, help="with --faults: router replicas")
    p.add_argument("--restart-after", type=float, default=8.0, help="with --faults: seconds until a killed "
                                                                        "service is started again")
    p.add_argument("--max-num-seqs", type=int, help="with --faults: each engine's cap on running sequences "
                                                     "(engine.max_num_seqs; default: the engine's own)")
    p.add_argument("--section", help="with --faults: the docs/benchmarks.md section to (re)write (default: "
                                     "Load under faults)")
    args = p.parse_args(argv)
    if args.ramp:
        return ramp(args.ramp, args.state_dir, args.max_tokens)
    if args.faults:
        from app.bench import faults

        return faults.main(args)
    res = run(args.clients, args.duration, args.max_concurrent, args.max_tokens)
    body = report(res, args.max_concurrent)
    print(body)
    if res.load.mismatches:
        print("\nmismatches:\n" + "\n".join(res.load.mismatches[:10]))
    if res.load.errors:
        print("\nerrors:\n" + "\n".join(res.load.errors[:10]))
    if not args.no_write:
        command = (f"kvmesh bench load --clients {args.clients} --duration {args.duration:g} "
                   f"--max-concurrent {args.max_concurrent} --max-tokens {args.max_tokens}")
        print(f"\nwritten to {write_section(SECTION, command, body)}")
    return 0
