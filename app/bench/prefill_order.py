"""``kvmesh bench prefill-order``: one engine's TTFT under ``engine.prefill_order = least_work`` against
``arrival`` (first come, first served), on the same seeded stream of requests where conversations come back
(most of their prompt cached) between long cold prompts.

    kvmesh bench prefill-order [--requests 120] [--sessions 8] [--load 0.8] [--rounds 2] [--threads 1]
                               [--no-write]

The default model (SmolLM2-135M, fp32), one engine in this process (``AsyncEngine``), ``--threads`` torch threads.
Before each arm's measured stream, ``--sessions`` conversations send their first prompt (512 tokens) one at a
time (not measured). Then ``--requests`` requests arrive open loop (exponential gaps, the same seeded schedule
in both arms): half a conversation's next turn (its whole context so far, cached on the engine, plus 48 new
tokens; a turn waits for the conversation's previous one to finish, and that wait counts in its TTFT), half a
cold prompt of 768 tokens never seen before; 16 output tokens each. The arrival rate is ``--load`` times what the
engine serves of that mix one request at a time (a cold prompt's and a turn's time to their last token alone,
measured at the start). Reported per arm and kind: TTFT p50 / p90 / mean (from the request's arrival to its
first token), pooled over ``--rounds`` runs of each arm, the arms alternating; the ratio least_work / arrival.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass

import numpy as np
from kvmesh.contracts.engine import EngineRequest
from kvmesh.contracts.names import PrefillOrder
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.llm_engine import LLMEngine
from kvmesh.settings import EngineSettings

from app.bench.report import load_average, markdown_table, publish

SECTION = "Prefill order: least work first vs arrival"
FIRST_TOKENS, TURN_TOKENS, COLD_TOKENS, OUTPUT_TOKENS = 512, 48, 768, 16
KINDS = ("turn", "cold", "all")


@dataclass(frozen=True)
class Arrival:
    at: float      # seconds after the stream's start
    kind: str      # "turn" or "cold"
    session: int   # the conversation of a turn (-1: cold)
    added: tuple[int, ...]  # the tokens it adds: the turn's new part, or the whole cold prompt


def tokens(n: int, rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(100, 40000) for _ in range(n))


def schedule(requests: int, rate: float, seed: int, sessions: int) -> list[Arrival]:
    """The seeded open-loop stream: exponential gaps at ``rate`` a second, turns and cold prompts alternating
    at random (half each), a turn's conversation drawn uniformly."""
    rng = random.Random(seed)
    at, out = 0.0, []
    for _ in range(requests):
        at += rng.expovariate(rate)
        if rng.random() < 0.5:
            out.append(Arrival(at, "turn", rng.randrange(sessions), tokens(TURN_TOKENS, rng)))
        else:
            out.append(Arrival(at, "cold", -1, tokens(COLD_TOKENS, rng)))
    return out


def first_prompts(sessions: int, seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed + 1)
    return [tokens(FIRST_TOKENS, rng) for _ in range(sessions)]


