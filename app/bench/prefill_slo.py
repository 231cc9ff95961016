"""The serving bench's prefill scenarios (``kvmesh bench engine --serving --scenarios cold,slo``):

- ``cold``: fresh 1,500-token prompts one at a time (random token ids, never cached), TTFT each; the prefill
  speed as a share of this machine's FMA limit (``kvmesh bench machine``'s probe, measured in the run): the
  prompt's matmul and causal-attention FLOPs over the TTFT, and, where the engine's step counters are read, over
  the engine thread's CPU time (which a shared machine's other jobs do not inflate).
- ``slo`` (scenario C): 4 streams decoding (20-token prompts, 256 tokens each) while three 1,500-token prompts
  arrive 1 s apart (32 tokens each); every request carries the targets TTFT <= 6 s and ITL p99 <= 150 ms
  (``kvmesh_slo``; a server that does not read it serves it as it would any other), and goodput counts the
  requests that met both, measured at the client: TTFT from send to the first token, the p99 of its gaps between
  tokens (nearest rank).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

import numpy as np
import torch
from kvmesh.contracts.slo import SLO

COLD_TOKENS = 1500
TARGETS = SLO(ttft_s=6.0, itl_s=0.15)
STREAMS, LONG_PROMPTS, ARRIVAL_GAP_S = 4, 3, 1.0
STREAM_TOKENS, LONG_TOKENS = 256, 32

class Refused(RuntimeError):
    """The server refused the request at once (HTTP 429: no instance meets its TTFT target)."""


Stream = Callable[..., Awaitable[list[float]]]
"""``stream(request_id, prompt, max_tokens, slo=None)``: the submit time, then each token's arrival time."""


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def prefill_flops(tokens: int, layers: int = 30, hidden: int = 576, heads: int = 9, kv_heads: int = 3,
                  head_dim: int = 64, inter: int = 1536) -> float:
    """FLOPs of a cold prefill of ``tokens`` (the default model's shape): each layer's projections for every
    token (q|k|v, o, gate|up, down) and causal attention (QK^T and PV over the keys up to each position); the
    lm_head for the last token only."""
    q, kv = heads * head_dim, kv_heads * head_dim
    per_token = hidden * (q + 2 * kv) + q * hidden + hidden * 2 * inter + inter * hidden
    attention = 2 * heads * head_dim * tokens * (tokens + 1) / 2  # multiply-adds of QK^T and PV, causal
    return 2 * layers * (per_token * tokens + attention)


def fma_peak() -> float:
    """This core's fp32 FMA peak, GFLOP/s (the machine probe, a few seconds)."""
    from app.bench.machine import _load_probe
    from app.bench.machine import fma_peak as probe

    return probe(_load_probe(), 3)[0]


def p99(gaps: list[float]) -> float:
    """Nearest rank: the gap at rank ceil(0.99 n) (what ``contracts.slo.late_gaps_allowed`` counts)."""
    if not gaps:
        return 0.0
    return sorted(gaps)[math.ceil(0.99 * len(gaps)) - 1]


Probe = Callable[[], Awaitable[dict[str, float]]]


async def cold(stream: Stream, rid: Callable[[], str], repeats: int, probe: Probe | None = None) -> dict:
    """TTFT of ``repeats`` fresh 1,500-token prompts, one at a time (and the engine's prompt-step CPU seconds,
    where ``probe`` reads its counters)."""
    ttfts, cpus = [], []
    for i in range(repeats):
        before = await probe() if probe else None
        times = await stream(rid(), prompt(COLD_TOKENS, 50_000 + i), 1)
        ttfts.append(times[1] - times[0])
        if probe and before:
            cpus.append((await probe())["cpu"] - before["cpu"])
    return {"ttft": ttfts, "cpu": cpus}


async def scenario_c(stream: Stream, rid: Callable[[], str], sent: SLO | None = TARGETS) -> list[dict]:
    """Scenario C; one row per request: kind, TTFT, ITL p99, whether it met each target. ``sent``: the targets each
    request carries (None: none, the server's defaults apply); it is judged against ``TARGETS`` either way."""
    async def timed(kind: str, p: list[int], n: int) -> dict:
        try:
            times = await stream(rid(), p, n, sent)
        except Refused:  # admission control: it would not have met its target
            return {"kind": kind, "ttft_s": math.inf, "itl_p99_s": math.inf, "tokens": 0, "refused": True,
                    "ttft_met": False, "itl_met": False}
        gaps = list(np.diff(times[1:]))
        ttft, itl = times[1] - times[0], p99(gaps)
        return {"kind": kind, "ttft_s": ttft, "itl_p99_s": itl, "tokens": len(times) - 1, "refused": False,
                "ttft_met": ttft <= TARGETS.ttft_s, "itl_met": itl <= TARGETS.itl_s}

    streams = [asyncio.create_task(timed("stream", prompt(20, 3000 + i), STREAM_TOKENS)) for i in range(STREAMS)]
    await asyncio.sleep(1.0)  # the streams are decoding
    long = []
    for i in range(LONG_PROMPTS):
        long.append(asyncio.create_task(timed("long", prompt(COLD_TOKENS, 4000 + i), LONG_TOKENS)))
        if i < LONG_PROMPTS - 1:
            await asyncio.sleep(ARRIVAL_GAP_S)
    return await asyncio.gather(*streams) + await asyncio.gather(*long)


