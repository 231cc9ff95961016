"""``kvmesh bench routers``: one router replica's decisions per second for 4k-token prompts, kvmesh's against
``vllm-router``'s and ``sglang-router``'s, on the same machine, prompts and stub workers, and what the kvmesh
router's CPU per request goes to.

    kvmesh bench routers [--tenants 8] [--per-tenant 32] [--tokens 4096] [--system-tokens 3584]
                         [--concurrency 32] [--seconds 20] [--workers 2] [--rounds 2] [--only LABEL,...]
                         [--no-profile]
                         [--no-write] [--workdir DIR]

The prompts: ``--tenants`` system prompts of ``--system-tokens`` tokens, each followed by ``--per-tenant``
questions of their own, ``--tokens`` tokens in all (the default model's tokenizer: text cut to that many ids and
decoded), shuffled with a fixed seed. Every router gets the same prompts in the same order, from the same client
(``drive``): ``--concurrency`` requests in flight, each ``POST /v1/completions`` with ``max_tokens`` 1, not
streamed; first every distinct prompt once (the warm-up: routers' trees, the stubs' memo), then the prompts again
and again for ``--seconds``; every router ``--rounds`` times, the order reversed each round, its round with the
most decisions/s kept (the machine is shared). Reported per router: decisions/s (requests answered 200 per
second of the measured window), latency p50 / p99 through the router, and the router's CPU seconds per request
(its process's utime + stime from /proc, every thread, before and after the window).

The workers are stubs that answer at once (``app.bench.stub_workers``), ``--workers`` of them: for kvmesh, engine
instances of role both announced by real heartbeats on NATS, behind a real cachesvc (the index the router asks
MatchPrefix of; its CPU is reported beside the router's); for the other routers, OpenAI HTTP servers.
``vllm-router --policy kv_aware`` asks a worker for a text prompt's token ids (vLLM's ``/v1/completions/render``)
before it hashes and matches them; the stubs answer that from a memo of the tokenizer's ids, so its router's CPU
excludes tokenizing, which a real deployment pays on the vLLM servers. The ``token ids`` rows send the same
prompts as ids, so neither router tokenizes.

CPU budget: the router on core 0 alone (``taskset -c 0``), everything else (this client, the stubs, NATS,
cachesvc) on core 1. A router that leaves core 0 idle was held back by the client's core: its CPU per request,
not its decisions/s, is then the figure to compare (the ``router's share of core 0`` column says which). Other
work on a shared machine is not kept off core 0: the load average is reported.

The routers, pyzmq and py-spy come with the ``routers`` extra (``pip install -e '.[routers]'``). The kvmesh
router's CPU per request broken down: a separate run of the same workload with ``py-spy`` sampling the
router process (every thread, idle ones left out), each sample put in the first part its stack passes through
(``PARTS``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from app.bench.report import load_average, markdown_table, publish
from app.bench.stats import percentile
from app.bench.vllm_servers import Process, Router, _get, package_version
from app.bench.workloads import prose

SECTION = "Router decisions per second: kvmesh vs vllm-router and sglang-router"
REPO = Path(__file__).resolve().parents[2]
ROUTER_CORE, OTHER_CORE = 0, 1
TARGET = "vllm-router kv_aware"


@dataclass(frozen=True)
class Contender:
    label: str
    kind: str                 # "kvmesh", "vllm-router" or "sglang-router"
    flags: tuple[str, ...] = ()
    token_ids: bool = False   # the prompts sent as token ids, not text


CONTENDERS = (
    Contender("kvmesh cache_aware", "kvmesh"),
    Contender("vllm-router kv_aware", "vllm-router", ("--policy", "kv_aware")),
    Contender("vllm-router cache_aware", "vllm-router", ("--policy", "cache_aware")),
    Contender("sglang-router cache_aware", "sglang-router", ("--policy", "cache_aware")),
    Contender("vllm-router round_robin", "vllm-router", ("--policy", "round_robin")),
    Contender("kvmesh cache_aware, token ids", "kvmesh", token_ids=True),
    Contender("vllm-router kv_aware, token ids", "vllm-router", ("--policy", "kv_aware"), token_ids=True),
)


# -- the prompts ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    tenant: int
    text: str
    ids: tuple[int, ...]


def workload(tokenizer: object, tenants: int, per_tenant: int, tokens: int, system_tokens: int,
             seed: int = 0) -> list[Prompt]:
    """``tenants`` x ``per_tenant`` prompts of about ``tokens`` tokens: a tenant's system prompt of
    ``system_tokens`` then a question of its own, shuffled by ``seed``."""
    rng = random.Random(seed)

    def text_of(n: int, head: str) -> str:
        ids = tokenizer.encode(head + prose(rng, n))[:n]  # type: ignore[attr-defined]  # ~1.2 tokens a word
        return tokenizer.decode(ids)  # type: ignore[attr-defined,no-any-return]

    out = []
    for t in range(tenants):
        system = text_of(system_tokens, f"You are the assistant of tenant {t}. ")
        for q in range(per_tenant):
            text = system + "\n\n" + text_of(tokens - system_tokens, f"Question {q}: ")
            out.append(Prompt(t, text, tuple(tokenizer.encode(text))))  # type: ignore[attr-defined]
    rng.shuffle(out)
    return out


# -- the client ------------------------------------------------------------------------------------------------------

@dataclass
class Window:
    """What the client saw in the measured window."""
    ok: int = 0
    errors: Counter = field(default_factory=Counter)  # status (or exception name) -> count
    latencies: list[float] = field(default_factory=list)
    wall_s: float = 0.0


async def drive(url: str, bodies: list[dict], concurrency: int, seconds: float | None) -> Window:
    """Closed loop, ``concurrency`` workers: ``bodies`` in order, once (``seconds`` None) or round and round until
    ``seconds`` have passed (each worker finishes the request it has in flight)."""
    import aiohttp

    w = Window()
    at = 0
    t0 = time.perf_counter()
    end = math.inf if seconds is None else t0 + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def worker() -> None:
            nonlocal at
            while time.perf_counter() < end and (seconds is not None or at < len(bodies)):
                body = bodies[at % len(bodies)]
                at += 1
                t = time.perf_counter()
                try:
                    async with session.post(url + "/v1/completions", json=body) as r:
                        await r.read()
                        status = r.status
                except (aiohttp.ClientError, TimeoutError) as e:
                    w.errors[type(e).__name__] += 1
                    continue
                if status == 200:
                    w.ok += 1
                    w.latencies.append(time.perf_counter() - t)
                else:
                    w.errors[str(status)] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    w.wall_s = time.perf_counter() - t0
    return w


# -- CPU from /proc ------------------------------------------------------------------------------------------------

def stat_cpu_ticks(stat: str) -> int:
    """utime + stime (clock ticks) of one ``/proc/<pid>/stat`` line; the command name may hold spaces and
    parentheses, so the fields are counted from its closing one."""
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), counted from "state" (field 3)


def process_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid`` (all its threads) and of its live children in its process group."""
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(entry.name) == pid or int(fields[2]) == pid:  # fields[2]: the process group
            ticks += stat_cpu_ticks(stat)
    return ticks / os.sysconf("SC_CLK_TCK")


