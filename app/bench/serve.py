"""``kvmesh bench serve``: drive any OpenAI-compatible endpoint with a workload and measure it at the client.

    kvmesh bench serve --target http://127.0.0.1:8000 [--target llama.cpp=http://127.0.0.1:8080 ...]
        [--workload multi-turn|shared-system|rag|low-reuse|hot-switch|trace] [--conversations N] [--turns N]
        [--requests N] [--max-tokens N] [--concurrency N | --rate R] [--seed S]
        [--trace FILE --token-scale F --time-scale F --max-requests N]
        [--slo-ttft S] [--slo-itl S] [--timeout S] [--max-duration S] [--out DIR] [--doc SECTION --note TEXT]

Every request streams (SSE) with ``stream_options.include_usage``, greedy by default, so TTFT and every
inter-token gap are timed here, and the cached-token count comes from ``usage.prompt_tokens_details``. Several
``--target``s run the same workload one after the other (never at once: they would share the CPUs), and the
table puts them side by side. The output directory gets ``results.json`` (settings, summaries, every request),
``summary.md`` and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from tqdm import tqdm

from app.bench import workloads as wl
from app.bench.report import markdown_table, write_section
from app.bench.stats import SLO, RequestRecord, ms, percentile, summarize

DEFAULT_TRACE = Path(__file__).resolve().parents[4] / "shared" / "data" / "traces" / "conversation_trace.jsonl"


@dataclass
class RunOptions:
    model: str | None = None           # None: the first model the server lists
    concurrency: int = 4               # closed loop: conversations in flight (ignored when arrivals are set)
    temperature: float = 0.0
    seed: int | None = None            # sampling seed sent with each request (vLLM's extension)
    timeout_s: float = 120.0           # per request, connect to last byte
    max_duration_s: float = 600.0      # the whole run; what has not started by then is not sent
    api_key: str | None = None
    slo: SLO = field(default_factory=SLO)


@dataclass
class RunResult:
    label: str
    target: str
    model: str
    records: list[RequestRecord]
    duration_s: float
    phases: list[tuple[str, float]]    # (phase, duration_s)

    def summary(self, slo: SLO, phase: str | None = None) -> dict:
        recs = [r for r in self.records if phase is None or r.phase == phase]
        duration = self.duration_s if phase is None else dict(self.phases).get(phase, 0.0)
        return summarize(recs, duration, slo)


# -- one request -----------------------------------------------------------------------------------------------

def base_url(target: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` → the URL that ``/chat/completions`` hangs off."""
    t = target.rstrip("/")
    return t if t.endswith("/v1") else t + "/v1"


def _headers(opts: RunOptions) -> dict[str, str]:
    h = {"content-type": "application/json"}
    if opts.api_key:
        h["authorization"] = f"Bearer {opts.api_key}"
    return h


def request_body(model: str, messages: list[dict] | None, turn: wl.Turn, opts: RunOptions) -> dict:
    body: dict = {"model": model, "max_tokens": turn.max_tokens, "temperature": opts.temperature, "stream": True,
                  "stream_options": {"include_usage": True}}
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = list(turn.prompt_ids or ())
    if turn.ignore_eos:
        body["ignore_eos"] = True
    if opts.seed is not None:
        body["seed"] = opts.seed
    return body


def sse_text(line: bytes) -> str:
    """The text one line of an OpenAI event stream carries: its first choice's delta (a chat) or text (a
    completion); "" for any other line (``[DONE]``, a role-only or usage chunk, a blank line)."""
    if not line.startswith(b"data: ") or line[6:].strip() == b"[DONE]":
        return ""
    choices = json.loads(line[6:]).get("choices") or [{}]
    return _chunk_text(choices[0])


def _chunk_text(choice: dict) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return delta.get("content") or ""
    return choice.get("text") or ""


