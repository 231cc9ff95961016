"""``kvmesh bench ablation``: the fair table. The stack is started in each configuration and the same scenarios
run against each, through the OpenAI HTTP API, measured at the client.

    kvmesh bench ablation [--configs A,B,C,D,E] [--max-tokens 16] [--doc-words 150] [--device-blocks 36]
        [--host-cache-mb 8] [--concurrency 2] [--slo-ttft 1.0] [--slo-itl 0.25] [--out DIR] [--no-write]

Configurations (every engine gets the same small device KV pool, ``--device-blocks``, so the hot sets overflow
it and the lower tiers have something to do; and C–E the same host tier, ``--host-cache-mb``, smaller than one
hot set, so that what a set switch evicts outlives both engine tiers only in the pool, the one thing D adds):

- A: no cross-request reuse (prefix caching off, no pool): the full recompute baseline;
- B: local prefix cache only; C: + the host tier (``host_cache_mb``);
- D: + the pool (engines write finished blocks back to cachesvc and fetch pool hits), 1 prefill + 1 decode;
- E: D's caches on one ``both`` instance — PD disaggregation off. It gets 2 torch threads so it has D's 2 cores.

Scenarios, in this order on each fresh stack (after one unmeasured warm-up request):

- cold start: questions on the documents of hot set X, nothing cached yet;
- stable hot set: 3-turn conversations on X's documents (each turn re-sends the history);
- hot-set switch: questions on set Y, then on X again (did X survive Y?);
- low reuse: prompts that share nothing but the chat template;
- failure: questions on X; after the first ``--kill-after`` answers, the decode process (E: the only engine)
  is killed with SIGKILL. Failures and timeouts are counted; every request has a client timeout.

Correctness: greedy outputs of every configuration are compared with A's, request by request (failure excluded).
"Prefill tokens saved" is the sum of ``usage.prompt_tokens_details.cached_tokens``. Bytes loaded per tier come
from the engines' Prometheus metrics, scraped before and after each scenario: host → device (host-tier blocks
loaded × block bytes), pool → engine (``kv_transfer_bytes{direction="pool_fetch"}``) and prefill → decode (the KV
pushes); the pool's bytes held at the end (cachesvc ``Stats``) are reported too.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from kvmesh import tls
from prometheus_client.parser import text_string_to_metric_families

from app.bench import workloads as wl
from app.bench.report import markdown_table, write_section
from app.bench.serve import RunOptions, RunResult, run_workload
from app.bench.stats import SLO, RequestRecord, ms
from app.launcher import Stack, StackOptions

SECTION = "Ablation (A–E)"

SCENARIOS = ("cold start", "stable hot set", "hot-set switch", "low reuse", "failure")


@dataclass(frozen=True)
class Config:
    name: str
    meaning: str
    prefill: int = 1
    decode: int = 1
    both: int = 0
    pool: bool = False
    threads: int = 1
    env: dict[str, str] = field(default_factory=dict)

    def stack_options(self, device_blocks: int) -> StackOptions:
        env = {"KVMESH_ENGINE_NUM_BLOCKS": str(device_blocks), **self.env}
        return StackOptions.local(f"ablation{self.name.lower()}", prefill=self.prefill, decode=self.decode,
                                  both=self.both, pool=self.pool, env=env,
                                  settings={"engine": {"threads": self.threads}})

    @property
    def victim(self) -> str:
        """The process the failure scenario kills."""
        return "decode-0" if self.decode else "both-0"


HOST_CACHE_MB = 8  # 11 blocks of SmolLM2 fp32: less than a hot set (2 documents of ~150 words, ~26 blocks)


def configs(host_cache_mb: int = HOST_CACHE_MB) -> dict[str, Config]:
    host = {"KVMESH_ENGINE_HOST_CACHE_MB": str(host_cache_mb)}
    return {c.name: c for c in (
        Config("A", "no reuse (prefix cache off, no pool)", env={"KVMESH_ENGINE_ENABLE_PREFIX_CACHING": "0"}),
        Config("B", "local prefix cache"),
        Config("C", "local + host tier", env=host),
        Config("D", "local + host + pool, PD on (1 prefill + 1 decode)", pool=True, env=host),
        Config("E", "local + host + pool, PD off (1 both, 2 threads)", prefill=0, decode=0, both=1, pool=True,
               threads=2, env=host),
    )}


def scenarios(max_tokens: int = 16, doc_words: int = 150, seed: int = 0) -> dict[str, wl.Workload]:
    x = wl.documents(2, doc_words, seed)
    y = wl.documents(2, doc_words, seed, first=2)
    system = "Answer the question using only the document below.\n\n"
    chats = tuple(wl.Conversation(f"hot{d}", (wl.Turn(wl.QUESTIONS[2], max_tokens=max_tokens),
                                              wl.Turn(wl.FOLLOW_UPS[0], max_tokens=max_tokens),
                                              wl.Turn(wl.FOLLOW_UPS[1], max_tokens=max_tokens)), system + x[d])
                  for d in range(2))
    return {
        "cold start": wl.Workload("cold start", (wl.Phase("X", wl.doc_questions(x, 2, max_tokens, "x")),)),
        "stable hot set": wl.Workload("stable hot set", (wl.Phase("X chats", chats),)),
        "hot-set switch": wl.Workload("hot-set switch", (
            wl.Phase("Y", wl.doc_questions(y, 2, max_tokens, "y")),
            wl.Phase("X again", wl.doc_questions(x, 1, max_tokens, "x2", q_offset=3)))),
        "low reuse": wl.low_reuse(4, doc_words // 2, max_tokens, seed + 1),
        "failure": wl.Workload("failure", (wl.Phase("X", wl.doc_questions(x, 3, max_tokens, "f", q_offset=5)),)),
    }


def pool_bytes(stack: Stack) -> int | None:
    """Bytes the cachesvc pool holds (its ``Stats``), None when it does not answer."""
    from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc

    address = next(s.grpc_address for s in stack.services if s.name == "cachesvc")
    try:
        with tls.channel(address, cfg=stack.mesh_settings()) as ch:
            return cache_pb2_grpc.CacheServiceStub(ch).Stats(cache_pb2.StatsRequest(), timeout=5).pool_bytes
    except grpc.RpcError:
        return None


TIERS = ("host", "pool", "pd")
BLOCK_NBYTES = 737_280  # one 16-token block of SmolLM2-135M fp32  # host → device, pool → engine, prefill → decode


def metrics_urls(stack: Stack) -> list[str]:
    """Each engine's /metrics URL, as it reported it in its ready file (the port it bound)."""
    return [s.endpoints["metrics"] for s in stack.services
            if s.name.split("-")[0] in ("prefill", "decode", "both") and s.endpoints.get("metrics")]


