"""Sessions on the stack: agents with tool pauses and think times on two role-both instances with small device
caches, with the session signals and without, in one run.

    python -m app.bench.session_stack [--sessions 6] [--steps 5] [--no-write]

Both runs start the same stack (``kvmesh up --both 2``, the default model, 1 thread each, a small device pool,
a small host tier and a small pool, eviction ``session_duel`` in the engines and ``session`` in the pool) and
replay the same agents: each task is a shared system preamble, its own instructions, then steps; every step but
the last ends in a tool call (the response is constrained to one), the tool runs 1-3 s (one call in four: 8-15 s)
and its output joins the prompt of the next step; the last step ends the task. "with signals": every request
carries its ``session_id`` and the last ``session_end`` (the router sees the tool calls: pauses); "without": none
of it, so the same strategies rank as their base ones (duel, LRU) and routing is cache-aware only. Reported for
the resumed steps (step 2 on): TTFT at the client (streamed), the share of their prompt tokens served from cache,
and the blocks a paused session had demoted that the engines warmed back before it returned: used by its next
step, or evicted first (wasted).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import shutil
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from app.bench.report import load_average, markdown_table, publish
from app.bench.stats import RequestRecord, percentile

SECTION = "Sessions on the stack"
VOCAB = 49152  # SmolLM2's
TOOL_CALL = '<tool_call>{"name": "run", "arguments": {}}</tool_call>'
ENGINE = {"threads": 1, "num_blocks": 64, "host_cache_mb": 32, "eviction": "session_duel", "session_pause_s": 3.0}
POOL = {"pool_capacity_mb": 32, "pool_eviction": "session"}


@dataclass(frozen=True)
class Step:
    prompt: tuple[int, ...]
    think_s: float  # the tool's run before the next step (0 after the last)
    last: bool


@dataclass(frozen=True)
class Task:
    name: str
    start_s: float
    steps: tuple[Step, ...]


def tasks(n: int = 6, steps: int = 5, seed: int = 3, preamble: int = 256, instructions: int = 128,
          tool_output: int = 96) -> list[Task]:
    """``n`` agent tasks of ``steps`` steps, started 1.5 s apart, with one preamble shared by all."""
    rng = random.Random(seed)

    def ids(k: int) -> list[int]:
        return [rng.randrange(100, VOCAB - 100) for _ in range(k)]

    shared = ids(preamble)
    out = []
    for t in range(n):
        ctx = shared + ids(instructions)
        plan = []
        for s in range(steps):
            last = s == steps - 1
            think = 0.0 if last else (rng.uniform(8, 15) if rng.random() < 0.25 else rng.uniform(1, 3))
            plan.append(Step(tuple(ctx), think, last))
            ctx = ctx + ids(tool_output)
        out.append(Task(f"task{t}", 1.5 * t, tuple(plan)))
    return out


@dataclass
class Run:
    mode: str
    records: list[RequestRecord] = field(default_factory=list)  # resumed steps only
    prefetch: dict[str, int] = field(default_factory=dict)      # loaded / used / wasted blocks, both instances
    block_bytes: int = 0
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)
    logs: str = ""  # where the services' logs were kept (a run with errors)


async def drive(url: str, plan: list[Task], signals: bool, max_tokens: int = 48) -> tuple[list[RequestRecord],
                                                                                           list[str]]:
    import aiohttp

    from app.bench.serve import stream_request

    resumed: list[RequestRecord] = []
    errors: list[str] = []

    async def agent(session: aiohttp.ClientSession, task: Task) -> None:
        await asyncio.sleep(task.start_s)
        for n, step in enumerate(task.steps):
            body: dict = {"prompt": list(step.prompt), "max_tokens": max_tokens, "temperature": 0, "stream": True,
                          "stream_options": {"include_usage": True}}
            if step.last:
                body["ignore_eos"] = True
                body["max_tokens"] = 4
            else:
                body["guided_choice"] = [TOOL_CALL]
            if signals:
                body["session_id"] = task.name
                body["session_end"] = step.last
            rec = RequestRecord(f"{task.name}/{n}")
            await stream_request(session, f"{url}/v1/completions", body, rec, 600.0, {})
            if rec.error:
                errors.append(f"{rec.key}: {rec.error}")
            elif n:
                resumed.append(rec)
            await asyncio.sleep(step.think_s)

    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(agent(session, t) for t in plan))
    return resumed, errors


def _metric(text: str, name: str, label: str = "") -> float:
    pattern = rf"^{re.escape(name)}{re.escape(label)} ([0-9.e+-]+)$"
    m = re.search(pattern, text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def scrape(metrics_url: str) -> tuple[dict[str, int], int]:
    """An engine instance's prefetch counters (blocks) and its block size in bytes."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    counts = {o: int(_metric(text, "kvmesh_worker_kv_prefetch_blocks_total", f'{{outcome="{o}"}}'))
              for o in ("loaded", "used", "wasted")}
    return counts, int(_metric(text, "kvmesh_worker_kv_block_bytes"))