class Arm:
    """One engine with a prefill order: its conversations' contexts, and the TTFT of each request it served."""

    def __init__(self, order: PrefillOrder, threads: int) -> None:
        self.order, self.threads = order, threads
        self.engine: AsyncEngine | None = None
        self.contexts: list[tuple[int, ...]] = []
        self.ttft: dict[str, list[float]] = {k: [] for k in KINDS}
        self.cached: dict[str, list[float]] = {k: [] for k in KINDS}
        self._n = 0

    async def start(self) -> None:
        settings = EngineSettings(threads=self.threads, max_num_seqs=64, kv_cache_mb=1024,
                                  prefill_order=self.order)
        self.engine = AsyncEngine(LLMEngine(settings), asyncio.get_running_loop())

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()

    async def one(self, prompt: tuple[int, ...]) -> tuple[float, int, tuple[int, ...]]:
        """Serve ``prompt``: its TTFT, its cached prompt tokens and its output tokens."""
        ttft, _, cached, out = await self.timed(prompt)
        return ttft, cached, out

    async def timed(self, prompt: tuple[int, ...]) -> tuple[float, float, int, tuple[int, ...]]:
        """Serve ``prompt``: its TTFT, its time to the last token, its cached prompt tokens, its output."""
        assert self.engine is not None
        self._n += 1
        t0, first, cached, out = time.perf_counter(), None, 0, []
        params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True)
        async for o in self.engine.generate(EngineRequest(f"{self.order}-{self._n}", prompt, params)):
            if first is None and o.token_ids:
                first = time.perf_counter() - t0
            cached = max(cached, o.cached_tokens)
            out.extend(o.token_ids)
        return first or 0.0, time.perf_counter() - t0, cached, tuple(out)

    async def open_sessions(self, prompts: list[tuple[int, ...]]) -> None:
        self.contexts = []
        for p in prompts:
            _, _, out = await self.one(p)
            self.contexts.append(p + out)

    async def stream(self, arrivals: list[Arrival]) -> None:
        """Send ``arrivals`` open loop; a turn waits for its conversation's previous turn to end."""
        busy = [asyncio.Lock() for _ in self.contexts]
        start = time.perf_counter()

        async def send(a: Arrival) -> None:
            await asyncio.sleep(max(0.0, start + a.at - time.perf_counter()))
            if a.kind == "cold":
                ttft, cached, _ = await self.one(a.added)
                prompt_len = len(a.added)
            else:
                async with busy[a.session]:
                    arrived = start + a.at
                    prompt = self.contexts[a.session] + a.added
                    waited = time.perf_counter() - arrived  # behind the conversation's previous turn
                    ttft, cached, out = await self.one(prompt)
                    ttft += waited
                    self.contexts[a.session] = prompt + out
                    prompt_len = len(prompt)
            for kind in (a.kind, "all"):
                self.ttft[kind].append(ttft)
                self.cached[kind].append(cached / prompt_len)

        await asyncio.gather(*(send(a) for a in arrivals))


async def calibrate(threads: int, sessions: list[tuple[int, ...]], seed: int) -> dict[str, float]:
    """A cold prompt's and a turn's TTFT and whole time (to its last token) alone, on an engine of their own
    (medians of 3)."""
    arm = Arm(PrefillOrder.ARRIVAL, threads)
    await arm.start()
    try:
        await arm.open_sessions(sessions[:1])
        rng = random.Random(seed + 2)
        cold = [await arm.timed(tokens(COLD_TOKENS, rng)) for _ in range(3)]
        turn = []
        for _ in range(3):
            prompt = arm.contexts[0] + tokens(TURN_TOKENS, rng)
            turn.append(t := await arm.timed(prompt))
            arm.contexts[0] = prompt + t[3]
        return {"cold_s": float(np.median([c[0] for c in cold])), "turn_s": float(np.median([t[0] for t in turn])),
                "cold_all_s": float(np.median([c[1] for c in cold])),
                "turn_all_s": float(np.median([t[1] for t in turn]))}
    finally:
        await arm.close()


async def bench(requests: int, sessions_n: int, load: float, rounds: int, threads: int, seed: int) -> dict:
    sessions = first_prompts(sessions_n, seed)
    alone = await calibrate(threads, sessions, seed)
    # the engine's capacity for the mix: one request at a time, each to its last token (an upper bound on a
    # request's service: a batch's decode rows share their steps)
    rate = load / (0.5 * alone["cold_all_s"] + 0.5 * alone["turn_all_s"])
    arrivals = schedule(requests, rate, seed, sessions_n)
    arms = {o: Arm(o, threads) for o in (PrefillOrder.ARRIVAL, PrefillOrder.LEAST_WORK)}
    for r in range(rounds):
        for order in (list(arms) if r % 2 == 0 else list(reversed(arms))):
            arm = arms[order]
            await arm.start()
            try:
                await arm.open_sessions(sessions)
                await arm.stream(arrivals)
            finally:
                await arm.close()
                arm.engine = None
            print(f"round {r + 1} {order}: turn p50 {np.median(arm.ttft['turn']):.2f} s, cold p50 "
                  f"{np.median(arm.ttft['cold']):.2f} s (pooled so far)", flush=True)
    return {"arms": arms, "rate": rate, **alone, "span_s": arrivals[-1].at}


