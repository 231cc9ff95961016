"""Routing vLLM instances from vLLM's own KV events: kvmesh's router against the routers people put in front of
vLLM, on two vLLM engines with the same engine arguments (``vllm_servers.EngineShape``), in one run.

    kvmesh bench vllm --routing [--tenants 8] [--per-tenant 6] [--system-words 640] [--question-words 40]
                                [--max-tokens 8] [--concurrency 4] [--quick] [--no-write] [--workdir DIR]
    python -m app.bench.vllm_routing [same options]

The workload: several tenants, each with its own long system prompt that all its requests share, plus a question
of each request's own; the requests of all tenants interleaved (shuffled with a fixed seed), ``--concurrency`` in
flight, each streamed with ``stream_options.include_usage`` (its cached tokens) and timed at the client as ``kvmesh
bench serve`` does (TTFT: the first content chunk). The
tenants' system prompts together hold more KV than one engine's cache and fit in two: where a tenant's requests
go decides what is cached. A tenant is an API key on kvmesh (``router.api_keys``: the tenant salts its block keys
and vLLM's ``cache_salt``) and the request field ``cache_salt`` on the standalone servers, so tenants never share
KV on either. Prompts are text: ``sglang-router`` refuses token-id prompts, and both routers' ``cache_aware``
match the prompt's characters; ``vllm-router``'s ``kv_aware`` gets the same prompts as the token ids the model's
tokenizer makes of them (it routes on token ids and found none in a text prompt).

What runs, one after the other (never two at once: 2 cores):
1. Two standalone ``vllm serve`` (``--enable-prompt-tokens-details`` for ``cached_tokens``, ``--kv-events-config``
   publishing on TCP for ``vllm-router``'s ``kv_aware``), and in front of them in turn: ``vllm-router``
   ``round_robin``, ``cache_aware`` and ``kv_aware`` (fed by both servers' KV events), ``sglang-router``
   ``cache_aware``. Then the servers stop.
2. ``kvmesh up --engine-backend vllm --prefill 0 --decode 0 --both 2`` with the pool off: ``cache_aware`` and
   ``round_robin`` (the per-request header ``x-kvmesh-policy``).
3. The same with the pool on: ``round_robin`` and ``cache_aware``; the pool's bytes fetched are the instances'
   ``kvmesh_worker_kv_transfer_bytes_total{direction="pool_fetch"}`` over the run.

Every run gets prompts of its own (the same shapes, other words), so nothing one run left in a cache or a
router's index can serve another. Ports: the standalone servers, their KV-event sockets and the routers get ports
picked free right before each starts, retried on a bind failure (``vllm_servers``); the kvmesh stacks bind port 0
themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.model_source.tokenizer import Tokenizer

from app.bench.report import load_average, markdown_table, publish
from app.bench.serve import stream_request
from app.bench.stats import SLO, RequestRecord, percentile, summarize
from app.bench.vllm_servers import (
    POOL_FETCH,
    EngineShape,
    Router,
    VLLMServer,
    default_model,
    free_port,
    instance_metric,
    kvmesh_stack,
    package_version,
    vllm_version,
)
from app.bench.workloads import prose

SECTION = "Routing vLLM instances: kvmesh vs vllm-router and sglang-router"


@dataclass(frozen=True)
class Request:
    tenant: str
    prompt: str


def workload(tenants: int, per_tenant: int, system_words: int, question_words: int, seed: int,
             words_seed: int = 0) -> list[Request]:
    """``tenants`` x ``per_tenant`` requests, each its tenant's system prompt then a question of its own, in an
    order shuffled by ``seed``; the words from ``words_seed`` (another one: the same workload in other words)."""
    rng = random.Random(words_seed)
    systems = {f"tenant{i}": f"You are the assistant of tenant {i}. {prose(rng, system_words)}"
               for i in range(tenants)}
    out = [Request(t, f"{system}\n\nQuestion {j}: {prose(rng, question_words)}\nAnswer:")
           for t, system in systems.items() for j in range(per_tenant)]
    random.Random(seed).shuffle(out)
    return out


@dataclass
class RunResult:
    """One routing run: what ran and each request's record."""
    label: str
    system: str                  # "kvmesh" or "vllm serve x2"
    router: str                  # what routed (e.g. "vllm-router 0.1.17 --policy kv_aware")
    pool: str                    # "on", "off" or "" (standalone)
    records: list[RequestRecord]
    duration_s: float
    pool_fetch_bytes: float | None = None
    note: str = ""

    @property
    def summary(self) -> dict:
        return summarize(self.records, self.duration_s, SLO())


def share(records: list[RequestRecord]) -> float:
    """Cached-token share: the requests' ``cached_tokens`` over their prompt tokens (ok requests only)."""
    return summarize(records, 1.0, SLO())["cached_ratio"]