def loaded_bytes(urls: list[str]) -> dict[str, float]:
    """Bytes loaded so far per tier, summed over the engines (a dead engine counts nothing)."""
    out = dict.fromkeys(TIERS, 0.0)
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                text = r.read().decode()
        except OSError:
            continue
        block_bytes, host_loads = 0.0, 0.0
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                if smp.name == "kvmesh_worker_kv_block_bytes":
                    block_bytes = smp.value
                elif smp.name == "kvmesh_worker_kv_host_moves_total" and smp.labels.get("direction") == "load":
                    host_loads = smp.value
                elif smp.name == "kvmesh_worker_kv_transfer_bytes_total":
                    direction = smp.labels.get("direction")
                    if direction == "pool_fetch":
                        out["pool"] += smp.value
                    elif direction == "push":
                        out["pd"] += smp.value
        out["host"] += host_loads * block_bytes
    return out


@dataclass
class ScenarioResult:
    config: str
    scenario: str
    run: RunResult
    pool_bytes: int | None
    loaded: dict[str, float] = field(default_factory=dict)  # bytes loaded per tier during the scenario
    killed_at_s: float | None = None
    startup_s: float = 0.0
    load_avg: float = 0.0          # the machine's 1-minute load average when the stack started


def run_config(cfg: Config, work: dict[str, wl.Workload], opts: RunOptions, device_blocks: int, kill_after: int,
               state_root: Path) -> list[ScenarioResult]:
    stack = Stack(state_root / cfg.name, cfg.stack_options(device_blocks))
    print(f"[{cfg.name}] starting the stack: {cfg.meaning}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    load = os.getloadavg()[0]
    stack.start(timeout_s=300)
    startup = time.monotonic() - t0
    print(f"[{cfg.name}] up in {startup:.0f} s", file=sys.stderr, flush=True)
    target = stack.http_port
    url = f"http://127.0.0.1:{target}"
    out: list[ScenarioResult] = []
    try:
        warm = wl.low_reuse(1, 20, 4, seed=12345)
        asyncio.run(run_workload(url, warm, opts, progress=False))
        urls = metrics_urls(stack)
        for name, workload in work.items():
            killed: list[float] = []
            on_record = None
            if name == "failure":
                on_record = _killer(stack, cfg, kill_after, killed)
            before = loaded_bytes(urls)
            run = asyncio.run(run_workload(url, workload, opts, f"[{cfg.name}] {name}", on_record=on_record))
            after = loaded_bytes(urls)
            out.append(ScenarioResult(cfg.name, name, run, pool_bytes(stack) if cfg.pool else None,
                                      {t: max(0.0, after[t] - before[t]) for t in TIERS},
                                      killed[0] if killed else None, startup, load))
    finally:
        stack.stop()
    return out


def _killer(stack: Stack, cfg: Config, kill_after: int, killed: list[float]):
    """A record callback that SIGKILLs the configuration's victim once ``kill_after`` requests succeeded, and
    appends the time of the kill (seconds since the callback was made) to ``killed``."""
    victim = next(s for s in stack.services if s.name == cfg.victim)
    started = time.monotonic()
    answered = 0

    def on_record(rec: RequestRecord) -> None:
        nonlocal answered
        answered += rec.ok
        if answered >= kill_after and not killed:
            victim.proc.kill()
            killed.append(time.monotonic() - started)
            print(f"\n[{cfg.name}] failure injected: killed {victim.name}", file=sys.stderr, flush=True)

    return on_record


# -- the table -------------------------------------------------------------------------------------------------

def outputs(results: list[ScenarioResult], config: str) -> dict[str, str]:
    """``"scenario/conversation/turn"`` → output text, for the requests that succeeded (failure excluded)."""
    return {f"{r.scenario}/{rec.key}": rec.text for r in results if r.config == config and r.scenario != "failure"
            for rec in r.run.records if rec.ok}


def agreement(results: list[ScenarioResult], config: str, reference: str = "A") -> tuple[int, int]:
    """(identical, compared): outputs equal to the reference configuration's, over requests both answered."""
    ours, ref = outputs(results, config), outputs(results, reference)
    both = ours.keys() & ref.keys()
    return sum(ours[k] == ref[k] for k in both), len(both)


def rows(results: list[ScenarioResult], slo: SLO) -> list[dict]:
    """One row per (configuration, scenario), or per phase where a scenario has several (the hot-set switch)."""
    out = []
    for r in results:
        parts = [(r.scenario, None)] if len(r.run.phases) <= 1 else [
            (f"{r.scenario}: {p}", p) for p, _ in r.run.phases]
        for n, (label, phase) in enumerate(parts):
            s = r.run.summary(slo, phase)
            saved = s["cached_tokens"]
            out.append({
                "config": r.config, "scenario": label, "order": (SCENARIOS.index(r.scenario), n),
                "ok": f"{s['ok']}/{s['requests']}", "failed / timed out": f"{s['errors']} / {s['timeouts']}",
                "TTFT p50/p90/p99 ms": "/".join(ms(s["ttft_s"][k]) for k in ("p50", "p90", "p99")),
                "ITL p50/p90/p99 ms": "/".join(ms(s["itl_s"][k]) for k in ("p50", "p90", "p99")),
                "goodput req/s": f"{s['goodput_req_s']:.2f} ({s['slo_met']}/{s['requests']})",
                "prefill tokens saved": f"{saved} / {s['prompt_tokens']}" + (
                    "" if not s["prompt_tokens"] else f" ({saved / s['prompt_tokens'] * 100:.0f}%)"),
                "MB loaded host / pool / PD": "-" if n or not r.loaded else " / ".join(
                    f"{r.loaded[t] / 2**20:.1f}" for t in TIERS),
                "pool MB held": "-" if r.pool_bytes is None else f"{r.pool_bytes / 2**20:.1f}",
                "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p90_s": s["ttft_s"]["p90"], "cached_tokens": saved,
                "summary": s,
            })
    return out


COLUMNS = ["scenario", "config", "ok", "failed / timed out", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms",
           "goodput req/s", "prefill tokens saved", "MB loaded host / pool / PD", "pool MB held"]


def report(results: list[ScenarioResult], cfgs: dict[str, Config], slo: SLO, args: argparse.Namespace) -> str:
    table = sorted(rows(results, slo), key=lambda r: (r["order"], r["config"]))
    names = list(dict.fromkeys(r.config for r in results))
    first = {r.config: r for r in reversed(results)}
    correctness = [{"config": c, "meaning": cfgs[c].meaning, "stack up s": f"{first[c].startup_s:.0f}",
                    "load avg": f"{first[c].load_avg:.1f}",
                    "outputs identical to A": "{}/{}".format(*agreement(results, c)) if "A" in names else "n/a"}
                   for c in names]
    kills = [f"{r.config}: {r.killed_at_s:.1f} s into the scenario" for r in results if r.killed_at_s is not None]
    intro = (f"Each configuration on a fresh stack, same requests, {args.concurrency} conversations in flight, "
             f"greedy, at most {args.max_tokens} output tokens, documents of ~{args.doc_words} words; every engine "
             f"has a device KV pool of {args.device_blocks} blocks of 16 tokens and (C–E) a {args.host_cache_mb} MB "
             "host tier, smaller than a hot set (2 documents, ~26 blocks), so what a hot-set switch evicts from the "
             "device outlives the host tier only in the pool (D, E). Default model, fp32, 1 torch thread per engine "
             "(E: 2, so D and E both use 2 cores). "
             f"SLO: TTFT ≤ {slo.ttft_s:g} s and mean ITL ≤ {slo.itl_s:g} s.")
    notes = (f"Failure: the decode process (E: the only engine) got SIGKILL after {args.kill_after} answers "
             f"({'; '.join(kills) or 'never reached'}); the router retries a request on another instance when its "
             "instance is unreachable before the first token, but these stacks have a single decode, so what was "
             "in flight or sent later failed fast or timed out. MB loaded per tier, summed over the engines for the "
             "whole scenario (a multi-phase scenario shows it on its first row): host → device tier loads, pool → "
             "engine fetches, prefill → decode KV pushes (A–D; E has no PD split). "
             + (pool_note(results) or "The pool served nothing in this run: an engine fetches from it only "
                "what its own tiers lack, and the host tier (C–E) held every block evicted from the device. ")
             + "Load avg: the machine's 1-minute load average when the configuration's stack started (2 cores; "
             "other jobs share the machine): latencies move with it, tokens saved and outputs do not.")
    return "\n\n".join([intro, markdown_table(correctness, ["config", "meaning", "stack up s", "load avg",
                                                               "outputs identical to A"]),
                        markdown_table(table, COLUMNS), notes])


def pool_note(results: list[ScenarioResult]) -> str:
    """What the pool served per configuration and scenario, in MB and in tokens of KV (16 per block)."""
    served = [f"{r.config} {r.scenario} {r.loaded['pool'] / 2**20:.1f} MB = "
              f"{r.loaded['pool'] / BLOCK_NBYTES * 16:.0f} tokens" for r in results if r.loaded.get("pool")]
    return ("The pool served (pool → engine fetches, KV its own tiers no longer held): " + "; ".join(served)
            + ". Compare D's and E's prefill tokens saved with C's, the same caches without the pool (a fetched "
            "block can also take the place of one the host tier would have served). "
            if served else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench ablation", description="configurations A–E × scenarios")
    p.add_argument("--configs", default="A,B,C,D,E")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset, in the listed order")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--doc-words", type=int, default=150)
    p.add_argument("--device-blocks", type=int, default=36, help="device KV blocks per engine (small on purpose)")
    p.add_argument("--host-cache-mb", type=int, default=HOST_CACHE_MB,
                   help="host tier of C-E (smaller than a hot set on purpose: the pool's use shows)")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--kill-after", type=int, default=2, help="failure: answers before the kill")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=1.0)
    p.add_argument("--slo-itl", type=float, default=0.25)
    p.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    p.add_argument("--out", help="output directory (default bench-out/ablation-<time>)")
    p.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = p.parse_args(argv)
    all_cfgs = configs(args.host_cache_mb)
    chosen = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in all_cfgs]
    work = scenarios(args.max_tokens, args.doc_words, args.seed)
    picked = [s.strip() for s in args.scenarios.split(",")]
    if unknown or any(s not in work for s in picked):
        print(f"kvmesh bench ablation: configs are {','.join(all_cfgs)}; scenarios are {', '.join(SCENARIOS)}",
              file=sys.stderr)
        return 2
    work = {s: w for s, w in work.items() if s in picked}
    slo = SLO(args.slo_ttft, args.slo_itl)
    opts = RunOptions(concurrency=args.concurrency, timeout_s=args.timeout, max_duration_s=300, slo=slo)
    results: list[ScenarioResult] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvmesh-ablation-") as tmp:
        for name in chosen:
            results += run_config(all_cfgs[name], work, opts, args.device_blocks, args.kill_after, Path(tmp))
    body = report(results, all_cfgs, slo, args)
    print(body)
    out = Path(args.out or f"bench-out/ablation-{time.strftime('%Y%m%d-%H%M%S')}")
    write_outputs(out, results, slo, body)
    print(f"\nablation took {time.monotonic() - started:.0f} s; results in {out}", file=sys.stderr)
    if not args.no_write and chosen == list(all_cfgs) and list(work) == list(SCENARIOS):
        command = "kvmesh bench ablation" + (" " + " ".join(argv) if argv else "")
        print(f"written to {write_section(SECTION, command, body)}")
    return 0


def write_outputs(out: Path, results: list[ScenarioResult], slo: SLO, body: str) -> None:
    import json
    from dataclasses import asdict

    from app.bench import plots
    from app.bench.serve import _json_safe

    out.mkdir(parents=True, exist_ok=True)
    table = rows(results, slo)
    data = {"rows": [{k: v for k, v in row.items() if k != "order"} for row in table],
            "runs": [{"config": r.config, "scenario": r.scenario, "pool_bytes": r.pool_bytes, "loaded_bytes": r.loaded,
                      "killed_at_s": r.killed_at_s, "startup_s": r.startup_s, "load_avg": r.load_avg,
                      "records": [asdict(x) for x in r.run.records]} for r in results]}
    (out / "results.json").write_text(json.dumps(_json_safe(data), indent=1))
    (out / "summary.md").write_text(body + "\n")
    plots.plot_ablation(out, [r for r in table if not math.isnan(r["ttft_p50_s"])])