async def stream_request(session: aiohttp.ClientSession, url: str, body: dict, rec: RequestRecord,
                         timeout_s: float, headers: dict[str, str]) -> None:
    """POST one streaming request and fill ``rec`` (TTFT, gaps, usage, text, error) as chunks arrive."""
    parts: list[str] = []
    chunks = 0
    t0 = time.perf_counter()
    last = t0
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, json=body, headers=headers) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    try:
                        text = json.loads(text)["error"]["message"]
                    except (ValueError, KeyError, TypeError):
                        pass
                    rec.error = f"HTTP {resp.status}: {str(text)[:200]}"
                    return
                async for raw in resp.content:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        err = obj["error"]
                        rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                        break
                    now = time.perf_counter()
                    for c in obj.get("choices") or []:  # return_token_ids: each chunk's own tokens
                        rec.token_ids.extend(c.get("token_ids") or ())
                    text = "".join(_chunk_text(c) for c in obj.get("choices") or [])
                    if text:
                        if rec.ttft_s is None:
                            rec.ttft_s = now - t0
                        else:
                            rec.itl_s.append(now - last)
                        last = now
                        chunks += 1
                        parts.append(text)
                    usage = obj.get("usage")
                    if usage:
                        rec.output_tokens = int(usage.get("completion_tokens") or 0)
                        rec.prompt_tokens = usage.get("prompt_tokens")
                        rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except TimeoutError:
        rec.timed_out = True
        rec.error = f"no answer within {timeout_s:.0f} s"
    except (aiohttp.ClientError, ConnectionError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        rec.e2e_s = time.perf_counter() - t0
        rec.text = "".join(parts)
        if not rec.output_tokens:
            rec.output_tokens = chunks
        if rec.error is None and rec.ttft_s is None:
            rec.error = "the stream ended without any content"


# -- a workload ------------------------------------------------------------------------------------------------

class Progress:
    """A tqdm bar on stderr: done/total, rate, errors and TTFT p50 so far. Off when not ``enabled``
    (``--quiet``) and when stderr is not a terminal."""

    def __init__(self, total: int, label: str, enabled: bool = True) -> None:
        self.bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr, dynamic_ncols=True,
                        disable=None if enabled else True)  # None: tqdm's "off unless a TTY"
        self.errors = 0
        self.ttfts: list[float] = []

    def update(self, rec: RequestRecord) -> None:
        if self.bar.disable:
            return
        self.errors += not rec.ok
        if rec.ttft_s is not None:
            self.ttfts.append(rec.ttft_s)
        self.bar.set_postfix_str(f"errors {self.errors} TTFT p50 {ms(percentile(self.ttfts, 50))} ms",
                                 refresh=False)
        self.bar.update()

    def close(self) -> None:
        self.bar.close()


