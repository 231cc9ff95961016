"""The mesh's cost over vLLM: standalone ``vllm serve`` and ``kvmesh up --engine-backend vllm --prefill 0 --decode 0
--both 1`` on the same weights and the same vLLM engine arguments (``vllm_servers.EngineShape``), in one run, each
driven through its OpenAI HTTP API with token-id prompts (``/v1/completions``, streamed, greedy, ``ignore_eos``).
kvmesh runs twice: as ``kvmesh up`` starts it (the pool on: each finished request's KV is read out of vLLM and
written to cachesvc) and with the pool off (``StackOptions(pool=False)``), which tells the mesh's own cost (router,
gRPC hops, the instance host) from the pool's write-back, which on this 2-core machine competes with the next
request for the CPU.

    kvmesh bench vllm --serving [--rounds 3] [--prompts 3] [--quick] [--no-write] [--workdir DIR]
    python -m app.bench.vllm_serving [same options]

Figures, each kvmesh's as a ratio to vLLM alone (the targets of issue 26: TTFT and ITL <= 1.10x, throughput at
8 / 16 streams >= 0.90x):
- TTFT of a cold 1,500-token prompt: the median over ``--prompts`` distinct prompts a round (each asks for 4
  tokens: a request that ends at its first token would also count what happens at its end, which for kvmesh
  includes reading its KV out for the pool's write-back);
- TTFT of a repeated prefix: right after each cold prompt, the same 1,500 tokens plus a new 32-token suffix
  (vLLM holds the prefix's whole blocks: 1,408 tokens);
- single-stream ITL p50 / p99: the gaps between the streamed tokens of one 20-token prompt decoding 64 tokens,
  four times a round;
- throughput: 8 and 16 streams submitted together, 20-token prompts, 64 tokens each, all generated tokens over
  the wall time from the first submit to the last token.

The servers start one after the other and stay up; the measuring never overlaps (the machine has 2 cores): each
round runs every scenario on one server, then on the next, and the order rotates from round to round, so the other
jobs' load drifts over all alike. Each figure is the median over the rounds (cold and repeated TTFT: over
every prompt of every round). The standalone server gets a port picked free just before it starts, retried on a
bind failure (``vllm_servers``); the stack binds port 0 itself.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from app.bench.engine_serving import Bench, Stream, _itls, http_stream
from app.bench.report import load_average, markdown_table, publish
from app.bench.vllm_servers import EngineShape, VLLMServer, default_model, kvmesh_stack, vllm_version

SECTION = "vLLM through kvmesh vs vLLM alone"
VLLM, KVMESH, NO_POOL = "vLLM alone", "kvmesh", "kvmesh, pool off"
PROMPT_TOKENS, SUFFIX_TOKENS, TTFT_MAX_TOKENS = 1500, 32, 4


@dataclass(frozen=True)
class Target:
    """A figure's goal as a ratio kvmesh / vLLM alone: at most ``ratio`` (``upper``) or at least."""
    ratio: float
    upper: bool

    def met(self, value: float) -> bool:
        return value <= self.ratio if self.upper else value >= self.ratio

    def __str__(self) -> str:
        return f"{'≤' if self.upper else '≥'} {self.ratio:.2f}x"


FIGURES: dict[str, Target] = {  # figure -> issue 26's target for kvmesh / vLLM alone
    "TTFT cold 1,500 tokens, ms": Target(1.10, True),
    "TTFT repeated prefix (+32 new), ms": Target(1.10, True),
    "ITL p50, 1 stream, ms": Target(1.10, True),
    "ITL p99, 1 stream, ms": Target(1.10, True),
    "tok/s, 8 streams": Target(0.90, False),
    "tok/s, 16 streams": Target(0.90, False),
}


@dataclass
class Figures:
    """One server's measurements over the rounds: per figure, one value a round (TTFT: one a prompt)."""
    values: dict[str, list[float]] = field(default_factory=lambda: {f: [] for f in FIGURES})

    def add(self, measured: dict[str, list[float]]) -> None:
        for name, vals in measured.items():
            self.values[name].extend(vals)

    def median(self, name: str) -> float:
        vals = self.values[name]
        return statistics.median(vals) if vals else float("nan")


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


