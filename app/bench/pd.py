"""PD vs role both on the same workloads, in one run: a cold long prompt and a multi-turn chat, token-id prompts,
greedy, ``ignore_eos``; TTFT at an HTTP client streaming from the router, and from the span file per request:
bytes pushed (``kv.push``'s ``kvmesh.bytes``), decode's import (``decode.load``), the route taken.

Part of ``kvmesh bench mesh`` (``--pd``); also ``python -m app.bench.pd``."""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.telemetry.spans import read_spans, trace_file

from app.launcher import Stack, StackOptions

VOCAB = 49152  # SmolLM2's


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB - 100) for _ in range(n)]


def completion_ttft(url: str, prompt: list[int], max_tokens: int, headers: dict[str, str] | None = None,
                    cache_salt: str = "") -> tuple[float, list[str], str]:
    """(TTFT s, output text pieces, request id) of one streamed token-id completion from the router at ``url``."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "logprobs": None, **({"cache_salt": cache_salt} if cache_salt else {})}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"content-type": "application/json", **(headers or {})})
    t0 = time.perf_counter()
    ttft, text = None, []
    try:
        r = urllib.request.urlopen(req, timeout=300)
    except urllib.error.HTTPError as e:  # what the router said, not only its status
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None
    with r:
        rid = r.headers.get("x-request-id", "")
        for line in r:
            if line.startswith(b"data: {"):
                ttft = ttft or time.perf_counter() - t0
                doc = json.loads(line[6:])
                text.append(doc["choices"][0].get("text", ""))
    return ttft or time.perf_counter() - t0, text, rid


@dataclass
class Request:
    ttft: float
    request_id: str
    tokens: int
    text: str = ""


@dataclass
class Result:
    setup: str
    cold: list[Request] = field(default_factory=list)         # one cold prompt per repeat
    chats: list[list[Request]] = field(default_factory=list)  # one chat per repeat, turn by turn
    spans: dict[str, dict] = field(default_factory=dict)      # request id -> figures from its spans

    @property
    def outputs(self) -> list[str]:
        return [t.text for chat in self.chats for t in chat]


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


Setup = tuple[StackOptions, dict[str, str] | None]  # a stack, and the headers each of its requests carries
FORCED_PD = {"x-kvmesh-disaggregate": "always"}

# pd auto / pd always push in layer groups (instance.push_layer_groups, its default); "chunk parts" pushes whole
# blocks after each chunk (push_layer_groups 1), what the layer groups are measured against in the same run
SETUPS: dict[str, Setup] = {
    "both": (StackOptions.local("pdb", prefill=0, decode=0, both=1), None),
    "pd auto": (StackOptions.local("pdp"), None),
    "pd always": (StackOptions.local("pda"), FORCED_PD),
    "pd always, chunk parts": (StackOptions.local("pdc", settings={"instance": {"push_layer_groups": 1}}),
                               FORCED_PD),
}

# --tls-compare: role both and forced PD with the mesh's mutual TLS (kvmesh up's default: gRPC, NATS and the KV
# push all TLS 1.3) and without it ([shared] mesh_tls = false: plaintext inside the mesh)
MTLS_OFF = ", mTLS off"
PLAINTEXT = {"shared": {"mesh_tls": False}}
TLS_SETUPS: dict[str, Setup] = {
    "both": SETUPS["both"],
    "both" + MTLS_OFF: (StackOptions.local("pdbx", prefill=0, decode=0, both=1, settings=PLAINTEXT), None),
    "pd always": SETUPS["pd always"],
    "pd always" + MTLS_OFF: (StackOptions.local("pdax", settings=PLAINTEXT), FORCED_PD),
}


# --backend vllm: the same setups with vLLM engines (kvmesh/vllm), KV for 4,224 tokens each (8 GiB would not fit
# seven instances here), one thread each
VLLM_ENGINE = {"backend": "vllm", "num_blocks": 264, "max_model_len": 2048, "threads": 1}


def with_backend(opts: StackOptions, backend: str = "native") -> StackOptions:
    """``opts`` with the engines of ``backend``."""
    if backend == "native":
        return opts
    settings = {**opts.settings, "engine": {**opts.settings.get("engine", {}), **VLLM_ENGINE}}
    return dataclasses.replace(opts, settings=settings)


Step = tuple[int, int, list[int]]  # (repeat, turn (0 = the cold prompt), prompt)


def request_order(plan: list[Step], names: list[str], back_to_back: bool = False) -> list[tuple[str, Step]]:
    """Which stack gets which request, in the order sent: each request to every stack in turn, the order rotating
    request by request; ``back_to_back``: per repeat the cold prompts so, then each stack's whole chat in a row."""
    order = [(name, step) for i, step in enumerate(plan) for name in names[i % len(names):] + names[:i % len(names)]]
    if back_to_back:
        order.sort(key=lambda x: (x[1][0], x[1][1] > 0, names.index(x[0]) if x[1][1] else 0))
    return order


