"""Engine serving benchmark: concurrent streams through the engine's async serving path (``AsyncEngine``), or
with ``--stack`` through a real stack (``kvmesh up --prefill 0 --decode 0 --both 1``: router, NATS, cachesvc and
one engine process), streaming ``/v1/completions`` over HTTP as a client does.

    python -m app.bench.engine_serving [--stack] [--weights both|quantized|dense] [--threads 1] [--quick]
                                       [--mixed-step-stall X] [--no-write] [--section NAME]
    kvmesh bench engine --serving [same options]

Scenarios (default model, fp32, 20-token prompts):
- ``streams``: 1, 8 and 16 requests submitted together, 64 tokens each; aggregate tok/s (all generated tokens over
  the wall time from first submit to last token), its ratio to one stream's, ITL p50/p99 over every stream's
  inter-token gaps, and generated tokens per CPU-second of this process (less sensitive to a shared machine).
  From the engine's step counters (``kvmesh_worker_engine_step_*``, scraped from its /metrics through the stack):
  the mean decode step's wall and engine-thread CPU milliseconds and its rows (wall above CPU: the engine
  thread waited, for the GIL or for a core another process held).
- ``mixed``: 8 streams decode while new 256-token prompts arrive one after another; ITL p50/p99/max of the 8
  running streams, and the arrivals' TTFT.
Each scenario runs once per weight form (``--weights``, default both): the GGUF's quantized blocks (the engine's
default) and their fp32 dequantization (the same values: a baseline in the same run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import torch
from kvmesh.contracts.engine import EngineRequest, StepCounts
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.contracts.slo import NO_SLO, SLO
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.llm_engine import LLMEngine
from kvmesh.settings import EngineSettings

from app.bench import prefill_slo
from app.bench.report import load_average, markdown_table, publish

SECTION = "Engine serving"
SECTION_STACK = "Engine serving through the stack"
SECTION_TARGET = "Engine serving vs {target}"  # with --target: the baseline's --target-name
SECTION_PREFILL = "Cold prefill and scenario C vs {target}"  # --scenarios cold,slo


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


Stream = Callable[..., Awaitable[list[float]]]
"""``stream(request_id, prompt, max_tokens, slo=None)``: the arrival time of each token (the first one included),
the submit time first; ``slo``: the request's latency targets."""


def engine_stream(engine: AsyncEngine) -> Stream:
    async def stream(rid: str, prompt: list[int], max_tokens: int, slo: SLO | None = None) -> list[float]:
        times = [time.perf_counter()]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        async for out in engine.generate(EngineRequest(rid, tuple(prompt), params, slo=slo or NO_SLO)):
            times.extend([time.perf_counter()] * len(out.token_ids))
        return times
    return stream


