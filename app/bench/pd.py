"""PD vs role both on the same workloads, in one run: a cold long prompt and a multi-turn chat, token-id prompts,
greedy, ``ignore_eos``; TTFT at an HTTP client streaming from the router, and from the span file per request:
bytes pushed (``kv.push``'s ``kvmesh.bytes``), decode's import (``decode.load``), the route taken.

Part of ``kvmesh bench mesh`` (``--pd``); also ``python -m app.bench.pd``."""

from __future__ import annotations

import json
import random
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.telemetry.spans import read_spans, trace_file

from app.launcher import Stack, StackOptions

VOCAB = 49152  # SmolLM2's


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB - 100) for _ in range(n)]


def completion_ttft(port: int, prompt: list[int], max_tokens: int,
                    headers: dict[str, str] | None = None) -> tuple[float, list[int], str]:
    """(TTFT s, output token ids, request id) of one streamed token-id completion."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "logprobs": None}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"content-type": "application/json", **(headers or {})})
    t0 = time.perf_counter()
    ttft, text = None, []
    with urllib.request.urlopen(req, timeout=300) as r:
        rid = r.headers.get("x-request-id", "")
        for line in r:
            if line.startswith(b"data: {"):
                ttft = ttft or time.perf_counter() - t0
                doc = json.loads(line[6:])
                text.append(doc["choices"][0].get("text", ""))
    return ttft or time.perf_counter() - t0, text, rid


@dataclass
class Result:
    setup: str
    cold_ttft: float = 0.0
    turn_ttft: list[float] = field(default_factory=list)
    turn_tokens: list[int] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    cold_id: str = ""
    spans: dict[str, dict] = field(default_factory=dict)  # request id -> figures from its spans


def _figures(spans: list, rid: str) -> dict:
    """What one request's spans say: bytes pushed, the push's overlap with the compute, decode's import, route."""
    mine = [s for s in spans if s.request_id == rid]
    push = [s for s in mine if s.name == "kv.push"]
    load = [s for s in mine if s.name == "decode.load"]
    compute = [s for s in mine if s.name == "prefill.compute"]
    route = [s for s in mine if s.name == "router.route"]
    return {
        "push_bytes": sum(int(s.attributes.get("kvmesh.bytes", 0)) for s in push),
        "push_ms": sum(float(s.attributes.get("kvmesh.push_ms", s.duration_ns / 1e6)) for s in push),
        "critical_ms": sum(float(s.attributes.get("kvmesh.critical_ms", s.duration_ns / 1e6)) for s in push),
        "parts": sum(int(s.attributes.get("kvmesh.parts", 1)) for s in push),
        "push_blocks": sum(int(s.attributes.get("kvmesh.blocks", 0)) for s in push),
        "import_ms": sum(float(s.attributes.get("kvmesh.import_ms", 0)) for s in load),
        "load_ms": sum(s.duration_ns for s in load) / 1e6,
        "computed": sum(int(s.attributes.get("kvmesh.tokens.computed", 0)) for s in compute),
        "compute_ms": sum(s.duration_ns for s in compute) / 1e6,
        "route": next((str(s.attributes.get("kvmesh.route.path", "")) for s in route), ""),
        "reason": next((str(s.attributes.get("kvmesh.route.reason", "")) for s in route), ""),
        "decode_held": max((int(s.attributes.get("kvmesh.decode_cached_blocks", 0)) for s in push), default=0),
    }


SETUPS = {
    "both": (StackOptions.local("pdb", prefill=0, decode=0, both=1), None),
    "pd auto": (StackOptions.local("pdp"), None),
    "pd always": (StackOptions.local("pda"), {"x-kvmesh-disaggregate": "always"}),
}