async def measure(stream: Stream, bench: Bench, round_: int, prompts: int, itl_streams: int,
                  max_tokens: int) -> dict[str, list[float]]:
    """Every scenario once on one server; the prompts depend on the round only (both servers get the same)."""
    cold, repeat = [], []
    for i in range(prompts):
        prefix = tokens(PROMPT_TOKENS, 1_000_000 + 100 * round_ + i)
        t = await stream(f"cold-{round_}-{i}", prefix, TTFT_MAX_TOKENS)
        cold.append((t[1] - t[0]) * 1000)
        t = await stream(f"rep-{round_}-{i}", prefix + tokens(SUFFIX_TOKENS, 2_000_000 + 100 * round_ + i),
                         TTFT_MAX_TOKENS)
        repeat.append((t[1] - t[0]) * 1000)
    runs = [await stream(f"itl-{round_}-{i}", tokens(20, 3_000_000 + 100 * round_ + i), max_tokens)
            for i in range(itl_streams)]
    itl = _itls(runs)
    t8 = await bench.streams(stream, 8, max_tokens)
    t16 = await bench.streams(stream, 16, max_tokens)
    return {"TTFT cold 1,500 tokens, ms": cold, "TTFT repeated prefix (+32 new), ms": repeat,
            "ITL p50, 1 stream, ms": [float(np.percentile(itl, 50))],
            "ITL p99, 1 stream, ms": [float(np.percentile(itl, 99))],
            "tok/s, 8 streams": [t8["tok/s"]], "tok/s, 16 streams": [t16["tok/s"]]}


async def warm_up(stream: Stream, bench: Bench) -> None:
    """First-call costs (the sampler, the long-prompt path) out of the figures."""
    await bench.streams(stream, 2, 8)
    await stream("warm-long", tokens(PROMPT_TOKENS, 7), 2)


async def run_rounds(servers: dict[str, tuple[str, str]], rounds: int, prompts: int, itl_streams: int,
                     max_tokens: int, log: Callable[[str], None] = print) -> tuple[dict[str, Figures], list[dict]]:
    """``servers``: name -> (base URL, model). Returns each server's figures and one row per (round, server)."""
    import aiohttp

    figures = {name: Figures() for name in servers}
    per_round: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        streams = {name: http_stream(session, url, model) for name, (url, model) in servers.items()}
        benches = {name: Bench() for name in servers}
        for name in servers:
            await warm_up(streams[name], benches[name])
        order = list(servers)
        for r in range(rounds):
            for name in order[r % len(order):] + order[:r % len(order)]:
                load = os.getloadavg()[0]
                m = await measure(streams[name], benches[name], r, prompts, itl_streams, max_tokens)
                figures[name].add(m)
                row = {"round": r + 1, "server": name, "load": f"{load:.1f}",
                       **{f: f"{statistics.median(v):.1f}" for f, v in m.items()}}
                per_round.append(row)
                log(" ".join(f"{k}={v}" for k, v in row.items()))
    return figures, per_round


def ratios(figures: dict[str, Figures]) -> list[dict]:
    """The main table: each figure's median on every server, kvmesh / vLLM alone against the target (and, when it
    ran, kvmesh with the pool off / vLLM alone)."""
    rows = []
    for name, target in FIGURES.items():
        base, ours = figures[VLLM].median(name), figures[KVMESH].median(name)
        ratio = ours / base if base else float("nan")
        row = {"figure": name, VLLM: f"{base:.1f}", KVMESH: f"{ours:.1f}", "kvmesh / vLLM": f"{ratio:.2f}x",
               "target": str(target), "met": "yes" if target.met(ratio) else "**no**"}
        if NO_POOL in figures:
            off = figures[NO_POOL].median(name)
            row |= {NO_POOL: f"{off:.1f}", "pool off / vLLM": f"{off / base if base else float('nan'):.2f}x"}
        rows.append(row)
    return rows


COLUMNS = ["figure", VLLM, KVMESH, "kvmesh / vLLM", "target", "met", NO_POOL, "pool off / vLLM"]