# -- results -------------------------------------------------------------------------------------------------------

@dataclass
class Result:
    label: str
    window: Window
    router_cpu_s: float
    index_cpu_s: float | None = None   # kvmesh: cachesvc's over the same window
    cpu_rounds: tuple[float, ...] = ()  # the router CPU ms/request of each of its rounds, this one's included

    @property
    def decisions_per_s(self) -> float:
        return self.window.ok / self.window.wall_s if self.window.wall_s else 0.0

    @property
    def cpu_ms_per_request(self) -> float:
        return self.router_cpu_s / self.window.ok * 1e3 if self.window.ok else math.nan


def result_row(r: Result) -> dict:
    w = r.window
    lat = [x * 1e3 for x in w.latencies]
    errors = sum(w.errors.values())
    return {"router": r.label, "decisions/s": f"{r.decisions_per_s:.0f}",
            "ok / errors": f"{w.ok} / {errors}" + (f" ({', '.join(f'{k}: {v}' for k, v in w.errors.items())})"
                                                    if errors else ""),
            "p50 ms": f"{percentile(lat, 50):.1f}" if lat else "-",
            "p99 ms": f"{percentile(lat, 99):.1f}" if lat else "-",
            "router CPU ms/request": f"{r.cpu_ms_per_request:.2f}" + (
                f" ({min(r.cpu_rounds):.2f}-{max(r.cpu_rounds):.2f})" if len(r.cpu_rounds) > 1 else ""),
            "one core's capacity (1 / CPU)": f"{1e3 / r.cpu_ms_per_request:.0f}/s" if r.cpu_ms_per_request > 0
            else "-",
            "router's share of core 0": f"{r.router_cpu_s / w.wall_s:.0%}" if w.wall_s else "-",
            "index CPU ms/request": "-" if r.index_cpu_s is None or not w.ok else f"{r.index_cpu_s / w.ok * 1e3:.2f}"}