def cold_row(setup: str, res: dict, peak: float, target_ttft: float | None) -> dict:
    ttft = float(np.median(res["ttft"]))
    flops = prefill_flops(COLD_TOKENS)
    row = {"setup": setup, "TTFT s": f"{ttft:.2f} ({min(res['ttft']):.2f}-{max(res['ttft']):.2f})",
           "prefill tok/s": f"{COLD_TOKENS / ttft:.0f}", "of the FMA limit": f"{flops / ttft / 1e9 / peak:.0%}"}
    if target_ttft is not None:
        row["vs target"] = f"{ttft / target_ttft:.2f}x"
    if res["cpu"]:
        cpu = float(np.median(res["cpu"]))
        row |= {"engine CPU s": f"{cpu:.2f}", "tok per CPU-s": f"{COLD_TOKENS / cpu:.0f}",
                "of the FMA limit (CPU)": f"{flops / cpu / 1e9 / peak:.0%}"}
    return row


def slo_row(setup: str, rows: list[dict]) -> dict:
    long = [r for r in rows if r["kind"] == "long"]
    streams = [r for r in rows if r["kind"] == "stream"]
    good = sum(r["ttft_met"] and r["itl_met"] for r in rows)
    return {"setup": setup, "goodput": f"{good} of {len(rows)}",
            "long prompts' TTFT s": " / ".join("429" if r["refused"] else f"{r['ttft_s']:.2f}" for r in long),
            "long prompts met": sum(r["ttft_met"] and r["itl_met"] for r in long),
            "streams' ITL p99 ms": " / ".join(f"{r['itl_p99_s'] * 1e3:.0f}" for r in streams),
            "streams met": sum(r["ttft_met"] and r["itl_met"] for r in streams),
            "streams' TTFT s (max)": f"{max(r['ttft_s'] for r in streams):.2f}"}


COLD_COLUMNS = ["setup", "TTFT s", "vs target", "prefill tok/s", "of the FMA limit", "engine CPU s",
                "tok per CPU-s", "of the FMA limit (CPU)"]
SLO_COLUMNS = ["setup", "goodput", "long prompts' TTFT s", "long prompts met", "streams' ITL p99 ms", "streams met",
               "streams' TTFT s (max)"]


def render(results: dict[str, dict], peak: float, repeats: int) -> str:
    """``results``: per setup, its ``cold`` and / or ``slo`` results (a ``target: ...`` setup is the
    baseline)."""
    from app.bench.report import markdown_table

    target = next((r for s, r in results.items() if s.startswith("target") and "cold" in r), None)
    target_ttft = float(np.median(target["cold"]["ttft"])) if target else None
    parts = []
    cold_rows = [cold_row(s, r["cold"], peak, target_ttft) for s, r in results.items() if "cold" in r]
    if cold_rows:
        cols = [c for c in COLD_COLUMNS if any(c in r for r in cold_rows)]
        parts += [(f"Cold {COLD_TOKENS:,}-token prompt (random token ids, never cached), one at a time, median of "
                  f"{repeats} (range). FMA limit: {peak:.1f} GFLOP/s fp32 on one core (`kvmesh bench machine`'s "
                  f"probe, in this run); the prompt is {prefill_flops(COLD_TOKENS) / 1e9:.0f} GFLOP (matmuls and "
                  f"causal attention). `engine CPU s`: the engine thread's CPU time in the prompt's steps (its "
                  f"step counters)."), markdown_table(cold_rows, cols)]
    slo_rows = [slo_row(s, r["slo"]) for s, r in results.items() if "slo" in r]
    if slo_rows:
        parts += [(f"Scenario C: {STREAMS} streams decoding ({STREAM_TOKENS} tokens each) while {LONG_PROMPTS} "
                  f"{COLD_TOKENS:,}-token prompts arrive {ARRIVAL_GAP_S:g} s apart ({LONG_TOKENS} tokens each); "
                  f"every request asks TTFT <= {TARGETS.ttft_s:g} s and ITL p99 <= {TARGETS.itl_s * 1e3:.0f} ms "
                  f"(`kvmesh_slo`); goodput: the requests that met both, at the client (429: refused at once by "
                  f"admission control, which kvmesh's router applies to the TTFT target)."),
                  markdown_table(slo_rows, SLO_COLUMNS)]
    return "\n\n".join(parts)


async def run(stream: Stream, rid: Callable[[], str], scenarios: set[str], repeats: int,
              probe: Probe | None = None) -> dict:
    out: dict = {}
    if "cold" in scenarios:
        await stream(rid(), prompt(64, 1), 2)  # warm-up: first-call costs
        out["cold"] = await cold(stream, rid, repeats, probe)
    if "slo" in scenarios:
        out["slo"] = await scenario_c(stream, rid)
    return out
