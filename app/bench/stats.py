"""Serving metrics from per-request records: quantiles, SLO goodput, throughput, cache reuse. Pure functions.

A request's latencies, as a client sees them while streaming:
- TTFT: send → first content chunk;
- ITL: the gaps between successive content chunks (every gap of every request goes into one distribution);
- TPOT: (end-to-end − TTFT) / (output tokens − 1), the request's mean time per output token;
- end-to-end: send → last byte.

Goodput counts the requests that succeeded and met the SLO, per second of the run: TTFT ≤ ``SLO.ttft_s`` and the
request's mean inter-token latency (its TPOT) ≤ ``SLO.itl_s`` — DistServe's definition, as vLLM's ``--goodput``
uses it. A request with one output token has no ITL and is judged on TTFT alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

QUANTILES = (50, 90, 99)
# Every percentile kvmesh reports (bench tables, serve summaries, the progress bar): numpy's default, linear
# interpolation between the closest ranks (Hyndman & Fan type 7, the same as statistics.quantiles' "inclusive").
PERCENTILE_METHOD = "linear"


@dataclass
class RequestRecord:
    """What one request did, as measured at the client. Times are seconds; ``start_s`` is relative to the run."""

    key: str                                   # "<conversation>/<turn>": stable across runs of one workload
    start_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0                     # from usage when the server reports it, else content chunks
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # the output's, when the request asked (return_token_ids)
    error: str | None = None
    timed_out: bool = False
    phase: str = ""                            # workload phase (e.g. hot-set switch: "X", "Y", "X again")

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out and self.ttft_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.e2e_s is None or self.output_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)  # type: ignore[operator]


@dataclass(frozen=True)
class SLO:
    ttft_s: float = 2.0
    itl_s: float = 0.2   # the request's mean inter-token latency (TPOT)

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok or r.ttft_s > self.ttft_s:  # type: ignore[operator]
            return False
        tpot = r.tpot_s
        return tpot is None or tpot <= self.itl_s


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) of ``values``: ``numpy.percentile`` with ``PERCENTILE_METHOD``; NaN for no
    values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within [0, 100], not {q}")
    xs = np.fromiter(values, dtype=float)
    return float(np.percentile(xs, q, method=PERCENTILE_METHOD)) if xs.size else math.nan


def quantiles(values: Iterable[float], qs: Sequence[float] = QUANTILES) -> dict[str, float]:
    """``{"mean", "p50", "p90", "p99", "max", "count"}`` of ``values`` (NaN where empty)."""
    xs = list(values)
    out: dict[str, float] = {f"p{q:g}": percentile(xs, q) for q in qs}
    out["mean"] = sum(xs) / len(xs) if xs else math.nan
    out["max"] = max(xs) if xs else math.nan
    out["count"] = len(xs)
    return out


def goodput(records: Sequence[RequestRecord], slo: SLO, duration_s: float) -> float:
    """Requests per second that succeeded within the SLO."""
    if duration_s <= 0:
        return 0.0
    return sum(slo.met_by(r) for r in records) / duration_s


def cached_ratio(records: Sequence[RequestRecord]) -> float:
    """Cached prompt tokens / prompt tokens, over the requests whose usage reported both; NaN if none did."""
    pairs = [(r.cached_tokens, r.prompt_tokens) for r in records
             if r.ok and r.cached_tokens is not None and r.prompt_tokens]
    total = sum(p for _, p in pairs)
    return sum(c for c, _ in pairs) / total if total else math.nan


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> dict:
    """Every headline figure of a run; JSON-serializable (NaN where there is nothing to measure)."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    met = sum(slo.met_by(r) for r in records)
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": sum(r.error is not None and not r.timed_out for r in records),
        "timeouts": sum(r.timed_out for r in records),
        "duration_s": duration_s,
        "ttft_s": quantiles(r.ttft_s for r in ok),  # type: ignore[misc]
        "itl_s": quantiles(g for r in ok for g in r.itl_s),
        "tpot_s": quantiles(t for r in ok if (t := r.tpot_s) is not None),
        "e2e_s": quantiles(r.e2e_s for r in ok if r.e2e_s is not None),  # type: ignore[misc]
        "throughput_req_s": len(ok) / duration_s if duration_s > 0 else 0.0,
        "throughput_tok_s": out_tokens / duration_s if duration_s > 0 else 0.0,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "cached_ratio": cached_ratio(records),
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
        "slo_met": met,
        "slo_attainment": met / len(records) if records else math.nan,
        "goodput_req_s": goodput(records, slo, duration_s),
    }


def ms(x: float) -> str:
    """Seconds as milliseconds for a table cell ("-" for NaN/None)."""
    return "-" if x is None or math.isnan(x) else f"{x * 1000:.0f}"
