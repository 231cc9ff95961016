"""PNG plots of serving runs (matplotlib, imported only here and only when plotting). Without matplotlib the
plots are skipped with one line that says how to get them."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path

from app.bench.stats import RequestRecord


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'kvmesh[plots]')", file=sys.stderr)
        return None
    return plt


def _cdf(ax, values: Sequence[float], label: str) -> None:
    xs = sorted(v * 1000 for v in values)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def plot_runs(out: Path, runs: dict[str, list[RequestRecord]]) -> list[Path]:
    """ttft_cdf.png, itl_cdf.png, timeline.png (TTFT of each request against its start; failures as x)."""
    plt = _pyplot()
    if plt is None:
        return []
    paths = []
    for name, title, values in (
            ("ttft_cdf.png", "TTFT", lambda rs: [r.ttft_s for r in rs if r.ok]),
            ("itl_cdf.png", "inter-token latency", lambda rs: [g for r in rs if r.ok for g in r.itl_s])):
        fig, ax = plt.subplots(figsize=(6.4, 4))
        for label, recs in runs.items():
            _cdf(ax, values(recs), label)
        ax.set(xlabel=f"{title} (ms)", ylabel="fraction of requests" if "TTFT" in title else "fraction of gaps",
               title=f"{title}, CDF")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for label, recs in runs.items():
        ok = [(r.start_s, r.ttft_s * 1000) for r in recs if r.ok and r.ttft_s is not None]
        line = ax.plot([x for x, _ in ok], [y for _, y in ok], "o", ms=3, label=label)[0]
        bad = [(r.start_s, r.e2e_s * 1000) for r in recs if not r.ok and r.e2e_s is not None]
        if bad:
            ax.plot([x for x, _ in bad], [y for _, y in bad], "x", color=line.get_color(),
                    label=f"{label}: failed (at its end)")
    ax.set(xlabel="request start (s into the run)", ylabel="TTFT (ms)", title="TTFT over the run")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=110)
    plt.close(fig)
    paths.append(out / "timeline.png")
    return paths


def plot_ablation(out: Path, rows: list[dict]) -> list[Path]:
    """ablation_ttft.png: TTFT p50 (bar) and p90 (whisker) per scenario, one bar per configuration;
    ablation_cached.png: prefill tokens saved per scenario and configuration. ``rows`` carry ``config``,
    ``scenario``, ``ttft_p50_s``, ``ttft_p90_s``, ``cached_tokens``."""
    plt = _pyplot()
    if plt is None:
        return []
    configs = list(dict.fromkeys(r["config"] for r in rows))
    scenarios = list(dict.fromkeys(r["scenario"] for r in rows))
    cell = {(r["config"], r["scenario"]): r for r in rows}
    width = 0.8 / max(1, len(configs))
    paths = []
    for name, ylabel, get in (
            ("ablation_ttft.png", "TTFT p50 ms (whisker: p90)",
             lambda r: (r["ttft_p50_s"] * 1000, max(0.0, (r["ttft_p90_s"] - r["ttft_p50_s"]) * 1000))),
            ("ablation_cached.png", "prefill tokens saved (cached_tokens)", lambda r: (r["cached_tokens"], 0.0))):
        fig, ax = plt.subplots(figsize=(8, 4))
        for i, c in enumerate(configs):
            vals = [get(cell[c, s]) if (c, s) in cell and not math.isnan(cell[c, s]["ttft_p50_s"]) else (0.0, 0.0)
                    for s in scenarios]
            xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(scenarios))]
            errors = [v[1] for v in vals]
            ax.bar(xs, [v[0] for v in vals], width, label=c, capsize=2,
                   yerr=[[0] * len(vals), errors] if any(errors) else None)
        ax.set_xticks(range(len(scenarios)), [s.replace(": ", ":\n") for s in scenarios])
        ax.set(ylabel=ylabel, title="kvmesh bench ablation")
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(title="config")
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    return paths