def row(r: RunResult) -> dict:
    s = r.summary
    ttft = [x.ttft_s for x in r.records if x.ok]
    return {"run": r.label, "routing": r.router, "pool": r.pool or "-", "ok": f"{s['ok']}/{s['requests']}",
            "cached share": _pct(s["cached_ratio"]),
            "cached / prompt tokens": f"{s['cached_tokens']} / {s['prompt_tokens']}",
            "TTFT p50 ms": _ms(percentile(ttft, 50)), "TTFT p90 ms": _ms(percentile(ttft, 90)),
            "pool fetched MB": "-" if r.pool_fetch_bytes is None else f"{r.pool_fetch_bytes / 1e6:.1f}"}


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x * 100:.1f}%"


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f}"


def _p90(r: RunResult) -> float:
    return percentile([x.ttft_s for x in r.records if x.ok], 90)


def comparisons(runs: dict[str, RunResult]) -> list[dict]:
    """The targets of issue 26 that these runs can judge: kvmesh's cache-aware share >= 1.5x round robin's (pool
    off); the pool raising round robin's share; kvmesh's best share and TTFT p90 at least as good as each router's
    that ran."""
    out = []

    def add(what: str, value: float, target: str, met: bool) -> None:
        out.append({"comparison": what, "value": "n/a" if math.isnan(value) else f"{value:.2f}x", "target": target,
                    "met": "yes" if met else "**no**"})

    ca, rr = runs.get("kvmesh cache_aware, pool off"), runs.get("kvmesh round_robin, pool off")
    if ca and rr:
        v = share(ca.records) / share(rr.records) if share(rr.records) else math.inf
        add("kvmesh cache_aware / round_robin, cached share (pool off)", v, "≥ 1.50x", v >= 1.5)
    rr_pool = runs.get("kvmesh round_robin, pool on")
    if rr and rr_pool:
        v = share(rr_pool.records) / share(rr.records) if share(rr.records) else math.inf
        add("kvmesh round_robin, pool on / pool off, cached share", v, "> 1.00x", v > 1.0)
    ours = [r for name, r in runs.items() if name.startswith("kvmesh cache_aware")]
    if not ours:
        return out
    best = max(ours, key=lambda r: share(r.records))
    for name, r in runs.items():
        if r.system == "kvmesh" or "round_robin" in name or not r.records:
            continue
        v = share(best.records) / share(r.records) if share(r.records) else math.inf
        add(f"{best.label} / {name}, cached share", v, "≥ 1.00x", v >= 1.0)
        v = _p90(best) / _p90(r)
        add(f"{best.label} / {name}, TTFT p90", v, "≤ 1.00x", v <= 1.0)
    return out


# -- driving a run ------------------------------------------------------------------------------------------------

async def drive(url: str, requests: list[Request], concurrency: int, max_tokens: int,
                body_extra: Callable[[Request], dict], headers: Callable[[Request], dict[str, str]],
                timeout_s: float = 600.0) -> tuple[list[RequestRecord], float]:
    """Closed loop: ``concurrency`` workers take the requests in order. Returns the records and the wall time."""
    import aiohttp

    records = [RequestRecord(f"{i}:{r.tenant}") for i, r in enumerate(requests)]
    todo = list(range(len(requests)))[::-1]
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def worker() -> None:
            while todo:
                i = todo.pop()
                req = requests[i]
                body = {"prompt": req.prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}, **body_extra(req)}
                records[i].start_s = time.perf_counter() - t0
                await stream_request(session, url + "/v1/completions", body, records[i], timeout_s,
                                     {"content-type": "application/json", **headers(req)})

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, time.perf_counter() - t0


@dataclass
class Plan:
    tenants: int = 8
    per_tenant: int = 6
    system_words: int = 640
    question_words: int = 40
    max_tokens: int = 8
    concurrency: int = 4
    seed: int = 0
    shape: EngineShape = field(default_factory=EngineShape)

    def requests(self, label: str) -> list[Request]:
        """The run ``label``'s prompts: the same tenants, sizes and order every run, other words."""
        return workload(self.tenants, self.per_tenant, self.system_words, self.question_words, self.seed,
                        zlib.crc32(label.encode()))


def kvmesh_keys(tenants: int) -> dict[str, str]:
    return {f"sk-tenant{i}": f"tenant{i}" for i in range(tenants)}