def run(setups: list[str] | None = None, turns: int = 10, first: int = 95, per_turn: int = 107,
        cold_tokens: int = 1500, max_tokens: int = 16, seed: int = 0) -> dict[str, Result]:
    """Every setup's stack up at once, the same requests sent to each in turn (the order rotating request by
    request), so that all of them run under the same machine load; one request in flight at a time."""
    names = [n for n in SETUPS if setups is None or n in setups]
    rng = random.Random(seed)
    cold = _ids(rng, cold_tokens)
    chat = [_ids(rng, first)]
    for _ in range(turns - 1):
        # the reply's tokens are not returned as ids over SSE: the next turn re-sends a stand-in of the same
        # length (decode's and prefill's caches hold the prompt; the reply's blocks differ)
        chat.append(chat[-1] + _ids(rng, per_turn))
    res = {name: Result(name) for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        stacks: dict[str, Stack] = {}
        try:
            for name in names:
                stacks[name] = Stack(Path(tmp) / name.replace(" ", "-"), SETUPS[name][0])
                stacks[name].start(timeout_s=300)
                completion_ttft(stacks[name].http_port, _ids(random.Random(99), 40), 4, SETUPS[name][1])  # warm
            for i, prompt in enumerate([cold, *chat]):
                for name in names[i % len(names):] + names[:i % len(names)]:
                    ttft, text, rid = completion_ttft(stacks[name].http_port, prompt, max_tokens, SETUPS[name][1])
                    r = res[name]
                    if i == 0:
                        r.cold_ttft, r.cold_id = ttft, rid
                    else:
                        r.turn_ttft.append(ttft)
                        r.turn_tokens.append(len(prompt))
                        r.outputs.append("".join(text))
                        r.request_ids.append(rid)
        finally:
            for stack in stacks.values():
                stack.stop()
        time.sleep(0.5)
        for name, r in res.items():
            spans = read_spans(trace_file(Path(tmp) / name.replace(" ", "-")))
            r.spans = {rid: _figures(spans, rid) for rid in [r.cold_id, *r.request_ids]}
    return res


BLOCK_NBYTES = 737_280  # SmolLM2-135M fp32, 16-token blocks
BLOCK = 16


def _critical(sp: dict) -> str:
    """What of the push remained after the prefill compute, in ms and as a share of the push time."""
    if not sp["push_ms"]:
        return "-"
    return (f"{sp['critical_ms']:.1f} of {sp['push_ms']:.1f} ms = {sp['critical_ms'] / sp['push_ms']:.0%} "
            f"({sp['parts']} parts)")


def report(res: dict[str, Result]) -> str:
    """The markdown body: the summary against role both, then turn by turn."""
    from app.bench.report import markdown_table

    ref = res["both"]
    rows = []
    for name, r in res.items():
        rows.append({"setup": name, "cold 1,500-token TTFT s": f"{r.cold_ttft:.2f}",
                     "vs both": f"{r.cold_ttft / ref.cold_ttft:.2f}x",
                     f"{len(r.turn_ttft)}-turn chat TTFT sum s": f"{sum(r.turn_ttft):.2f}",
                     "chat vs both": f"{sum(r.turn_ttft) / sum(ref.turn_ttft):.2f}x",
                     "cold push MiB": f"{r.spans[r.cold_id]['push_bytes'] / 2**20:.1f}",
                     "cold import ms": f"{r.spans[r.cold_id]['import_ms']:.1f}",
                     "cold push after compute": _critical(r.spans[r.cold_id]),
                     "greedy text = both": r.outputs == ref.outputs})
    turns = []
    for i, n in enumerate(ref.turn_tokens):
        row = {"turn": i + 1, "prompt tokens": n}
        for name, r in res.items():
            sp = r.spans[r.request_ids[i]]
            row[f"{name} TTFT ms"] = f"{r.turn_ttft[i] * 1e3:.0f}" + (f" ({sp['route']})" if sp["route"] else "")
            if sp["push_bytes"]:
                lacked = n - sp["decode_held"] * BLOCK
                row[f"{name} pushed KiB"] = (f"{sp['push_bytes'] / 1024:.0f} = {sp['push_bytes'] / (lacked * BLOCK_NBYTES / BLOCK):.2f}"
                                            f"x KV lacked ({sp['decode_held']} blocks held)")
                row[f"{name} import ms"] = f"{sp['import_ms']:.1f}"
        turns.append(row)
    cols = ["turn", "prompt tokens"] + [c for c in turns[0] if c not in ("turn", "prompt tokens")]
    return (markdown_table(rows, list(rows[0])) + "\n\nPer turn (route in brackets; pushed bytes from the kv.push "
            "spans, against the KV of the prompt tokens decode lacked):\n\n" + markdown_table(turns, cols))


def main() -> None:
    res = run()
    for r in res.values():
        print(r.setup, "cold", round(r.cold_ttft, 3), "chat sum", round(sum(r.turn_ttft), 3))
        for rid, t, n in zip(r.request_ids, r.turn_ttft, r.turn_tokens):
            print("  ", n, round(t * 1e3), r.spans[rid])
        print("  cold", r.spans[r.cold_id])
    ref = res["both"].outputs
    print("same outputs:", {k: r.outputs == ref for k, r in res.items()})


if __name__ == "__main__":
    main()
