"""Mesh overhead: TTFT through the whole stack vs the engine alone, same short prompts, same run.

    kvmesh bench mesh [--requests N] [--max-tokens N] [--no-write]
    kvmesh bench mesh --pd [--turns N] [--repeats N] [--no-write]   (PD vs role both: app/bench/pd.py)
    kvmesh bench mesh --pd --tls-compare [...]   (the same workload with the mesh's mTLS on and off, same run)

The stack is 1 prefill + 1 decode (each 1 thread) + router + cachesvc + nats-server on this machine; TTFT is
measured at an HTTP client streaming from the router (SSE), one request at a time. The engine alone runs in this
process with 1 thread, prefix caching on in both (the chat template's system prompt is shared by all prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path

from kvmesh.contracts.engine import EngineRequest
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.llm_engine import LLMEngine
from kvmesh.settings import EngineSettings

from app.bench.report import markdown_table, publish
from app.bench.serve import sse_text
from app.bench.stats import percentile, quantiles
from app.launcher import Stack, StackOptions

SECTION = "Mesh vs the engine alone"
SECTION_PD = "PD vs role both"
SECTION_PD_VLLM = "PD vs role both, vLLM instances"
SECTION_TLS = "Mesh mTLS on vs off"

TOPICS = ["rivers", "volcanoes", "owls", "bread", "comets", "chess", "glaciers", "violins", "tea", "bridges",
          "deserts", "bees", "clocks", "whales", "maps", "salt", "kites", "coral", "lamps", "ferns"]


def prompts(n: int) -> list[str]:
    return [f"Give me one short fact about {TOPICS[i % len(TOPICS)]} (#{i})." for i in range(n)]


def stream_ttft(port: int, question: str, max_tokens: int) -> tuple[float, float]:
    """(TTFT, total) seconds of one streamed chat completion, at the client."""
    body = json.dumps({"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if ttft is None and sse_text(line):
                ttft = time.perf_counter() - t0
    return (ttft or time.perf_counter() - t0), time.perf_counter() - t0


def engine_ttft(engine: LLMEngine, question: str, max_tokens: int) -> float:
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    t0 = time.perf_counter()
    engine.add_request(EngineRequest("b", tuple(ids), SamplingParams(max_tokens=max_tokens)))
    ttft = None
    while engine.has_unfinished():
        if engine.step().outputs and ttft is None:
            ttft = time.perf_counter() - t0
    engine.completion("b")
    return ttft or 0.0


def run(requests: int = 20, max_tokens: int = 8) -> dict:
    qs = prompts(requests)
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Path(tmp), StackOptions.local("bench"))
        stack.start(timeout_s=240)
        try:
            stream_ttft(stack.http_port, "warm up", 2)
            mesh = [stream_ttft(stack.http_port, q, max_tokens)[0] for q in qs]
        finally:
            stack.stop()
    engine = LLMEngine(EngineSettings(threads=1))
    engine_ttft(engine, "warm up", 2)
    alone = [engine_ttft(engine, q, max_tokens) for q in qs]
    return {"mesh": mesh, "engine": alone}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench mesh")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--pd", action="store_true", help="PD (auto and forced) vs role both: a cold 1,500-token "
                   "prompt and a multi-turn chat, bytes pushed per turn")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3, help="--pd: cold prompts and chats, each fresh")
    p.add_argument("--backend", choices=["native", "vllm"], default="native",
                   help="--pd: the engines' backend (vllm: `make vllm` first)")
    p.add_argument("--back-to-back", action="store_true", help="--pd: each stack's chat turns one right after the "
                   "other (printed, not written: the bytes per turn when the next turn does not wait)")
    p.add_argument("--tls-compare", action="store_true", help="--pd: role both and forced PD, each with the mesh's "
                   "mutual TLS (kvmesh up's default) and with [shared] mesh_tls = false, side by side")
    args = p.parse_args(argv)
    if args.pd:
        from app.bench import pd

        load = os.getloadavg()[0]
        res = pd.run(pd.TLS_SETUPS if args.tls_compare else pd.SETUPS, turns=args.turns, repeats=args.repeats,
                     backend=args.backend, back_to_back=args.back_to_back)
        engines = ("vLLM 0.32 (CPU build) engines, `[engine] backend = vllm` (vLLM's blocks of 128 tokens, KV for "
                   "4,224 tokens each)" if args.backend == "vllm" else "native engines")
        body = (f"1-minute load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (2 shared "
                f"cores). {engines}. Token-id prompts, greedy, ignore_eos, 16 output tokens; default model "
                "(SmolLM2-135M fp32), 1 thread per engine; TTFT at an HTTP client streaming from the router. The "
                "stacks run side by side and each prompt goes to each of them in turn (the order rotating prompt by "
                "prompt), one "
                "request in flight at a time, so all see the same machine load. Chat: 95 tokens, then "
                f"+107 per turn (a stand-in of the reply's length plus the next question), {args.turns} turns. ")
        vllm = args.backend == "vllm"
        command = ("kvmesh bench mesh --pd" + (" --backend vllm" if vllm else "")
                   + (f" --turns {args.turns}" if args.turns != 10 else "")
                   + (f" --repeats {args.repeats}" if args.repeats != 3 else ""))
        if args.tls_compare:
            body += ("`on`: the stack as `kvmesh up` runs it, mutual TLS on every internal hop (gRPC router → "
                     "prefill / decode / cachesvc, NATS, and the KV push prefill → decode, TLS 1.3 with the payload "
                     "sealed under a key of its own); `off`: `[shared] mesh_tls = false`, all of it plaintext. "
                     "`pd always`: header `x-kvmesh-disaggregate: always`, every request through prefill, a push "
                     "and decode. `cold "
                     "hand-off GB/s`: the cold prompt's KV push (`kv.push`'s `kvmesh.bytes`) over its parts' own "
                     "push times (`kvmesh.push_ms`), while prefill computes the next layers; `push after compute`: "
                     "what of it was left on the TTFT path (`kvmesh.critical_ms`).\n\n" + pd.tls_report(res))
            publish(SECTION_TLS, command + " --tls-compare", body, write=not args.no_write and not args.back_to_back)
            return 0
        body += ("`pd auto`: the router's "
                "cost model picks PD or decode-computes-the-rest per request; `pd always`: header "
                "`x-kvmesh-disaggregate: always`; both push the KV in layer groups (`instance.push_layer_groups`, "
                "its default) while the forward pass computes, `pd always, chunk parts` in whole blocks after each "
                "chunk (`push_layer_groups` 1). `cold push after compute`: what of the KV push was left on the TTFT "
                "path after prefill's compute (kv.push's `kvmesh.critical_ms`) against the push time "
                "(`kvmesh.push_ms`, "
                "the parts' own push times added up); `chat push after compute`: the same over the chat turns that "
                "pushed (one chunk each, a delta).\n\n" + pd.report(res))
        publish(SECTION_PD_VLLM if vllm else SECTION_PD, command, body,
                write=not args.no_write and not args.back_to_back)
        return 0
    res = run(args.requests, args.max_tokens)
    rows = []
    for name, xs in (("engine alone (in process)", res["engine"]), ("mesh (router → prefill → decode)", res["mesh"])):
        q = quantiles(xs)
        rows.append({"path": name, **{f"TTFT {p} ms": f"{q[p] * 1000:.1f}" for p in ("p50", "p90", "p99")}})
    over = percentile(res["mesh"], 50) - percentile(res["engine"], 50)
    rows.append({"path": "mesh overhead at p50", "TTFT p50 ms": f"+{over * 1000:.1f} "
                 f"({over / percentile(res['engine'], 50) * 100:.0f}%)"})
    body = (f"{args.requests} short chat prompts (~45 tokens with the template), one at a time, greedy, "
            f"{args.max_tokens} output tokens; default model, 1 thread per engine.\n\n"
            + markdown_table(rows, ["path", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms"]))
    publish(SECTION, "kvmesh bench mesh", body, write=not args.no_write)
    return 0