RESULT_COLUMNS = ["router", "decisions/s", "ok / errors", "p50 ms", "p99 ms", "router CPU ms/request",
                  "one core's capacity (1 / CPU)", "router's share of core 0", "index CPU ms/request"]


def verdict(results: dict[str, Result], ours: str = "kvmesh cache_aware", theirs: str = TARGET) -> str:
    """The target of issue 39: kvmesh's decisions/s at least vllm-router kv_aware's, same run."""
    a, b = results.get(ours), results.get(theirs)
    if a is None or b is None or not b.decisions_per_s:
        return f"Target (kvmesh ≥ {theirs} decisions/s): not judged, one of the two did not run."
    ratio = a.decisions_per_s / b.decisions_per_s
    cpu = b.cpu_ms_per_request / a.cpu_ms_per_request if a.cpu_ms_per_request else math.nan
    met = "met" if ratio >= 1.0 else "**not met**"
    return (f"{ours} / {theirs}: {ratio:.2f}x the decisions/s ({a.decisions_per_s:.0f} vs {b.decisions_per_s:.0f}), "
            f"{cpu:.2f}x the CPU efficiency ({a.cpu_ms_per_request:.2f} vs {b.cpu_ms_per_request:.2f} ms of router "
            f"CPU a request). Target (≥ 1.00x the decisions/s): {met}.")


# -- the kvmesh router's CPU, part by part (py-spy samples) ---------------------------------------------------------

PARTS = (  # (part, marks): a sample goes to the first part one of whose marks is in a frame of its stack
    ("tokenize", ("(kvmesh/model_source/tokenizer.py",)),
    ("hash (block keys)", ("(kvmesh/contracts/keys.py",)),  # block_keys_and_plain, int32s
    ("match (MatchPrefix on cachesvc, recent prefixes)", ("Router.matched_blocks (", "RecentPrefixes.matched (",
                                                           "HitLedger.routing (")),
    ("score (plan over the fleet)", ("Router._route (", "(kvmesh/routing/plan.py", "(kvmesh/routing/policies")),
    ("hit attribution (after the answer)", ("Router._attribute (", "(services/router/hits.py",
                                            "(kvmesh/routing/hits.py")),
    ("dispatch (gRPC Decode to the engine, relay)", ("Router._local (", "Router._chunks (", "Router._work (",
                                                     "Router._relay (")),
    ("HTTP and intake (parse, admit, answer)", ("(services/router/http_api.py", "(services/router/intake.py",
                                                "(aiohttp/")),
)
REST = "rest (event loop, gRPC and NATS I/O, metrics)"
# A tokenize thread sampled at its queue's get (the stack's last frame the pool's worker loop): waiting, not
# running. py-spy counts such samples (~10% of them); tokenizing on the event loop instead made them vanish and
# left the router's CPU per request as it was (2.25-2.37 ms both ways, interleaved), so they are left out.
WAITING = "waiting (a tokenize thread at its queue)"


