"""Scenario C with its targets from the tenant's SLO class instead of the request, against the same scenario with
per-request targets, in one sitting.

    kvmesh bench slo-class [--rounds 2] [--threads 1] [--no-write]

One ``kvmesh up --prefill 0 --decode 0 --both 1`` stack with API keys on runs scenario C (``app.bench.prefill_slo``)
``2 x rounds`` times, the two modes alternating A B B A ...:

- ``per-request targets``: a tenant of class ``standard`` (no targets) whose every request carries
  ``kvmesh_slo`` (TTFT <= 6 s, ITL p99 <= 150 ms);
- ``tenant's class``: a tenant of class ``interactive`` (``slo_classes``: the same 6 s / 150 ms) whose requests carry
  none; the router gives them the class's targets (``services/router/access.py``, ``TenantTerms``).

Each run has tenants of its own, so every run sends the same prompts and none reuses another's KV (a tenant's cache
salt enters its block keys). Goodput is counted at the client against the same targets in both modes; the router's
``kvmesh_router_slo_requests_total`` says how many of a run's requests it served with targets, and how many of
those met them as it saw them.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from itertools import count
from pathlib import Path

from kvmesh.contracts.slo import SLO

from app.bench import prefill_slo
from app.bench.engine_serving import http_stream
from app.bench.report import load_average, markdown_table, publish
from app.launcher import Stack, StackOptions

SECTION = "Scenario C: the tenant's SLO class vs per-request targets"
HEADERS, CLASS = "per-request targets", "tenant's class"
TARGETS = prefill_slo.TARGETS
CLASSES = {"interactive": f"{TARGETS.ttft_s:g}/{TARGETS.itl_s:g}", "standard": "0/0"}


def schedule(rounds: int) -> list[str]:
    """The modes in the order run: A B B A A B ..., so neither always runs first or on a warmer stack."""
    pairs = [(HEADERS, CLASS), (CLASS, HEADERS)]
    return [mode for r in range(rounds) for mode in pairs[r % 2]]


def tenants(modes: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """The router's ``api_keys`` (one key per run: ``key-<i>`` -> tenant ``run<i>``) and ``tenant_classes``: a
    per-request-targets run's tenant is ``standard`` (the default class), a class run's ``interactive``."""
    keys = {f"key-{i}": f"run{i}" for i in range(len(modes))}
    classes = {f"run{i}": "interactive" if mode == CLASS else "standard" for i, mode in enumerate(modes)}
    return keys, classes


def stack_options(modes: list[str], threads: int) -> StackOptions:
    keys, classes = tenants(modes)
    return StackOptions.local("slo-class", prefill=0, decode=0, both=1, settings={
        "engine": {"threads": threads, "max_num_seqs": 64},
        "router": {"api_keys": keys, "tenant_classes": classes, "slo_classes": CLASSES}})


async def router_slo_counts(session, url: str) -> dict[str, float]:
    """The router's ``kvmesh_router_slo_requests_total`` by outcome (met, missed, ...)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(url) as r:
        text = await r.text()
    return {s.labels["outcome"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "kvmesh_router_slo_requests_total"}


async def run(rounds: int = 2, threads: int = 1) -> list[dict]:
    """One row per scenario C run: ``mode``, ``rows`` (prefill_slo's per request), ``router`` (the change in the
    router's SLO counts over the run)."""
    import aiohttp

    modes = schedule(rounds)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Path(tmp), stack_options(modes, threads))
        await asyncio.to_thread(stack.start, timeout_s=300)
        try:
            timeout = aiohttp.ClientTimeout(total=600)
            async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
                ids = count()
                warm = http_stream(session, stack.router_http, headers={"x-api-key": "key-0"})
                await warm(f"warm{next(ids)}", prefill_slo.prompt(64, 1), 2)  # first-call costs
                for i, mode in enumerate(modes):
                    stream = http_stream(session, stack.router_http, headers={"x-api-key": f"key-{i}"})
                    before = await router_slo_counts(session, stack.router_metrics)
                    sent: SLO | None = TARGETS if mode == HEADERS else None
                    rows = await prefill_slo.scenario_c(stream, lambda: f"c{next(ids)}", sent)
                    after = await router_slo_counts(session, stack.router_metrics)
                    out.append({"mode": mode, "rows": rows,
                                "router": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}})
                    await asyncio.sleep(2.0)  # the last stream's end reached the engine
        finally:
            await asyncio.to_thread(stack.stop)
    return out


def good(rows: list[dict]) -> int:
    return sum(r["ttft_met"] and r["itl_met"] for r in rows)


def render(runs: list[dict]) -> str:
    table = []
    for i, r in enumerate(runs):
        row = prefill_slo.slo_row(f"{i + 1}: {r['mode']}", r["rows"])
        routed = r["router"]
        row["router: served with targets / met"] = (f"{routed.get('met', 0) + routed.get('missed', 0):.0f} / "
                                                    f"{routed.get('met', 0):.0f}")
        table.append(row)
    totals = [{"mode": mode, "goodput": f"{sum(good(r['rows']) for r in mine)} of "
                                        f"{sum(len(r['rows']) for r in mine)}",
               "per run": " / ".join(str(good(r["rows"])) for r in mine)}
              for mode in (HEADERS, CLASS) for mine in [[r for r in runs if r["mode"] == mode]]]
    return "\n\n".join([
        markdown_table(table, ["setup", *prefill_slo.SLO_COLUMNS[1:], "router: served with targets / met"]),
        "Goodput by mode, over its runs:",
        markdown_table(totals, ["mode", "goodput", "per run"])])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench slo-class")
    p.add_argument("--rounds", type=int, default=2, help="pairs of runs (one of each mode per pair)")
    p.add_argument("--threads", type=int, default=1, help="the engine's threads")
    p.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = p.parse_args(argv)
    start = load_average()
    runs = asyncio.run(run(args.rounds, args.threads))
    s = prefill_slo
    body = (f"Scenario C ({s.STREAMS} streams decoding, {s.STREAM_TOKENS} tokens each, while {s.LONG_PROMPTS} "
            f"{s.COLD_TOKENS:,}-token prompts arrive {s.ARRIVAL_GAP_S:g} s apart, {s.LONG_TOKENS} tokens each) "
            f"through one `kvmesh up --prefill 0 --decode 0 --both 1` (default model, quantized weights, "
            f"{args.threads} thread), API keys on, {len(runs)} runs, the modes alternating (A B, B A, A B, ...). "
            f"`{HEADERS}`: a tenant of class `standard` (no targets), every request carrying `kvmesh_slo` TTFT <= "
            f"{TARGETS.ttft_s:g} s, "
            f"ITL p99 <= {TARGETS.itl_s * 1e3:.0f} ms; `{CLASS}`: a tenant of class `interactive` "
            f"(`slo_classes` {CLASSES['interactive']}, the same targets), its requests carrying none. Each run "
            "has tenants of its own (the same prompts, no KV reused across runs). Goodput: the requests that met "
            "both targets, at the client (429: refused at once by the router's admission control, by the TTFT "
            "target). `router: served with targets / met`: the run's change in "
            "`kvmesh_router_slo_requests_total` (requests completed with a target; met, as the router saw "
            "them).\n\n" + render(runs)
            + f"\n\nLoad average (1, 5, 15 min): {start} at the start, {load_average()} at the end.")
    command = "kvmesh bench slo-class" + (f" --rounds {args.rounds}" if args.rounds != 2 else "") + (
        f" --threads {args.threads}" if args.threads != 1 else "")
    publish(SECTION, command, body, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