async def _model_id(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> str:
    async with session.get(url + "/models", headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as r:
        data = await r.json(content_type=None)
    return data["data"][0]["id"]


async def run_workload(target: str, workload: wl.Workload, opts: RunOptions, label: str = "",
                       on_record: Callable[[RequestRecord], None] | None = None, progress: bool = True
                       ) -> RunResult:
    """Run every phase of ``workload`` against ``target`` and return one record per turn (sent or not)."""
    url = base_url(target)
    headers = _headers(opts)
    deadline = time.monotonic() + opts.max_duration_s
    records: list[RequestRecord] = []
    bar = Progress(workload.num_requests, label or target, progress)
    run_t0 = time.perf_counter()
    phases: list[tuple[str, float]] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        model = opts.model or await _model_id(session, url, headers)

        async def conversation(conv: wl.Conversation, phase: str, phase_t0: float) -> None:
            if conv.arrival_s is not None:
                await asyncio.sleep(max(0.0, phase_t0 + conv.arrival_s - time.monotonic()))
            history: list[dict] = [{"role": "system", "content": conv.system}] if conv.system else []
            failed = False
            for n, turn in enumerate(conv.turns):
                rec = RequestRecord(f"{conv.id}/{n}", phase=phase)
                remaining = deadline - time.monotonic()
                if failed or remaining <= 0:
                    rec.error = "not sent: an earlier turn failed" if failed else "not sent: run deadline"
                else:
                    messages = None
                    if turn.user is not None:
                        history.append({"role": "user", "content": turn.user})
                        messages = list(history)
                    rec.start_s = time.perf_counter() - run_t0
                    path = "/chat/completions" if messages is not None else "/completions"
                    await stream_request(session, url + path, request_body(model, messages, turn, opts), rec,
                                         min(opts.timeout_s, remaining), headers)
                    if turn.user is not None:
                        history.append({"role": "assistant", "content": rec.text})
                    failed = not rec.ok
                records.append(rec)
                bar.update(rec)
                if on_record is not None:
                    on_record(rec)

        for phase in workload.phases:
            p0 = time.perf_counter()
            mono0 = time.monotonic()
            if any(c.arrival_s is not None for c in phase.conversations):  # open loop
                await asyncio.gather(*(conversation(c, phase.name, mono0) for c in phase.conversations))
            else:  # closed loop: `concurrency` workers take conversations in order
                queue = list(phase.conversations)[::-1]

                async def worker(queue: list[wl.Conversation], phase: str, t0: float) -> None:
                    while queue:
                        await conversation(queue.pop(), phase, t0)

                await asyncio.gather(*(worker(queue, phase.name, mono0) for _ in range(max(1, opts.concurrency))))
            phases.append((phase.name, time.perf_counter() - p0))
    bar.close()
    return RunResult(label or target, target, model, records, time.perf_counter() - run_t0, phases)


# -- output ----------------------------------------------------------------------------------------------------

COLUMNS = ["target", "ok", "errors", "timeouts", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms",
           "E2E p50/p90/p99 ms", "req/s", "out tok/s", "goodput req/s", "SLO met", "cached"]


def _q(d: dict) -> str:
    return "/".join(ms(d[k]) for k in ("p50", "p90", "p99"))


def table_row(name: str, s: dict) -> dict:
    ratio = s["cached_ratio"]
    return {"target": name, "ok": f"{s['ok']}/{s['requests']}", "errors": s["errors"], "timeouts": s["timeouts"],
            "TTFT p50/p90/p99 ms": _q(s["ttft_s"]), "ITL p50/p90/p99 ms": _q(s["itl_s"]),
            "E2E p50/p90/p99 ms": _q(s["e2e_s"]), "req/s": f"{s['throughput_req_s']:.2f}",
            "out tok/s": f"{s['throughput_tok_s']:.1f}", "goodput req/s": f"{s['goodput_req_s']:.2f}",
            "SLO met": f"{s['slo_met']}/{s['requests']}",
            "cached": "n/a" if math.isnan(ratio) else f"{ratio * 100:.0f}% ({s['cached_tokens']} tok)"}


def terminal_table(rows: list[dict], columns: list[str]) -> str:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    def line(cells) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return "\n".join([line(columns), line("-" * w for w in widths),
                      *(line(r.get(c, "") for c in columns) for r in rows)])


def _json_safe(x):
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def write_outputs(out: Path, results: list[RunResult], slo: SLO, settings: dict, note: str = "") -> dict:
    """results.json, summary.md and the plots. Returns the paths written, by kind."""
    out.mkdir(parents=True, exist_ok=True)
    data = {"settings": settings, "slo": asdict(slo), "runs": [
        {"label": r.label, "target": r.target, "model": r.model, "duration_s": r.duration_s,
         "summary": r.summary(slo), "phases": {p: r.summary(slo, p) for p, _ in r.phases},
         "records": [asdict(x) for x in r.records]} for r in results]}
    (out / "results.json").write_text(json.dumps(_json_safe(data), indent=1))
    md = summary_markdown(results, slo, settings, note)
    (out / "summary.md").write_text(md + "\n")
    from app.bench import plots

    pngs = plots.plot_runs(out, {r.label: r.records for r in results})
    return {"json": out / "results.json", "markdown": out / "summary.md", "png": pngs}


def summary_markdown(results: list[RunResult], slo: SLO, settings: dict, note: str = "") -> str:
    rows = [table_row(r.label, r.summary(slo)) for r in results]
    text = (f"Workload `{settings['workload']}` ({settings['requests']} requests), "
            f"{settings['mode']}, max {settings['max_tokens']} output tokens, temperature "
            f"{settings['temperature']}; SLO: TTFT ≤ {slo.ttft_s:g} s and mean ITL ≤ {slo.itl_s:g} s. "
            "Latencies measured at the streaming client; ITL = gaps between content chunks; cached = "
            "`usage.prompt_tokens_details.cached_tokens` / prompt tokens.\n\n" + markdown_table(rows, COLUMNS))
    multi = [r for r in results if len(r.phases) > 1]
    for r in multi:
        prow = [table_row(p, r.summary(slo, p)) for p, _ in r.phases]
        text += f"\n\nBy phase ({r.label}):\n\n" + markdown_table(prow, COLUMNS).replace("| target |", "| phase |", 1)
    if note:
        text += "\n\n" + note
    return text


# -- command line ----------------------------------------------------------------------------------------------

def build_workload(args: argparse.Namespace) -> wl.Workload:
    w, seed, mt = args.workload, args.seed, args.max_tokens
    if w == "multi-turn":
        work = wl.multi_turn(args.conversations, args.turns, mt, seed)
    elif w == "shared-system":
        work = wl.shared_system(args.requests, args.prompt_words, mt, seed)
    elif w == "rag":
        work = wl.rag(args.documents, args.questions, args.prompt_words, mt, seed)
    elif w == "low-reuse":
        work = wl.low_reuse(args.requests, args.prompt_words, mt, seed)
    elif w == "hot-switch":
        work = wl.hot_switch(args.documents, args.questions, args.prompt_words, mt, seed)
    else:
        path = Path(args.trace or DEFAULT_TRACE)
        if not path.exists():
            raise SystemExit(f"kvmesh bench serve: no trace at {path}; pass --trace FILE")
        work = wl.trace(path, args.token_scale, args.time_scale, args.max_requests, mt)
    if args.rate is not None:
        work = wl.with_poisson_arrivals(work, args.rate, seed)
    return work


def _elide_note(argv: list[str]) -> list[str]:
    """The command line for the doc, without the note's text (it is printed under the table)."""
    out, skip = [], False
    for a in argv:
        if skip:
            out.append("(below)")
        elif a.startswith("--note="):
            out.append("--note=(below)")
        else:
            out.append(a)
        skip = a == "--note"
    return out


def parse_targets(values: list[str]) -> list[tuple[str, str]]:
    """``URL`` or ``NAME=URL`` → (name, url)."""
    out = []
    for v in values:
        name, sep, url = v.partition("=")
        out.append((name, url) if sep and not name.startswith("http") else (v, v))
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmesh bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", action="append", required=True,
                   help="URL of an OpenAI-compatible server (NAME=URL to label it); repeat to compare")
    p.add_argument("--workload", choices=wl.WORKLOADS, default="multi-turn")
    p.add_argument("--conversations", type=int, default=8, help="multi-turn: conversations")
    p.add_argument("--turns", type=int, default=3, help="multi-turn: turns per conversation")
    p.add_argument("--requests", type=int, default=16, help="shared-system, low-reuse: requests")
    p.add_argument("--documents", type=int, default=2, help="rag, hot-switch: documents (per set)")
    p.add_argument("--questions", type=int, default=4, help="rag, hot-switch: questions per document")
    p.add_argument("--prompt-words", type=int, default=200, help="words of the system prompt / document")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (trace: the cap)")
    p.add_argument("--trace", help=f"Mooncake trace (default {DEFAULT_TRACE.name} in shared/data/traces)")
    p.add_argument("--token-scale", type=float, default=0.02, help="trace: multiply lengths")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace: multiply arrival times")
    p.add_argument("--max-requests", type=int, default=32, help="trace: first N requests")
    p.add_argument("--concurrency", type=int, default=4, help="closed loop: conversations in flight")
    p.add_argument("--rate", type=float, help="open loop: Poisson arrivals, conversations per second")
    p.add_argument("--seed", type=int, default=0, help="workload seed (and the sampling seed sent)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="SLO: TTFT seconds")
    p.add_argument("--slo-itl", type=float, default=0.2, help="SLO: mean inter-token seconds of a request")
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--max-duration", type=float, default=600.0, help="per target, seconds")
    p.add_argument("--out", help="output directory (default bench-out/serve-<time>)")
    p.add_argument("--doc", metavar="SECTION", help="also write the table into docs/benchmarks.md")
    p.add_argument("--note", default="", help="a sentence to add under the table (e.g. what differs)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        work = build_workload(args)
    except ValueError as e:
        print(f"kvmesh bench serve: {e}", file=sys.stderr)
        return 2
    slo = SLO(args.slo_ttft, args.slo_itl)
    opts = RunOptions(model=args.model, concurrency=args.concurrency, temperature=args.temperature,
                      seed=args.seed, timeout_s=args.timeout, max_duration_s=args.max_duration,
                      api_key=args.api_key, slo=slo)
    results = []
    for name, url in parse_targets(args.target):
        try:
            results.append(asyncio.run(run_workload(url, work, opts, name, progress=not args.quiet)))
        except (aiohttp.ClientError, OSError, KeyError, IndexError, ValueError) as e:
            print(f"kvmesh bench serve: {name}: cannot reach an OpenAI-compatible server at {url}: {e}",
                  file=sys.stderr)
            return 1
    mode = (f"open loop, Poisson {args.rate:g} conversations/s" if args.rate is not None
            else "trace arrivals" if args.workload == "trace" else f"closed loop, concurrency {args.concurrency}")
    settings = {"workload": work.name, "requests": work.num_requests, "mode": mode, "max_tokens": args.max_tokens,
                "temperature": args.temperature, "seed": args.seed, "argv": sys.argv[1:] if argv is None else argv}
    out = Path(args.out or f"bench-out/serve-{time.strftime('%Y%m%d-%H%M%S')}")
    written = write_outputs(out, results, slo, settings, args.note)
    print(terminal_table([table_row(r.label, r.summary(slo)) for r in results], COLUMNS))
    print(f"\nwritten: {written['json']}, {written['markdown']}"
          + "".join(f", {p}" for p in written["png"]))
    if args.doc:
        command = "kvmesh bench serve " + shlex.join(_elide_note(settings["argv"]))
        doc = write_section(args.doc, command, summary_markdown(results, slo, settings, args.note))
        print(f"written to {doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