def breakdown(collapsed: str) -> dict[str, int]:
    """Samples per part from py-spy's ``--format raw`` output (one ``frame;frame;... count`` line per stack, the
    root first; a frame is ``function (path:line)``)."""
    out: Counter = Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if frames[-1].startswith("_worker (") and "concurrent/futures/thread.py" in frames[-1]:
            out[WAITING] += int(count)
            continue
        part = next((name for name, marks in PARTS if any(m in f for f in frames for m in marks)), REST)
        out[part] += int(count)
    return dict(out)


def breakdown_rows(samples: dict[str, int], cpu_ms: float) -> list[dict]:
    """The parts' shares of the samples that ran (``WAITING`` left out), and of ``cpu_ms`` by them."""
    total = sum(n for name, n in samples.items() if name != WAITING)
    order = [name for name, _ in PARTS] + [REST]
    return [{"part": name, "samples": samples.get(name, 0), "share": f"{samples.get(name, 0) / total:.0%}",
             "CPU ms/request": f"{samples.get(name, 0) / total * cpu_ms:.2f}"}
            for name in order if total]


# -- starting things -----------------------------------------------------------------------------------------------

def pinned(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if shutil.which("taskset") else []


@contextmanager
def stubs(work: Path, name: str, args: list[str]) -> Iterator[dict]:
    ready = work / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    proc = Process(name, [sys.executable, "-m", "app.bench.stub_workers", *args, "--ready-file", str(ready)],
                   work / f"{name}.log", {"PYTHONPATH": _pythonpath()})
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if proc.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"stub workers did not start; see {proc.log}")
            time.sleep(0.1)
        yield json.loads(ready.read_text())
    finally:
        proc.stop()


def _pythonpath() -> str:
    return os.pathsep.join([str(REPO / "libs"), str(REPO), os.environ.get("PYTHONPATH", "")])


@contextmanager
def kvmesh_router(work: Path, workers: int, label: str) -> Iterator[tuple[str, int, int]]:
    """NATS, cachesvc and ``workers`` stub engines on the other core, the router on its own: yields the router's
    HTTP URL, its pid and cachesvc's."""
    from kvmesh.bus import NatsServer
    from kvmesh.ready import wait_ready

    from app.bench.cachesvc import cachesvc

    cluster = f"rb{uuid.uuid4().hex[:8]}"
    slug = label.replace(" ", "-").replace(",", "")
    with NatsServer(work / f"nats-{slug}") as nats, \
            cachesvc(nats.url, cluster, work / f"cachesvc-{slug}.log", pool_capacity_mb=0) as address, \
            stubs(work, f"stubs-{slug}", ["--kvmesh", str(workers), "--nats-url", nats.url, "--cluster", cluster]):
        ready = work / f"router-{slug}.ready.json"
        ready.unlink(missing_ok=True)
        router = Process(f"router-{slug}", [*pinned(ROUTER_CORE), sys.executable, "-m", "services.router",
                                            "--nats-url", nats.url, "--cluster", cluster, "--cachesvc-address",
                                            address, "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0",
                                            "--ready-file", str(ready)],
                         work / f"router-{slug}.log", {"PYTHONPATH": _pythonpath()})
        try:
            url = wait_ready(ready, router.proc, "router", router.log, timeout_s=180).endpoints["http"]
            deadline = time.monotonic() + 30
            while json.loads(_get(url + "/health")[1] or b'{"instances": 0}')["instances"] < workers:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the router saw fewer than {workers} stub engines; see {router.log}")
                time.sleep(0.2)
            yield url, router.proc.pid, _pid_of("services.cachesvc", nats.url)
        finally:
            router.stop()


