"""The PD hand-off over a link between hosts, next to loopback: ``kvmesh bench link``.

    kvmesh bench link [--tokens 1000] [--repeats 3] [--cap-mbit 1000,200] [--delay-ms 2] [--no-write]

The same cold prompts (token ids, greedy, forced PD: ``x-kvmesh-disaggregate: always``, a fresh cache salt each, so
prefill computes and pushes the whole prompt) on three placements of 1 prefill + 1 decode, one after the other:
``kvmesh up`` on loopback; the services in network namespaces, one per host, over veth links (``app/netlab``); and
the same with decode's link capped (tc tbf, each of ``--cap-mbit`` each way, one placement per cap) and lengthened
(``--delay-ms`` each way by a delay proxy, as netem is missing here). From the client: TTFT; from the span file, per
request: prefill's compute, the push (``kv.push``: first part to last, overlapping the compute), what of it was left
after the compute (its ``kvmesh.critical_ms``: what the hand-off adds to TTFT) and the bytes. Needs root for the
namespaces.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.telemetry.spans import read_spans, trace_file

from app.bench.pd import _figures, _ids, completion_ttft
from app.bench.report import load_average, markdown_table, write_section
from app.launcher import Stack, StackOptions
from app.netlab.hosts import Lab, unavailable
from app.netlab.mesh import HOSTS, NetnsMesh

SECTION = "PD hand-off across hosts"
PD = {"x-kvmesh-disaggregate": "always"}


@dataclass
class Placement:
    name: str
    link: str
    ttft_s: list[float] = field(default_factory=list)
    figures: list[dict] = field(default_factory=list)


def _stream(url: str, prompt: list[int], salt: str) -> tuple[float, str]:
    """(TTFT s, request id) of one streamed completion, 4 tokens, forced PD."""
    ttft, _, rid = completion_ttft(url, prompt, 4, PD, salt)
    return ttft, rid


def _measure(place: Placement, send, traces: Path, prompts: list[list[int]]) -> None:
    """A warm-up request, then each prompt; each request's figures from the span file."""
    send(prompts[0][:64], "warm-up")
    rids = []
    for i, prompt in enumerate(prompts):
        ttft, rid = send(prompt, f"{place.name}-{i}")
        place.ttft_s.append(ttft)
        rids.append(rid)
    deadline = time.monotonic() + 30
    while True:  # the spans of the last request reach the file a moment after its answer
        spans = read_spans(traces) if traces.exists() else []
        place.figures = [_figures(spans, rid) for rid in rids]
        if all(f["push_bytes"] for f in place.figures) or time.monotonic() > deadline:
            return
        time.sleep(0.5)


def run(tokens: int = 1000, repeats: int = 3, caps_mbit: tuple[float, ...] = (1000, 200),
        delay_ms: float = 2.0) -> list[Placement]:
    rng = random.Random(0)
    prompts = [_ids(rng, tokens) for _ in range(repeats)]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        loop = Placement("loopback", "127.0.0.1 (kvmesh up)")
        stack = Stack(Path(tmp) / "loopback", StackOptions.local("link"))
        stack.start(timeout_s=300)
        try:
            _measure(loop, lambda p, s: _stream(stack.router_http, p, s), trace_file(stack.state_dir), prompts)
        finally:
            stack.stop()
        out.append(loop)
        shaped = [(f"hosts, {cap:g} Mbit/s link", f"{cap:g} Mbit/s, +{delay_ms:g} ms, each way", cap, delay_ms)
                  for cap in caps_mbit]
        for name, link, cap, delay in [("hosts", "veth between namespaces", 0.0, 0.0), *shaped]:
            place = Placement(name, link)
            with Lab(HOSTS) as lab:
                if cap:
                    lab.cap("decode", cap)
                mesh = NetnsMesh(lab, Path(tmp) / f"hosts-{cap:g}", delay_ms=delay)
                mesh.start()
                try:
                    _measure(place, lambda p, s, m=mesh: m.lab.call("client", lambda: _stream(m.router_http, p, s)),
                             mesh.trace_file, prompts)
                finally:
                    mesh.stop()
            out.append(place)
    return out


def report(places: list[Placement], tokens: int, repeats: int, before: str, after: str) -> str:
    rows = []
    for p in places:
        f = p.figures
        push_ms = statistics.median(x["push_ms"] for x in f)
        mb = statistics.median(x["push_bytes"] for x in f) / 1e6
        rows.append({"placement": p.name, "link": p.link,
                     "TTFT p50 ms": f"{statistics.median(p.ttft_s) * 1e3:.0f}",
                     "prefill compute ms": f"{statistics.median(x['compute_ms'] for x in f):.0f}",
                     "kv.push ms": f"{push_ms:.0f}",
                     "push left after the compute ms": f"{statistics.median(x['critical_ms'] for x in f):.0f}",
                     "MB pushed": f"{mb:.1f}", "push MB/s": f"{mb / (push_ms / 1e3):.0f}" if push_ms else "-"})
    return (f"1 prefill + 1 decode (the real model, 1 thread each), one cold {tokens}-token prompt at a time, "
            f"{repeats} of them (fresh token ids and cache salt each: prefill computes and pushes every block; "
            f"forced PD), after one warm-up request; medians. `kv.push` runs from the first part to the last, "
            f"layer groups on their way while later layers compute; what of it is left after the compute is what "
            f"the hand-off adds to TTFT. Placements one after the other; load average (1, 5, 15 min) {before} at "
            f"the start, {after} at the end (the machine is shared).\n\n"
            + markdown_table(rows, list(rows[0])))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench link", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cap-mbit", default="1000,200", help="the shaped links' rates, Mbit/s (comma-separated)")
    p.add_argument("--delay-ms", type=float, default=2.0)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"kvmesh bench link: {why}")
        return 2
    try:
        caps = tuple(float(c) for c in args.cap_mbit.split(",") if c.strip())
    except ValueError:
        p.error(f"--cap-mbit: Mbit/s rates, comma-separated, not {args.cap_mbit!r}")
    before = load_average()
    places = run(args.tokens, args.repeats, caps, args.delay_ms)
    body = report(places, args.tokens, args.repeats, before, load_average())
    print(body)
    if not args.no_write:
        command = (f"kvmesh bench link --tokens {args.tokens} --repeats {args.repeats} "
                   f"--cap-mbit {','.join(f'{c:g}' for c in caps)} --delay-ms {args.delay_ms:g}")
        print(f"\nwritten to {write_section(SECTION, command, body)}")
    return 0