def render(figures: dict[str, Figures], per_round: list[dict], shape: EngineShape, serve_cmd: str,
           kvmesh_cmd: str, versions: str, loads: tuple[str, str], rounds: int, prompts: int) -> str:
    per_round_cols = ["round", "server", "load", *FIGURES]
    return "\n\n".join([
        (f"Default model (SmolLM2-135M-Instruct, fp32), one vLLM engine on every server with the same engine "
         f"arguments ({shape.describe()}); {versions}. {rounds} rounds, each running every scenario on one server "
         f"after the other (the order rotating), {prompts} distinct 1,500-token prompts a round; each figure the "
         f"median over the rounds. Load average at the start {loads[0]}, at the end {loads[1]}."),
        markdown_table(ratios(figures), [c for c in COLUMNS if NO_POOL in figures or c not in COLUMNS[6:]]),
        "Per round (medians within the round; `load`: the 1-minute load average as the server's turn began):",
        markdown_table(per_round, per_round_cols),
        (f"vLLM alone: `{serve_cmd}`. kvmesh: `{kvmesh_cmd}` (router, NATS, cachesvc with the pool, one instance "
         "whose engine is vLLM's `LLMEngine` in process, its KV events and kvmesh's KV connector on); kvmesh, pool "
         "off: the same stack whose instance has no cachesvc address (no write-back, no pool fetch)."),
    ])


def kvmesh_command(shape: EngineShape) -> str:
    flags = " ".join(f"--engine-{k.replace('_', '-')} {v}" for k, v in shape.kvmesh_engine().items()
                     if k not in ("backend", "enable_prefix_caching", "block_size"))
    return f"kvmesh up --engine-backend vllm --prefill 0 --decode 0 --both 1 {flags}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench vllm --serving")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=3, help="distinct cold 1,500-token prompts a round")
    p.add_argument("--quick", action="store_true", help="1 round, 2 prompts, 24 tokens a stream (a smoke run; "
                                                        "not written to the doc)")
    p.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    p.add_argument("--workdir", help="keep the servers' logs and the stack's state (traces.jsonl) here")
    p.add_argument("--device", default="cpu", help="cuda: vLLM's CUDA build on the GPU (make gpu-check)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"), help="the model's and KV's dtype")
    args = p.parse_args(argv)
    rounds, prompts, max_tokens = (1, 2, 24) if args.quick else (args.rounds, args.prompts, 64)
    shape = EngineShape(device=args.device, dtype=args.dtype)
    loads = [load_average()]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        print("starting vllm serve ...", flush=True)
        t0 = time.monotonic()
        server = VLLMServer("vllm-serve", work, shape)
        stacks = []
        try:
            print(f"vllm serve up in {time.monotonic() - t0:.0f} s; starting the kvmesh stacks ...", flush=True)
            t0 = time.monotonic()
            stacks.append(kvmesh_stack(work / "kvmesh", "bench-vllm-serving", shape, both=1))
            stacks.append(kvmesh_stack(work / "kvmesh-no-pool", "bench-vllm-serving-np", shape, both=1, pool=False))
            print(f"kvmesh up in {time.monotonic() - t0:.0f} s", flush=True)
            servers = {VLLM: (server.url, server.model), KVMESH: (stacks[0].router_http, ""),
                       NO_POOL: (stacks[1].router_http, "")}
            figures, per_round = asyncio.run(run_rounds(servers, rounds, prompts, 4, max_tokens))
        finally:
            for stack in stacks:
                stack.stop()
            server.stop()
    loads.append(load_average())
    body = render(figures, per_round, shape, server.command(default_model()[0]), kvmesh_command(shape), vllm_version(),
                  (loads[0], loads[1]), rounds, prompts)
    cmd = "kvmesh bench vllm --serving" + (f" --rounds {args.rounds}" if args.rounds != 3 else "") + (
        f" --prompts {args.prompts}" if args.prompts != 3 else "") + (
        f" --device {args.device} --dtype {args.dtype}" if args.device != "cpu" or args.dtype != "fp32" else "")
    publish(SECTION, cmd, body, write=not args.no_write and not args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
