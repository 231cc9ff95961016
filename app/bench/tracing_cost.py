"""The cost of tracing: TTFT with tracing on vs off, in the same run.

    kvmesh bench tracing [--requests N] [--max-tokens N] [--pause-ms MS] [--keep-spans FILE] [--no-write]

Two identical stacks run side by side (1 prefill + 1 decode each, 1 thread per engine): one traces every
request to its JSONL span file (what `kvmesh up` does), the other has tracing off (``KVMESH_TELEMETRY_TRACING=0``: no
SDK; trace context still passes through). Three arms per prompt, one request at a time, their order rotating:

- **on**: the traced stack, the request sampled (its ``traceparent`` flag 01);
- **off**: the untraced stack, the same prompt (same tokens, same cache state);
- **sampled out**: the traced stack, a same-length variant of the prompt sent with flag 00, so no span is
  recorded: on vs sampled out compares the same processes, free of any difference between the two stacks.

TTFT is measured at an HTTP client streaming from each router. A fourth, noise-free figure: the CPU time the
SDK and the JSONL exporter spend on one request's spans, timed in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from kvmesh.telemetry.spans import read_spans, roots, trace_file

from app.bench.report import markdown_table, publish
from app.bench.serve import sse_text
from app.bench.stats import percentile
from app.launcher import Stack, StackOptions

SECTION = "Tracing on vs off"

TOPICS = ["rivers", "volcanoes", "owls", "bread", "comets", "chess", "glaciers", "violins", "tea", "bridges",
          "deserts", "bees", "clocks", "whales", "maps", "salt", "kites", "coral", "lamps", "ferns"]


def question(i: int) -> str:
    """Prompts of equal length: the number always has four digits."""
    return f"Give me one short fact about {TOPICS[i % len(TOPICS)]} (#{i:04d})."


def _stack(directory: Path, name: str, tracing: bool) -> Stack:
    env = {} if tracing else {"KVMESH_TELEMETRY_TRACING": "0"}
    opts = StackOptions.local(name, env=env)
    return Stack(directory / name, opts)


def stream_ttft(port: int, q: str, max_tokens: int, sampled: bool = True) -> float:
    """TTFT (s) of one streamed chat completion at the client, sent with a fresh ``traceparent``."""
    tp = f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-{'01' if sampled else '00'}"
    body = json.dumps({"messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", "traceparent": tp})
    t0 = time.perf_counter()
    ttft = None
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if ttft is None and sse_text(line):
                ttft = time.perf_counter() - t0
    return ttft or time.perf_counter() - t0


def run(requests: int = 120, max_tokens: int = 4, pause_s: float = 0.25,
        keep_spans: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        on, off = _stack(Path(tmp), "traced", True), _stack(Path(tmp), "untraced", False)
        try:
            on.start(timeout_s=300)
            off.start(timeout_s=300)
            for stack in (on, off):
                for q in ("warm up", "warm up again"):
                    stream_ttft(stack.http_port, q, 2)
            ttft: dict[str, list[float]] = {"on": [], "off": [], "sampled_out": []}
            arms = [("on", on, 0, True), ("off", off, 0, True), ("sampled_out", on, 5000, False)]
            for i in range(requests):
                for key, stack, shift, sampled in arms[i % 3:] + arms[:i % 3]:
                    time.sleep(pause_s)  # the previous request's write-back and KV events settle first
                    q = question(i + shift)
                    ttft[key].append(stream_ttft(stack.http_port, q, max_tokens, sampled))
            time.sleep(1.0)  # the last spans reach the file
            path = trace_file(on.state_dir)
            spans = read_spans(path)
            traced = max(1, len(roots(spans)))
            per_request, bytes_per_request = len(spans) / traced, path.stat().st_size / traced
            if keep_spans:
                shutil.copyfile(path, keep_spans)
        finally:
            on.stop()
            off.stop()
    return {**ttft, "spans_per_request": per_request, "bytes_per_request": bytes_per_request,
            "cpu_us_per_request": span_cpu_us(round(per_request))}


def span_cpu_us(spans_per_request: int, rounds: int = 300) -> float:
    """CPU microseconds the SDK + JSONL exporter spend on one request's spans (created, attributed, ended,
    serialised and written), measured in this process."""
    from kvmesh.telemetry import tracing
    from kvmesh.telemetry.jsonl import JsonlSpanExporter

    with tempfile.TemporaryDirectory() as tmp:
        exporter = JsonlSpanExporter(Path(tmp) / "t.jsonl")
        provider = tracing.make_provider("bench", "bench", 1.0, [(exporter, 200.0)])
        tracer = provider.get_tracer("bench")
        attrs = {"kvmesh.request_id": "0" * 32, "kvmesh.model": "SmolLM2-135M-Instruct", "kvmesh.tenant": "",
                 "kvmesh.instance": "prefill-0", "kvmesh.blocks": 3, "kvmesh.bytes": 2_211_840}
        t0 = time.process_time()
        for _ in range(rounds):
            root = tracing.start("router.request", None, attributes=attrs, tracer_=tracer)
            for _ in range(spans_per_request - 1):
                tracing.start("child", root, attributes=attrs, tracer_=tracer).end()
            root.end()
        provider.force_flush()
        cpu = time.process_time() - t0
        provider.shutdown()
    return cpu / rounds * 1e6


def _paired(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Median and mean of the paired differences a - b, and the half-width of the mean's 95% interval (s)."""
    d = [x - y for x, y in zip(a, b)]
    half = 1.96 * statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else 0.0
    return statistics.median(d), statistics.fmean(d), half


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench tracing")
    p.add_argument("--requests", type=int, default=120, help="prompts; each goes to all three arms")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--pause-ms", type=float, default=250, help="idle time before each request")
    p.add_argument("--keep-spans", metavar="FILE", help="copy the traced stack's span file here "
                   "(then: kvmesh trace --file FILE --slowest 5)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    res = run(args.requests, args.max_tokens, args.pause_ms / 1000, args.keep_spans)
    on, off, out = res["on"], res["off"], res["sampled_out"]
    base = percentile(off, 50)
    arms = (("off: untraced stack (no SDK)", off), ("sampled out: traced stack, flag 00", out),
            ("on: traced stack, JSONL span file", on))
    rows = [{"arm": name, "TTFT p50 ms": f"{percentile(xs, 50) * 1000:.1f}",
             "TTFT p90 ms": f"{percentile(xs, 90) * 1000:.1f}",
             "TTFT mean ms": f"{statistics.fmean(xs) * 1000:.1f}"}
            for name, xs in arms]
    verdicts = []
    for name, other, other_name in (("on − off", off, "off"), ("on − sampled out", out, "sampled out")):
        med, mean, half = _paired(on, other)
        p50 = percentile(on, 50) - percentile(other, 50)
        rows.append({"arm": name, "TTFT p50 ms": f"{p50 * 1000:+.1f} ({p50 / base * 100:+.1f}%)",
                     "TTFT p90 ms": f"median paired {med * 1000:+.1f} ({med / base * 100:+.1f}%)",
                     "TTFT mean ms": f"{mean * 1000:+.1f} ± {half * 1000:.1f} (95% CI, paired)"})
        verdicts.append(f"on vs {other_name}: " + ("the 95% interval of the paired mean includes zero"
                                                    if abs(mean) <= half else
                                                    f"{mean * 1000:+.1f} ms on average, outside the noise"))
    cpu_ms = res["cpu_us_per_request"] / 1000
    body = (f"{args.requests} short chat prompts (~45 tokens with the template), each sent to three arms in "
            f"rotating order (see `app/bench/tracing_cost.py`), one request at a time, greedy, "
            f"{args.max_tokens} output tokens, {args.pause_ms:g} ms idle before each; default model, "
            "1 prefill + 1 decode per stack, 1 thread per engine, both stacks on this machine.\n\n"
            + markdown_table(rows, ["arm", "TTFT p50 ms", "TTFT p90 ms", "TTFT mean ms"])
            + f"\n\n{'; '.join(verdicts)}. A traced request writes {res['spans_per_request']:.1f} spans "
            f"({res['bytes_per_request'] / 1024:.1f} KiB of JSONL); the SDK and the exporter spend "
            f"{cpu_ms:.2f} ms of CPU on them ({cpu_ms / (base * 1000) * 100:.2f}% of the untraced TTFT p50), "
            "spread over three processes, partly on the exporters' background threads, off the request path.")
    publish(SECTION, "kvmesh bench tracing", body, write=not args.no_write)
    return 0