def run(setups: dict[str, Setup] = SETUPS, turns: int = 10, repeats: int = 3, first: int = 95, per_turn: int = 107,
        cold_tokens: int = 1500, max_tokens: int = 16, seed: int = 0, backend: str = "native",
        back_to_back: bool = False) -> dict[str, Result]:
    """Every setup's stack up at once, the same requests sent to each in turn (the order rotating request by
    request), so that all of them run under the same machine load; one request in flight at a time. Each
    repeat has its own cold prompt and its own chat (fresh tokens: nothing is reused across repeats).
    ``backend``: the engines' (native, vllm). ``back_to_back``: each stack gets a chat's turns one right after the
    other (the cold prompts still rotate), so a turn arrives as soon as the one before it ended there."""
    names = list(setups)
    rng = random.Random(seed)
    plan: list[Step] = []
    for rep in range(repeats):
        plan.append((rep, 0, _ids(rng, cold_tokens)))
        prompt = _ids(rng, first)
        for turn in range(1, turns + 1):
            plan.append((rep, turn, prompt))
            # the reply's tokens are not returned as ids over SSE: the next turn re-sends a stand-in of the
            # same length (decode's and prefill's caches hold the prompt; the reply's blocks differ)
            prompt = prompt + _ids(rng, per_turn)
    res = {name: Result(name, chats=[[] for _ in range(repeats)]) for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        stacks: dict[str, Stack] = {}
        try:
            for name in names:
                stacks[name] = Stack(_state_dir(Path(tmp), name), with_backend(setups[name][0], backend))
                stacks[name].start(timeout_s=300)
                completion_ttft(stacks[name].router_http, _ids(random.Random(99), 40), 4, setups[name][1])  # warm
            for name, (rep, turn, prompt) in request_order(plan, names, back_to_back):
                ttft, text, rid = completion_ttft(stacks[name].router_http, prompt, max_tokens, setups[name][1])
                req = Request(ttft, rid, len(prompt), "".join(text))
                (res[name].chats[rep].append(req) if turn else res[name].cold.append(req))
        finally:
            for stack in stacks.values():
                stack.stop()
        time.sleep(0.5)
        for name, r in res.items():
            spans = read_spans(trace_file(_state_dir(Path(tmp), name)))
            r.spans = {q.request_id: _figures(spans, q.request_id)
                       for q in [*r.cold, *(t for chat in r.chats for t in chat)]}
    return res


def _state_dir(tmp: Path, name: str) -> Path:
    return tmp / name.replace(" ", "-").replace(",", "")


BLOCK_NBYTES = 737_280  # SmolLM2-135M fp32, 16-token blocks
BLOCK = 16


def _critical(pushes: list[dict]) -> str:
    """What of the push remained after the prefill compute, in ms and as a share of the push time (medians)."""
    pushes = [sp for sp in pushes if sp["push_ms"]]
    if not pushes:
        return "-"
    share = _spread([sp["critical_ms"] / sp["push_ms"] * 100 for sp in pushes], "{:.0f}", "%")
    return (f"{statistics.median(sp['critical_ms'] for sp in pushes):.1f} of "
            f"{statistics.median(sp['push_ms'] for sp in pushes):.1f} ms = {share} "
            f"({statistics.median(sp['parts'] for sp in pushes):.0f} parts)")


def _spread(xs: list[float], fmt: str = "{:.2f}", unit: str = "") -> str:
    """The median, and the range when there is more than one value."""
    mid = fmt.format(statistics.median(xs)) + unit
    return mid if len(xs) == 1 else f"{mid} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def report(res: dict[str, Result]) -> str:
    """The markdown body: the summary against role both (medians over the repeats, of paired ratios for the
    comparisons: each repeat's PD figure against the same repeat's role both, sent right next to it), then the
    first repeat's chat turn by turn."""
    from app.bench.report import markdown_table

    ref = res["both"]
    rows = []
    for name, r in res.items():
        sums = [sum(t.ttft for t in chat) for chat in r.chats]
        ref_sums = [sum(t.ttft for t in chat) for chat in ref.chats]
        cold = [r.spans[q.request_id] for q in r.cold]
        rows.append({"setup": name, "cold 1,500-token TTFT s": _spread([q.ttft for q in r.cold]),
                     "cold vs both": _spread([q.ttft / b.ttft for q, b in zip(r.cold, ref.cold)], unit="x"),
                     f"{len(r.chats[0])}-turn chat TTFT sum s": _spread(sums),
                     "chat vs both": _spread([a / b for a, b in zip(sums, ref_sums)], unit="x"),
                     "cold push MiB": f"{statistics.median(sp['push_bytes'] for sp in cold) / 2**20:.1f}",
                     "cold import ms": _spread([sp["import_ms"] for sp in cold], "{:.1f}"),
                     "cold push after compute": _critical(cold),
                     "chat push after compute": _critical([r.spans[t.request_id] for chat in r.chats for t in chat]),
                     "greedy text = both": r.outputs == ref.outputs})
    turns = []
    for i, q in enumerate(ref.chats[0]):
        row = {"turn": i + 1, "prompt tokens": q.tokens}
        for name, r in res.items():
            t = r.chats[0][i]
            sp = r.spans[t.request_id]
            row[f"{name} TTFT ms"] = f"{t.ttft * 1e3:.0f}" + (f" ({sp['route']})" if sp["route"] else "")
            if sp["push_bytes"]:
                lacked = q.tokens - sp["decode_held"] * BLOCK
                row[f"{name} pushed KiB"] = (f"{sp['push_bytes'] / 1024:.0f} = "
                                            f"{sp['push_bytes'] / (lacked * BLOCK_NBYTES / BLOCK):.2f}x KV lacked "
                                            f"({sp['decode_held']} blocks held)")
                row[f"{name} import ms"] = f"{sp['import_ms']:.1f}"
        turns.append(row)
    cols = ["turn", "prompt tokens"] + [c for c in turns[0] if c not in ("turn", "prompt tokens")]
    return (markdown_table(rows, list(rows[0])) + f"\n\nMedians over {len(ref.cold)} repeats (range in brackets). "
            "Per turn, first repeat (route in brackets; pushed bytes from the kv.push spans, against the KV of the "
            "prompt tokens decode lacked):\n\n" + markdown_table(turns, cols))


def _handoff_gbps(sp: dict) -> float:
    """GB/s of one request's KV push: its bytes over the parts' own push times added up."""
    return sp["push_bytes"] / sp["push_ms"] / 1e6


def tls_report(res: dict[str, Result]) -> str:
    """The markdown body of ``--tls-compare``: each setup with the mesh's mTLS on against its twin with it off
    (``<setup>, mTLS off``), medians over the repeats of the paired ratios (each request against the same request
    sent to the twin right next to it)."""
    from app.bench.report import markdown_table

    rows = []
    for name, on in res.items():
        off = res.get(name + MTLS_OFF)
        if off is None:
            continue
        on_sums = [sum(t.ttft for t in chat) for chat in on.chats]
        off_sums = [sum(t.ttft for t in chat) for chat in off.chats]
        every = [a.ttft / b.ttft for a, b in zip([*on.cold, *(t for c in on.chats for t in c)],
                                                [*off.cold, *(t for c in off.chats for t in c)], strict=True)]
        row = {"setup": name,
               "cold TTFT s, on / off": f"{statistics.median(q.ttft for q in on.cold):.2f} / "
                                        f"{statistics.median(q.ttft for q in off.cold):.2f}",
               "cold on / off": _spread([a.ttft / b.ttft for a, b in zip(on.cold, off.cold)], unit="x"),
               f"{len(on.chats[0])}-turn chat TTFT sum s, on / off": f"{statistics.median(on_sums):.2f} / "
                                                                     f"{statistics.median(off_sums):.2f}",
               "chat on / off": _spread([a / b for a, b in zip(on_sums, off_sums)], unit="x"),
               "every request on / off": _spread(every, unit="x")}
        cold_on = [on.spans[q.request_id] for q in on.cold]
        cold_off = [off.spans[q.request_id] for q in off.cold]
        if all(sp["push_ms"] for sp in [*cold_on, *cold_off]):
            row["cold hand-off GB/s, on / off"] = (f"{statistics.median(map(_handoff_gbps, cold_on)):.2f} / "
                                                   f"{statistics.median(map(_handoff_gbps, cold_off)):.2f}")
            row["hand-off on / off"] = _spread([_handoff_gbps(a) / _handoff_gbps(b)
                                                for a, b in zip(cold_on, cold_off)], unit="x")
            row["cold push after compute ms, on / off"] = (
                f"{statistics.median(sp['critical_ms'] for sp in cold_on):.1f} / "
                f"{statistics.median(sp['critical_ms'] for sp in cold_off):.1f}")
        rows.append(row | {"greedy text on = off": on.outputs == off.outputs})
    columns = list(max(rows, key=len))
    return (markdown_table(rows, columns) + f"\n\nMedians over {len(next(iter(res.values())).cold)} repeats "
            "(range in brackets); `every request`: the cold prompts and every chat turn, each against the same "
            "request to the twin stack.")


def main() -> None:
    res = run()
    for r in res.values():
        print(r.setup, "cold", [round(q.ttft, 3) for q in r.cold],
              "chat sums", [round(sum(t.ttft for t in chat), 3) for chat in r.chats])
        for q in [*r.cold, *r.chats[0]]:
            print("  ", q.tokens, round(q.ttft * 1e3), r.spans[q.request_id])
    ref = res["both"].outputs
    print("same outputs:", {k: r.outputs == ref for k, r in res.items()})


if __name__ == "__main__":
    main()