class Runner:
    def __init__(self, plan: Plan, work: Path, log: Callable[[str], None] = print) -> None:
        self.plan, self.work, self.log = plan, work, log
        self.runs: dict[str, RunResult] = {}
        self.failed: dict[str, str] = {}  # what could not run, and why
        self.commands: list[str] = []
        self.tokenizer = Tokenizer.from_dir(default_model()[0])

    def record(self, result: RunResult) -> None:
        self.runs[result.label] = result
        r = row(result)
        self.log(" ".join(f"{k}={v}" for k, v in r.items()))

    def run(self, label: str, system: str, router: str, pool: str, url: str, body_extra, headers,
            metrics: list[str] | None = None) -> None:
        requests = self.plan.requests(label)
        fetched = [instance_metric(m, *POOL_FETCH) for m in metrics or []]
        records, wall = asyncio.run(drive(url, requests, self.plan.concurrency, self.plan.max_tokens, body_extra,
                                          headers))
        after = [instance_metric(m, *POOL_FETCH) for m in metrics or []]
        pool_bytes = sum(after) - sum(fetched) if metrics and pool == "on" else None
        self.record(RunResult(label, system, router, pool, records, wall, pool_bytes))

    # -- standalone servers and their routers --------------------------------------------------------------------
    def standalone(self, routers: list[tuple[str, str, list[str]]]) -> None:
        """``routers``: (label, kind, policy flags) each run in front of the same two servers."""
        model_dir, _ = default_model()
        servers, events = [], []
        try:
            for i in range(2):
                pub, replay = free_port(), free_port()
                events.append((pub, replay))
                cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                       "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"}
                self.log(f"starting vllm serve {i} ...")
                servers.append(VLLMServer(f"vllm-serve-{i}", self.work, self.plan.shape,
                                          ["--enable-prompt-tokens-details", "--kv-events-config", json.dumps(cfg)]))
            self.commands.append(f"{servers[0].command(model_dir)} --enable-prompt-tokens-details --kv-events-config "
                                 "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
                                 "\"tcp://*:PORT\", \"replay_endpoint\": \"tcp://*:PORT2\", \"topic\": "
                                 "\"kv-events\"}' (x2, each its own ports)")
            model = servers[0].model
            urls = [s.url for s in servers]
            for label, kind, policy in routers:
                flags, shown = list(policy), " ".join(policy)
                prompt = dict[str, list[int]]()  # text -> its token ids, for a router that routes on them
                if kind == "vllm-router" and "kv_aware" in policy:
                    prompt = {r.prompt: self.tokenizer.encode(r.prompt) for r in self.plan.requests(label)}
                    flags += [a for (u, (pub, replay)) in zip(urls, events, strict=True) for a in (
                        "--kv-event-source", f"{u}=tcp://127.0.0.1:{pub}",
                        "--kv-event-replay-source", f"{u}=tcp://127.0.0.1:{replay}")]
                    flags += ["--kv-event-block-size", str(self.plan.shape.block_size), "--kv-event-model", model_dir]
                    shown += (f" --kv-event-source SERVER=tcp://127.0.0.1:PORT --kv-event-replay-source "
                              f"SERVER=tcp://127.0.0.1:PORT2 (each server) --kv-event-block-size "
                              f"{self.plan.shape.block_size} --kv-event-model <model dir> "
                              "(VLLM_ROUTER_TOKENIZER=<model dir>); prompts sent as the token ids the model's "
                              "tokenizer gives the text (with text prompts its kv_aware found no tokens to route on "
                              "and fell back to the least loaded server for every request)")
                version = package_version(kind)
                try:
                    router = Router(label.replace(" ", "-"), self.work, kind, urls, flags,
                                    env={"VLLM_ROUTER_TOKENIZER": model_dir})
                except RuntimeError as e:
                    self.failed[label] = f"{kind} {version} did not start: {e}"
                    self.log(f"{label}: {self.failed[label]}")
                    continue
                self.commands.append(f"{kind} {version} --worker-urls <the two servers> {shown}")
                try:
                    self.run(label, "vllm serve x2", f"{kind} {' '.join(policy)}", "", router.url,
                             lambda r, ids=prompt: {"model": model, "cache_salt": r.tenant,
                                                    **({"prompt": ids[r.prompt]} if ids else {})},
                             lambda r: {})
                finally:
                    router.save_metrics()
                    router.stop()
        finally:
            for s in servers:
                s.stop()

    # -- kvmesh -------------------------------------------------------------------------------------------------
    def kvmesh(self, pool: bool, policies: list[str]) -> None:
        state = "on" if pool else "off"
        self.log(f"starting kvmesh --both 2, pool {state} ...")
        plan = self.plan
        stack = kvmesh_stack(self.work / f"kvmesh-pool-{state}", f"bench-vllm-routing-{state}", plan.shape, both=2,
                             pool=pool, router={"api_keys": kvmesh_keys(plan.tenants)},
                             cachesvc={"pool_capacity_mb": 2048})
        try:
            self.commands.append(f"kvmesh up --engine-backend vllm --prefill 0 --decode 0 --both 2 (the same engine "
                                 f"arguments), router.api_keys one per tenant, pool {state}"
                                 + (", cachesvc.pool_capacity_mb 2048" if pool else ""))
            metrics = [s.endpoints["metrics"] for s in stack.services if s.name.startswith("both")]
            keys = {t: k for k, t in kvmesh_keys(plan.tenants).items()}
            for policy in policies:
                self.run(f"kvmesh {policy}, pool {state}", "kvmesh", f"kvmesh {policy}", state, stack.router_http,
                         lambda r: {}, lambda r, p=policy: {"authorization": f"Bearer {keys[r.tenant]}",
                                                            "x-kvmesh-policy": p}, metrics)
        finally:
            stack.stop()