def _pid_of(module: str, marker: str) -> int:
    """The pid of the process running ``python -m module`` with ``marker`` among its arguments."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if module.encode() in argv and marker.encode() in argv:
                return int(entry.name)
    raise RuntimeError(f"no process runs {module} with {marker}")


@contextmanager
def other_router(work: Path, workers: int, c: Contender) -> Iterator[tuple[str, int, int | None]]:
    """``workers`` stub HTTP workers on the other core, ``c``'s router on its own: its URL and pid."""
    kv_aware = "kv_aware" in c.flags
    with stubs(work, f"stubs-{c.label.replace(' ', '-').replace(',', '')}",
               ["--http", str(workers), *(["--zmq"] if kv_aware else [])]) as got:
        flags = list(c.flags)
        env = {}
        if kv_aware:
            from kvmesh.engine.loader import resolve_model

            model_dir = str(resolve_model(None).hf_dir)
            flags += [a for u, e in zip(got["http"], got["zmq"], strict=True)
                      for a in ("--kv-event-source", f"{u}={e}")]
            flags += ["--kv-event-block-size", "16", "--kv-event-model", model_dir]
            env["VLLM_ROUTER_TOKENIZER"] = model_dir
        router = Router(c.label.replace(" ", "-").replace(",", ""), work, c.kind, got["http"], flags, env=env,
                        wrap=pinned(ROUTER_CORE))
        try:
            yield router.url, router.proc.proc.pid, None
        finally:
            router.save_metrics()
            router.stop()


# -- a run -----------------------------------------------------------------------------------------------------------

@dataclass
class Plan:
    tenants: int = 8
    per_tenant: int = 32
    tokens: int = 4096
    system_tokens: int = 3584
    concurrency: int = 32
    seconds: float = 20.0
    workers: int = 2
    rounds: int = 2


def picked(only: str) -> list[Contender]:
    """The contenders ``only`` names, comma-separated, in its order; a label that holds a comma ("kvmesh
    cache_aware, token ids") is read whole. ValueError naming a label no contender has."""
    labels = {c.label: c for c in CONTENDERS}
    pieces = [s.strip() for s in only.split(",")]
    out, i = [], 0
    while i < len(pieces):
        j = next((j for j in range(len(pieces), i, -1) if ", ".join(pieces[i:j]) in labels), None)
        if j is None:
            raise ValueError(f"--only: no router is called {pieces[i]!r}; the labels: {'; '.join(labels)}")
        out.append(labels[", ".join(pieces[i:j])])
        i = j
    return out


def bodies_for(c: Contender, prompts: list[Prompt], model: str) -> list[dict]:
    return [{"model": model, "prompt": list(p.ids) if c.token_ids else p.text, "max_tokens": 1, "temperature": 0}
            for p in prompts]


def _model(url: str) -> str:
    import urllib.request

    return json.loads(urllib.request.urlopen(url + "/v1/models", timeout=10).read())["data"][0]["id"]


def measure(c: Contender, plan: Plan, prompts: list[Prompt], work: Path, log) -> Result:
    start = kvmesh_router(work, plan.workers, c.label) if c.kind == "kvmesh" else other_router(work, plan.workers, c)
    with start as (url, pid, index_pid):
        bodies = bodies_for(c, prompts, _model(url))
        warm = asyncio.run(drive(url, bodies, plan.concurrency, None))
        if not warm.ok:
            raise RuntimeError(f"{c.label}: no request of the warm-up was answered ({dict(warm.errors)})")
        cpu0, index0 = process_cpu_s(pid), process_cpu_s(index_pid) if index_pid else 0.0
        window = asyncio.run(drive(url, bodies, plan.concurrency, plan.seconds))
        cpu1, index1 = process_cpu_s(pid), process_cpu_s(index_pid) if index_pid else 0.0
    r = Result(c.label, window, cpu1 - cpu0, index1 - index0 if index_pid else None)
    log(" ".join(f"{k}={v}" for k, v in result_row(r).items()))
    return r