def run(mode: str, plan: list[Task]) -> Run:
    from app.launcher import Stack, StackOptions

    result = Run(mode)
    opts = StackOptions.local(f"sessions{mode[:4]}", prefill=0, decode=0, both=2, pool=True,
                              settings={"engine": dict(ENGINE), "cachesvc": dict(POOL)})
    with tempfile.TemporaryDirectory(prefix="kvmesh-sessions-") as d:
        stack = Stack(Path(d), opts)
        stack.start()
        try:
            t0 = time.monotonic()
            result.records, result.errors = asyncio.run(drive(stack.router_http, plan, mode == "with signals"))
            result.wall_s = time.monotonic() - t0
            if result.errors:  # keep the services' logs of a run that went wrong
                kept = Path("bench-out") / f"session-stack-{mode.replace(' ', '-')}-{int(time.time())}"
                shutil.copytree(stack.log_dir, kept)
                result.logs = str(kept)
            time.sleep(1.5)  # the last metrics reach the counters
            for name in ("both-0", "both-1"):
                counts, result.block_bytes = scrape(stack.service(name).endpoints["metrics"])
                for k, v in counts.items():
                    result.prefetch[k] = result.prefetch.get(k, 0) + v
        finally:
            stack.stop()
    return result


def _row(r: Run) -> dict:
    ttfts = [x.ttft_s for x in r.records if x.ttft_s is not None]
    prompt = sum(x.prompt_tokens or 0 for x in r.records)
    cached = sum(x.cached_tokens or 0 for x in r.records)
    mb = r.block_bytes / 2**20
    return {"run": r.mode, "resumed steps": len(r.records),
            "TTFT p50 s": f"{percentile(ttfts, 50):.2f}" if ttfts else "-",
            "TTFT p90 s": f"{percentile(ttfts, 90):.2f}" if ttfts else "-",
            "cached-token share": f"{cached / prompt * 100:.1f}%" if prompt else "-",
            "prefetched MB": f"{r.prefetch.get('loaded', 0) * mb:.1f}",
            "used MB": f"{r.prefetch.get('used', 0) * mb:.1f}",
            "wasted MB": f"{r.prefetch.get('wasted', 0) * mb:.1f}",
            "wall s": f"{r.wall_s:.0f}", "errors": len(r.errors)}


def bench(sessions: int = 6, steps: int = 5) -> str:
    plan = tasks(sessions, steps)
    load0 = load_average()
    runs = [run(mode, plan) for mode in ("without signals", "with signals")]
    cols = ["run", "resumed steps", "TTFT p50 s", "TTFT p90 s", "cached-token share", "prefetched MB", "used MB",
            "wasted MB", "wall s", "errors"]
    errors = [e for r in runs for e in r.errors][:5] + [f"logs kept in {r.logs}" for r in runs if r.logs]
    return (f"{sessions} agent tasks of {steps} steps (a 256-token shared preamble, 128 tokens of their own, 96 "
            f"tokens of tool output a step; tool calls forced by the response format), started 1.5 s apart, on 2 "
            f"role-both instances of the default model (1 thread each, {ENGINE['num_blocks']} device blocks = "
            f"{ENGINE['num_blocks'] * 16} tokens, {ENGINE['host_cache_mb']} MB host tier, a {POOL['pool_capacity_mb']}"
            f" MB pool; eviction {ENGINE['eviction']} / pool {POOL['pool_eviction']}, a tool expected to take "
            f"{ENGINE['session_pause_s']:g} s until the sessions' own pauses say otherwise). Resumed steps: step 2 on. "
            f"Load average {load0} at the start, {load_average()} at the end (the machine is shared: TTFTs move "
            "with it).\n\n" + markdown_table([_row(r) for r in runs], cols)
            + ("\n\nErrors: " + "; ".join(errors) if errors else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.bench.session_stack", description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md as it is")
    args = p.parse_args(argv)
    command = f"python -m app.bench.session_stack --sessions {args.sessions} --steps {args.steps}"
    publish(SECTION, command, bench(args.sessions, args.steps), write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