ROUTERS = [  # (run label, router, flags)
    ("vllm-router round_robin", "vllm-router", ["--policy", "round_robin"]),
    ("vllm-router cache_aware", "vllm-router", ["--policy", "cache_aware"]),
    ("vllm-router kv_aware", "vllm-router", ["--policy", "kv_aware"]),
    ("sglang-router cache_aware", "sglang-router", ["--policy", "cache_aware"]),
]


def system_tokens(plan: Plan) -> int:
    """The tokens of all the tenants' system prompts (of one run's words), by the model's tokenizer."""
    tok = Tokenizer.from_dir(default_model()[0])
    systems = {r.tenant: r.prompt.split("\n\nQuestion")[0] for r in plan.requests("sizes")}
    return sum(len(tok.encode(text)) for text in systems.values())


def render(runner: Runner, loads: tuple[str, str]) -> str:
    p = runner.plan
    cols = ["run", "routing", "pool", "ok", "cached share", "cached / prompt tokens", "TTFT p50 ms", "TTFT p90 ms",
            "pool fetched MB"]
    rows = [row(r) for r in runner.runs.values()]
    prompt_tokens = [x.prompt_tokens for r in runner.runs.values() for x in r.records if x.prompt_tokens]
    mean_prompt = sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else float("nan")
    parts = [
        (f"{p.tenants} tenants x {p.per_tenant} requests, shuffled; each prompt its tenant's system prompt "
         f"({p.system_words} words) and a question of its own ({p.question_words} words): {mean_prompt:.0f} tokens "
         f"on average; {p.max_tokens} output tokens (`ignore_eos`), {p.concurrency} in flight, streamed. Two vLLM "
         f"engines ({p.shape.describe()}; {vllm_version()}): each holds {p.shape.vllm_blocks * p.shape.block_size:,} "
         f"tokens of KV, the tenants' system prompts are {system_tokens(p):,} tokens together. Cached share: "
         "`usage.prompt_tokens_details.cached_tokens` over prompt tokens; TTFT at the client. Load average at the "
         f"start {loads[0]}, at the end {loads[1]}."),
        markdown_table(rows, cols),
        markdown_table(comparisons(runner.runs), ["comparison", "value", "target", "met"]),
        "What ran: " + "; ".join(f"`{c}`" for c in runner.commands) + ".",
    ]
    if runner.failed:
        parts.append("Could not run: " + "; ".join(f"{k}: {v}" for k, v in runner.failed.items()) + ".")
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench vllm --routing")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--per-tenant", type=int, default=6, help="requests per tenant")
    p.add_argument("--system-words", type=int, default=640, help="words of each tenant's system prompt")
    p.add_argument("--question-words", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--only", choices=["standalone", "kvmesh"], help="run one half only (a smoke run)")
    p.add_argument("--quick", action="store_true", help="4 tenants x 3 requests (a smoke run; not written)")
    p.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    p.add_argument("--workdir", help="keep the servers' and routers' logs and the stacks' state here")
    args = p.parse_args(argv)
    plan = Plan(args.tenants, args.per_tenant, args.system_words, args.question_words, args.max_tokens,
                args.concurrency)
    if args.quick:
        plan = Plan(4, 3, args.system_words, args.question_words, 4, 2)
    loads = [load_average()]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        runner = Runner(plan, work, lambda s: print(s, flush=True))
        steps = {"standalone": lambda: runner.standalone(ROUTERS),
                 "kvmesh": lambda: (runner.kvmesh(False, ["cache_aware", "round_robin"]),
                                    runner.kvmesh(True, ["round_robin", "cache_aware"]))}
        for name, step in steps.items():
            if args.only and name != args.only:
                continue
            try:
                step()
            except Exception as e:  # noqa: BLE001 - say what failed and keep the other half's figures
                traceback.print_exc()
                runner.failed[name] = f"{type(e).__name__}: {e}"
    loads.append(load_average())
    body = render(runner, (loads[0], loads[1]))
    cmd = "kvmesh bench vllm --routing" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if k in ("tenants", "per_tenant", "system_words", "question_words", "max_tokens", "concurrency")
        and v != p.get_default(k))
    publish(SECTION, cmd, body, write=not args.no_write and not args.quick and not args.only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