def render(res: dict, requests: int, sessions: int, load: float, rounds: int, threads: int,
           start_load: str) -> str:
    arms: dict[PrefillOrder, Arm] = res["arms"]
    rows = []
    for order, arm in arms.items():
        for kind in KINDS:
            t = np.array(arm.ttft[kind])
            rows.append({"order": str(order), "requests": kind, "n": len(t),
                         "TTFT p50 s": f"{np.percentile(t, 50):.2f}", "p90 s": f"{np.percentile(t, 90):.2f}",
                         "mean s": f"{t.mean():.2f}", "cached": f"{100 * np.mean(arm.cached[kind]):.1f}%"})
    base, new = arms[PrefillOrder.ARRIVAL], arms[PrefillOrder.LEAST_WORK]

    def ratio(kind: str, q: float | None) -> str:
        a, b = np.array(base.ttft[kind]), np.array(new.ttft[kind])
        x = (np.percentile(b, q) / np.percentile(a, q)) if q is not None else b.mean() / a.mean()
        return f"{x:.2f}x"

    ratios = [{"requests": k, "p50": ratio(k, 50), "p90": ratio(k, 90), "mean": ratio(k, None)} for k in KINDS]
    return (f"One engine in process (default model, fp32, {threads} torch thread(s)). {sessions} conversations "
            f"open with a {FIRST_TOKENS}-token prompt each (not measured); then {requests} requests arrive open "
            f"loop at {res['rate']:.2f}/s ({load:.0%} of what the engine serves of the mix one at a time: a cold "
            f"prompt alone takes {res['cold_s']:.2f} s to its first token and {res['cold_all_s']:.2f} s to its "
            f"last, a turn {res['turn_s']:.2f} s and {res['turn_all_s']:.2f} s), over {res['span_s']:.0f} s: half a "
            f"conversation's next turn (its context so far plus {TURN_TOKENS} new tokens; a turn waits for the "
            f"conversation's previous one, and that wait counts in its TTFT), half a cold {COLD_TOKENS}-token "
            f"prompt; {OUTPUT_TOKENS} output tokens each. The same seeded schedule in both arms, {rounds} runs "
            f"each, alternating; TTFT from the request's arrival, pooled over the runs. Load average at the "
            f"start {start_load}, at the end {load_average()}.\n\n"
            + markdown_table(rows, ["order", "requests", "n", "TTFT p50 s", "p90 s", "mean s", "cached"])
            + "\n\nleast_work / arrival:\n\n" + markdown_table(ratios, ["requests", "p50", "p90", "mean"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench prefill-order", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--load", type=float, default=0.8, help="arrival rate as a share of the engine's capacity")
    p.add_argument("--rounds", type=int, default=2, help="runs of each arm, alternating")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md as it is")
    a = p.parse_args(argv)
    for name in ("requests", "sessions", "rounds", "threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1")
    if not 0 < a.load <= 2:
        p.error("--load must be in (0, 2]")
    start_load = load_average()
    res = asyncio.run(bench(a.requests, a.sessions, a.load, a.rounds, a.threads, a.seed))
    body = render(res, a.requests, a.sessions, a.load, a.rounds, a.threads, start_load)
    command = "kvmesh bench prefill-order" + ("" if argv is None else " " + " ".join(x for x in argv
                                                                                      if x != "--no-write"))
    publish(SECTION, command.strip(), body, not a.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