def http_stream(session, url: str, model: str = "", headers: dict[str, str] | None = None) -> Stream:
    """Through the router (or any OpenAI-compatible server that takes token-id prompts and ``ignore_eos``, as
    vLLM does; ``model`` names its model; ``headers`` go with every request, an API key): one SSE chunk per token
    the engine streams. Not
    app.bench.serve.stream_request: that one times chunks with text only, and a token that completes no
    character yet (random ids, byte-level BPE) streams an empty delta that is still a token here."""
    async def stream(rid: str, prompt: list[int], max_tokens: int, slo: SLO | None = None) -> list[float]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "temperature": 0, **({"model": model} if model else {}),
                **({"kvmesh_slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s}} if slo else {})}
        times = [time.perf_counter()]
        async with session.post(f"{url}/v1/completions", json=body,
                                headers={"x-request-id": rid, **(headers or {})}) as r:
            if r.status == 429:
                raise prefill_slo.Refused(f"{rid}: {await r.text()}")
            if r.status != 200:
                raise RuntimeError(f"{rid}: HTTP {r.status}: {await r.text()}")
            async for line in r.content:
                if line.startswith(b"data: {"):
                    choices = json.loads(line[6:]).get("choices") or []
                    if choices and "error" not in choices[0]:
                        times.append(time.perf_counter())
        return times
    return stream


def _itls(runs: list[list[float]]) -> np.ndarray:
    return np.concatenate([np.diff(t[2:]) for t in runs if len(t) > 3]) * 1000


Probe = Callable[[], Awaitable[dict[str, float]]]
"""The engine's step totals so far, of one kind (decode-only steps, or steps with prompt tokens): ``steps``,
``rows``, ``seconds`` (wall), ``cpu`` (engine thread)."""


def engine_probe(engine: AsyncEngine, kind: str = "decode") -> Probe:
    async def probe() -> dict[str, float]:
        t: StepCounts = getattr(engine.step_totals, kind)
        return {"steps": t.steps, "rows": t.rows, "seconds": t.seconds, "cpu": t.cpu_seconds}
    return probe


def metrics_probe(session, url: str, kind: str = "decode") -> Probe:
    """The same totals from an engine's Prometheus text (``kvmesh_worker_engine_step*_total{kind=...}``)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {"kvmesh_worker_engine_steps_total": "steps", "kvmesh_worker_engine_step_rows_total": "rows",
             "kvmesh_worker_engine_step_seconds_total": "seconds",
             "kvmesh_worker_engine_step_cpu_seconds_total": "cpu"}

    async def probe() -> dict[str, float]:
        async with session.get(url) as r:
            text = await r.text()
        return {names[smp.name]: smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples
                if smp.name in names and smp.labels.get("kind") == kind}
    return probe


def _step_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    steps = after["steps"] - before["steps"]
    if not steps:
        return {}
    return {"step ms": (after["seconds"] - before["seconds"]) / steps * 1e3,
            "step CPU ms": (after["cpu"] - before["cpu"]) / steps * 1e3,
            "rows/step": (after["rows"] - before["rows"]) / steps}


class Bench:
    def __init__(self, probe: Probe | None = None) -> None:
        self.n = 0
        self.probe = probe

    def _rid(self) -> str:
        self.n += 1
        return f"s{self.n}"

    async def streams(self, stream: Stream, n: int, tokens: int) -> dict:
        before = await self.probe() if self.probe else None
        cpu, t0 = time.process_time(), time.perf_counter()
        runs = await asyncio.gather(*(stream(self._rid(), _prompt(20, self.n * 7919 + i), tokens)
                                      for i in range(n)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu
        itl = _itls(runs)
        generated = sum(len(r) - 1 for r in runs)
        steps = _step_stats(before, await self.probe()) if self.probe and before else {}
        return {"streams": n, "tok/s": generated / wall, "tok/cpu-s": generated / cpu,
                "ITL p50 ms": float(np.percentile(itl, 50)), "ITL p99 ms": float(np.percentile(itl, 99)), **steps}

    async def mixed(self, stream: Stream, arrivals: int, prompt_len: int, gap_s: float) -> dict:
        running = [asyncio.create_task(stream(self._rid(), _prompt(20, 1000 + i), 48 + 8 * arrivals))
                   for i in range(8)]
        await asyncio.sleep(1.0)  # the 8 streams are decoding
        arriving = []
        for i in range(arrivals):
            arriving.append(asyncio.create_task(stream(self._rid(), _prompt(prompt_len, 2000 + i), 4)))
            await asyncio.sleep(gap_s)
        late = await asyncio.gather(*arriving)
        window_end = max(t[-1] for t in late)
        runs = await asyncio.gather(*running)
        window_start = min(t[0] for t in late)
        # the running streams' gaps while prompts arrived (and the whole run for reference)
        during = np.concatenate([np.diff([x for x in t[1:] if window_start <= x <= window_end]) for t in runs]) * 1000
        itl = _itls(runs)
        ttft = np.array([t[1] - t[0] for t in late]) * 1000
        return {"ITL p50 ms": float(np.percentile(itl, 50)), "ITL p99 ms": float(np.percentile(itl, 99)),
                "ITL max ms": float(itl.max()),
                "p50 while arriving": float(np.percentile(during, 50)) if len(during) else float("nan"),
                "p99 while arriving": float(np.percentile(during, 99)) if len(during) else float("nan"),
                "arrival TTFT p50 ms": float(np.percentile(ttft, 50))}

    async def run(self, stream: Stream, quick: bool) -> dict:
        await self.streams(stream, 2, 8)  # warm-up: first-call costs, the speed fit's first steps
        tokens = 24 if quick else 64
        rows = [await self.streams(stream, n, tokens) for n in (1, 8, 16)]
        for r in rows:
            r["vs 1 stream"] = r["tok/s"] / rows[0]["tok/s"]
        mixed = await self.mixed(stream, 3 if quick else 6, 256, 0.5)
        return {"streams": rows, "mixed": mixed}


Work = Callable[[Stream, Callable[[str], Probe] | None], Awaitable[dict]]
"""What a run does with a setup: ``work(stream, probes)``; ``probes(kind)``: the engine's step totals of that kind
(None against another server)."""


async def in_process(threads: int, work: Work, quantized: bool = True, engine: dict | None = None) -> dict:
    settings = EngineSettings(threads=threads, max_num_seqs=64, quantized_weights=quantized, **(engine or {}))
    engine = AsyncEngine(LLMEngine(settings), asyncio.get_running_loop())
    try:
        return await work(engine_stream(engine), lambda kind: engine_probe(engine, kind))
    finally:
        await engine.close()


async def through_stack(threads: int, work: Work, quantized: bool = True, engine: dict | None = None,
                        pd: bool = False) -> dict:
    """``kvmesh up --prefill 0 --decode 0 --both 1`` (``pd``: ``--prefill 1 --decode 1 --both 0``) in a temporary
    state directory, driven over HTTP; the probes read the engine that runs those steps (``both``; through PD,
    ``decode`` for decode-only steps and ``prefill`` for steps with prompt tokens)."""
    import aiohttp

    from app.launcher import Stack, StackOptions

    opts = StackOptions.local("bench-serving", prefill=int(pd), decode=int(pd), both=int(not pd),
                              settings={"engine": {"threads": threads, "max_num_seqs": 64,
                                                   "quantized_weights": quantized, **(engine or {})}})
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Path(tmp), opts)
        await asyncio.to_thread(stack.start, timeout_s=300)
        try:
            timeout = aiohttp.ClientTimeout(total=600)
            async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
                def engine(kind: str) -> str:
                    role = "both" if not pd else kind
                    return next(s for s in stack.services if s.name.startswith(role)).endpoints["metrics"]

                return await work(http_stream(session, f"http://127.0.0.1:{stack.http_port}"),
                                  lambda kind: metrics_probe(session, engine(kind), kind))
        finally:
            await asyncio.to_thread(stack.stop)


async def against_target(url: str, model: str, work: Work) -> dict:
    """The same scenarios against another server (``--target``): a baseline in the same run."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        return await work(http_stream(session, url.rstrip("/"), model), None)


def _fmt(row: dict) -> dict:
    return {k: (f"{v:.1f}" if isinstance(v, float) and not k.startswith("vs") else
                f"{v:.2f}x" if isinstance(v, float) else v) for k, v in row.items()}


WEIGHTS = {"quantized": True, "dense": False}  # --weights: the GGUF's blocks, or their fp32 dequantization


def render(results: dict[str, dict], threads: int, stack: bool = False) -> str:
    """``results``: per weight form (``WEIGHTS``), one ``Bench.run``; ``target``, when given, the baseline server's
    (each row then also shows its tok/s against the target's at the same number of streams)."""
    target = next((res for w, res in results.items() if w.startswith("target")), None)
    base = {} if target is None else {r["streams"]: r["tok/s"] for r in target["streams"]}
    # tok/cpu-s counts this process's CPU: the engine's in process, only the client's through the stack
    stream_cols = ["weights", "streams", "tok/s", "vs 1 stream", *([] if target is None else ["vs target"]),
                   *([] if stack else ["tok/cpu-s"]), "ITL p50 ms", "ITL p99 ms", "step ms", "step CPU ms",
                   "rows/step"]
    mixed_cols = ["weights", "ITL p50 ms", "ITL p99 ms", "p99 / p50", "ITL max ms", "p50 while arriving",
                  "p99 while arriving", "arrival TTFT p50 ms"]
    streams = [_fmt({"weights": w, **r, **({"vs target": r["tok/s"] / base[r["streams"]]} if base else {})})
               for w, res in results.items() for r in res["streams"]]
    mixed = [_fmt({"weights": w, **res["mixed"],
                   "p99 / p50": f"{res['mixed']['ITL p99 ms'] / res['mixed']['ITL p50 ms']:.2f}"})
             for w, res in results.items()]
    return "\n\n".join([
        (f"Default model (SmolLM2-135M-Instruct, fp32 compute), {threads} thread(s), "
         + ("through `kvmesh up --prefill 0 --decode 0 --both 1` (router, NATS, cachesvc, one engine process), "
            "streaming `/v1/completions` over HTTP" if stack else "through `AsyncEngine`")
         + "; 20-token prompts, 64 tokens per stream. `quantized`: the kernel reads the GGUF's Q4_1 / Q8_0 "
           "blocks (`engine.quantized_weights`, the default); `dense`: their fp32 dequantization, the same "
           "values (greedy tokens identical); one after the other in this run. `step ms`, `step CPU ms`, "
           "`rows/step`: the mean decode-only step over the scenario, wall and the engine thread's CPU, and its "
           "batch, from the engine's step counters."),
        markdown_table(streams, stream_cols),
        "Mixed: 8 streams decoding while 256-token prompts arrive every 0.5 s (ITL of the 8 running streams):",
        markdown_table(mixed, mixed_cols),
    ])


SCENARIOS = ("streams", "cold", "slo")  # streams: 1 / 8 / 16 streams and the mixed arrivals (app.bench.prefill_slo)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.bench.engine_serving")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="fewer tokens (a smoke run)")
    p.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    p.add_argument("--section", default=None, help="docs/benchmarks.md section to (re)write (default: "
                   f"{SECTION!r}, with --stack {SECTION_STACK!r}, with --target {SECTION_TARGET!r}; with "
                   f"--scenarios cold,slo {SECTION_PREFILL!r})")
    p.add_argument("--scenarios", default="streams", help=f"comma-separated, of {', '.join(SCENARIOS)} "
                   "(cold: fresh 1,500-token prompts; slo: scenario C, streams and long prompts with targets)")
    p.add_argument("--repeats", type=int, default=3, help="cold prompts per setup")
    p.add_argument("--weights", choices=[*WEIGHTS, "both"], default="both",
                   help="which weight form(s) the engine reads (default: both, one after the other)")
    p.add_argument("--mixed-step-stall", type=float, default=None,
                   help="engine.mixed_step_stall for this run (default: the engine's)")
    p.add_argument("--stack", action="store_true",
                   help="through kvmesh up --both 1 over HTTP instead of AsyncEngine in this process")
    p.add_argument("--pd", action="store_true", help="(also) through kvmesh up --prefill 1 --decode 1 over HTTP")
    p.add_argument("--target", default="", help="also run the scenarios against this OpenAI-compatible server "
                   "(e.g. vLLM serving the same weights), after kvmesh's, as the baseline of the run")
    p.add_argument("--target-name", default="target", help="what the tables call the --target server")
    p.add_argument("--model", default="", help="the 'model' field --target wants (e.g. its --served-model-name)")
    args = p.parse_args(argv)
    scenarios = set(args.scenarios.split(","))
    if unknown := scenarios - set(SCENARIOS):
        p.error(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    torch.set_num_threads(args.threads)
    forms = list(WEIGHTS) if args.weights == "both" else [args.weights]
    engine = {} if args.mixed_step_stall is None else {"mixed_step_stall": args.mixed_step_stall}
    setups = [("both", False)] * args.stack + [("pd", True)] * args.pd

    async def work(stream: Stream, probes: Callable[[str], Probe] | None) -> dict:
        out = {}
        if "streams" in scenarios:
            out |= await Bench(probes("decode") if probes else None).run(stream, args.quick)
        counter = iter(range(10**9))
        out |= await prefill_slo.run(stream, lambda: f"p{next(counter)}", scenarios, args.repeats,
                                     probes("prefill") if probes else None)
        return out

    results = {}
    for w in forms:
        if not setups:
            results[w] = asyncio.run(in_process(args.threads, work, WEIGHTS[w], engine))
        for name, pd in setups:
            label = w if len(setups) == 1 and "streams" in scenarios else f"kvmesh {name}, {w}"
            results[label] = asyncio.run(through_stack(args.threads, work, WEIGHTS[w], engine, pd))
    if args.target:
        results[f"target: {args.target_name}"] = asyncio.run(against_target(args.target, args.model, work))
    parts = []
    if "streams" in scenarios:
        parts.append(render(results, args.threads, bool(setups)))
    if scenarios & {"cold", "slo"}:
        parts.append(prefill_slo.render(results, prefill_slo.fma_peak(), args.repeats))
    body = "\n\n".join(parts) + f"\n\nLoad average (1, 5, 15 min) at the end: {load_average()}."
    if engine:
        body = f"`engine.mixed_step_stall` = {args.mixed_step_stall:g}.\n\n" + body
    section = args.section or ((SECTION_PREFILL.format(target=args.target_name) if args.target
                                else SECTION_PREFILL.split(" vs ")[0]) if "streams" not in scenarios
                               else SECTION_TARGET.format(target=args.target_name) if args.target
                               else SECTION_STACK if setups else SECTION)
    cmd = (f"kvmesh bench engine --serving --threads {args.threads}" + (" --stack" if args.stack else "")
           + (" --pd" if args.pd else "") + ("" if args.scenarios == "streams" else f" --scenarios {args.scenarios}")
           + ("" if args.weights == "both" else f" --weights {args.weights}")
           + ("" if args.mixed_step_stall is None else f" --mixed-step-stall {args.mixed_step_stall:g}")
           + (f" --target {args.target} --target-name '{args.target_name}'" if args.target else "")
           + (f" --model {args.model}" if args.model else "")
           + (f" --section '{args.section}'" if args.section else ""))
    publish(section, cmd, body, write=not args.no_write and not args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