def profile_kvmesh(plan: Plan, prompts: list[Prompt], work: Path, seconds: float) -> dict[str, int]:
    """The kvmesh router under ``py-spy record`` while the same workload runs: samples per part."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        raise RuntimeError("py-spy is not installed (pip install py-spy)")
    with kvmesh_router(work, plan.workers, "kvmesh profiled") as (url, pid, _):
        bodies = bodies_for(CONTENDERS[0], prompts, _model(url))
        asyncio.run(drive(url, bodies, plan.concurrency, None))
        out = work / "router.pyspy.txt"
        spy_proc = subprocess.Popen([*pinned(OTHER_CORE), spy, "record", "--pid", str(pid), "--format", "raw",
                                     "--rate", "200", "--duration", str(int(seconds)), "--nonblocking",
                                     "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        asyncio.run(drive(url, bodies, plan.concurrency, seconds + 2))
        spy_proc.wait(60)
    return breakdown(out.read_text())


def tokenize_cpu_ms(tokenizer: object, prompts: list[Prompt], count: int = 32) -> float:
    """The router's ``Tokenizer.encode`` of ``count`` of the prompts, one thread: its CPU ms a prompt (median)."""
    cpu = []
    for p in prompts[:count]:
        c = time.thread_time()
        tokenizer.encode(p.text)  # type: ignore[attr-defined]
        cpu.append((time.thread_time() - c) * 1e3)
    return percentile(cpu, 50)


def render(plan: Plan, results: dict[str, Result], prompts: list[Prompt], samples: dict[str, int] | None,
           failed: dict[str, str], loads: tuple[str, str], tokenize_ms: float = math.nan) -> str:
    sizes = [len(p.ids) for p in prompts]
    versions = (f"vllm-router {package_version('vllm-router')}, sglang-router {package_version('sglang-router')}, "
                "kvmesh's router at this commit")
    parts = [
        (f"{len(prompts)} distinct prompts of {min(sizes):,}-{max(sizes):,} tokens (the default model's tokenizer): "
         f"{plan.tenants} tenants' system prompts of {plan.system_tokens:,} tokens, {plan.per_tenant} questions "
         f"each, shuffled. {plan.concurrency} requests in flight, `max_tokens` 1, not streamed; each distinct prompt "
         f"once to warm up, then {plan.seconds:g} s measured; {plan.rounds} rounds, the order reversed each round, "
         f"each router's round with the most decisions/s shown. {plan.workers} stub workers that answer at once "
         f"(`app.bench.stub_workers`). The router pinned to core 0 alone; the client, the stubs, NATS and cachesvc "
         f"on core 1. {versions}. Load average at the start {loads[0]}, at the end {loads[1]} (a shared machine)."),
        markdown_table([result_row(r) for r in results.values()], RESULT_COLUMNS),
        verdict(results),
        ("How to read it: `router CPU ms/request` is the router process's CPU (every thread) over the window divided "
         "by the requests answered (in brackets: its range over the rounds; the same work costs more CPU while "
         "other work shares the machine's caches and cores); `one core's capacity` is its inverse, the decisions/s "
         "the router would make with its core to itself; a `router's share of core 0` well under 100% means "
         "something else set the pace: the client's core (a router far under its capacity) or other work on this "
         "shared machine taking core 0 (a router near it). `index CPU`: cachesvc's CPU for kvmesh's MatchPrefix "
         "calls (on core 1, not counted in the router's). `vllm-router kv_aware` with text asks a worker for the "
         "prompt's token ids (`/v1/completions/render`) before it hashes and matches them: its tokenizing is the "
         "worker's CPU, not the router's (the stubs answer it from a memo). The `token ids` rows: the same prompts "
         "sent as ids, nobody tokenizes."),
    ]
    if samples:
        ours = results.get("kvmesh cache_aware")
        cpu = ours.cpu_ms_per_request if ours else math.nan
        ran = sum(n for name, n in samples.items() if name != WAITING)
        parts.append(f"kvmesh router's CPU per request by part ({ran:,} py-spy samples of the router process at "
                     f"200 Hz, a separate run of the same workload, and {samples.get(WAITING, 0):,} of a tokenize "
                     f"thread waiting at its queue left out; ms from the measured {cpu:.2f} ms a request):")
        parts.append(markdown_table(breakdown_rows(samples, cpu), ["part", "samples", "share", "CPU ms/request"]))
        parts.append(f"A sample counts every thread running at that instant (the event loop and the tokenize threads "
                     f"share core 0). Cross-check: the router's `Tokenizer.encode` of one of these prompts, alone on "
                     f"this machine, takes {tokenize_ms:.1f} ms of CPU (median of 32).")
    if failed:
        parts.append("Failed (a router's other rounds, if any, are in the table): "
                     + "; ".join(f"{k}: {v}" for k, v in failed.items()) + ".")
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench routers", description=__doc__.split("\n\n")[0])
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--per-tenant", type=int, default=32)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--system-tokens", type=int, default=3584)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="runs of every router, the order reversed each round")
    p.add_argument("--only", default="", help="comma-separated labels of the routers to run (a smoke run)")
    p.add_argument("--no-profile", action="store_true", help="skip the py-spy breakdown of kvmesh's router")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md as it is")
    p.add_argument("--workdir", help="keep the routers' and stubs' logs here")
    a = p.parse_args(argv)
    plan = Plan(a.tenants, a.per_tenant, a.tokens, a.system_tokens, a.concurrency, a.seconds, a.workers, a.rounds)
    try:
        chosen = picked(a.only) if a.only else list(CONTENDERS)
    except ValueError as e:
        p.error(str(e))
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, {OTHER_CORE})  # the client and what it starts; routers are started on core 0
    from kvmesh.engine.loader import resolve_model
    from kvmesh.model_source.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(resolve_model(None).hf_dir)
    prompts = workload(tokenizer, plan.tenants, plan.per_tenant, plan.tokens, plan.system_tokens)
    loads = [load_average()]
    results: dict[str, Result] = {}
    cpu: dict[str, tuple[float, ...]] = {}  # router -> its CPU ms/request in each round
    failed: dict[str, str] = {}
    samples = None
    work = Path(a.workdir or tempfile.mkdtemp(prefix="kvmesh-bench-routers-"))
    work.mkdir(parents=True, exist_ok=True)
    log = lambda s: print(s, flush=True)
    try:
        for r in range(plan.rounds):  # the order reversed every other round; each router's best round kept
            for c in chosen if r % 2 == 0 else chosen[::-1]:
                if c.label in failed:
                    continue
                log(f"{c.label}, round {r + 1} ...")
                try:
                    got = measure(c, plan, prompts, work, log)
                except Exception as e:  # noqa: BLE001 - say what failed, keep the others' figures
                    traceback.print_exc()
                    failed[c.label] = f"round {r + 1} of {plan.rounds}: {type(e).__name__}: {e}"
                    continue
                cpu[c.label] = (*cpu.get(c.label, ()), got.cpu_ms_per_request)
                if c.label not in results or got.decisions_per_s > results[c.label].decisions_per_s:
                    results[c.label] = got
        for label, r in results.items():
            r.cpu_rounds = cpu[label]
        results = {c.label: results[c.label] for c in chosen if c.label in results}
        if not a.no_profile and any(c.kind == "kvmesh" for c in chosen):
            log("kvmesh router under py-spy ...")
            try:
                samples = profile_kvmesh(plan, prompts, work, min(plan.seconds, 15.0))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                failed["py-spy breakdown"] = f"{type(e).__name__}: {e}"
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    loads.append(load_average())
    body = render(plan, results, prompts, samples, failed, (loads[0], loads[1]), tokenize_cpu_ms(tokenizer, prompts))
    cmd = "kvmesh bench routers" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in vars(a).items()
        if k in ("tenants", "per_tenant", "tokens", "system_tokens", "concurrency", "seconds", "workers", "rounds")
        and v != p.get_default(k))
    publish(SECTION, cmd, body, write=not a.no_write and not a.only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
