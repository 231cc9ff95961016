"""A session's KV through a tool pause on a vLLM instance: ``kvmesh bench vllm --sessions``.

    kvmesh bench vllm --sessions [--rounds 3] [--context 1200] [--others 4] [--new 64] [--pause-s 60]
                                 [--no-write] [--workdir DIR]

One stack, ``kvmesh up --engine-backend vllm --prefill 0 --decode 0 --both 1`` (the default model, fp32, 1 thread),
whose vLLM cache holds less than two contexts and whose pool (cachesvc's DRAM tier, eviction ``session``) about
two. Each round runs two arms, in alternating order, each with token-id prompts of its own:

1. turn 1: a ``--context``-token prompt, 8 tokens greedy;
2. other traffic: ``--others`` prompts of the same length, no session, 1 token each: they push the context out of
   vLLM's prefix cache, and their write-backs fill the pool;
3. turn 2: the context, turn 1's answer and ``--new`` more tokens, 8 tokens greedy.

"with signals": both turns carry a ``session_id``, turn 1 announces a pause (``session_pause_s``: a tool call of
about that long follows) and turn 2 ends the session; "without": none of it. The stack and its settings are the
same, so the difference is what the client says: with the pause heard, the pool keeps the paused session's
blocks and lets the others' go; without, its LRU ranks the context as the least recent. Reported per arm (medians
over the rounds): turn 2's TTFT at the client (gRPC stream), its ``cached_tokens`` over turn 1's context, and the
bytes the instance fetched from the pool for it (``kvmesh_worker_kv_transfer_bytes_total{direction="pool_fetch"}``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from app.bench.report import load_average, markdown_table, publish
from app.bench.vllm_servers import POOL_FETCH, EngineShape, instance_metric, kvmesh_stack

if TYPE_CHECKING:
    from kvmesh.client import KvmeshClient

SECTION = "Sessions on vLLM instances: a paused session's KV from the pool"
VOCAB = 49152  # SmolLM2's
ANSWER_TOKENS = 8
# vLLM's cache: 17 blocks of 128 tokens (2,176 tokens, under two contexts of 1,200); the pool: 128 MB, about two
# such contexts at 46,080 bytes a token (SmolLM2-135M's fp32 KV: 30 layers x 3 heads x 64 x K and V)
SHAPE = EngineShape(vllm_blocks=17, max_model_len=2048)
POOL_MB = 128


@dataclass
class Turn:
    ttft_s: float
    cached: int
    prompt: int
    fetched: float  # bytes from the pool


@dataclass
class Arm:
    name: str
    signals: bool
    resumed: list[Turn]
    context: int

    def median(self, f) -> float:
        return statistics.median(f(t) for t in self.resumed)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, VOCAB - 100) for _ in range(n)]


def one_arm(client: KvmeshClient, metrics_url: str, rng: random.Random, signals: bool, context_len: int,
            others: int, new: int, pause_s: float, settle_s: float) -> Turn:
    context = tokens(rng, context_len)
    session = {"session_id": f"bench-{uuid.uuid4().hex[:12]}"} if signals else {}
    first = client.complete(context, max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True, **session,
                            **({"session_pause_s": pause_s} if signals else {}))
    time.sleep(settle_s)  # the write-back and the pause signal travel in the background
    for _ in range(others):
        client.complete(tokens(rng, context_len), max_tokens=1, temperature=0)
    time.sleep(settle_s)
    prompt = context + list(first.token_ids) + tokens(rng, new)
    before = instance_metric(metrics_url, *POOL_FETCH)
    second = client.complete(prompt, max_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True, **session,
                             **({"session_end": True} if signals else {}))
    fetched = instance_metric(metrics_url, *POOL_FETCH) - before
    assert second.ttft_s is not None and second.usage is not None
    return Turn(second.ttft_s, second.usage.cached_tokens, len(prompt), fetched)


def run(args: argparse.Namespace, workdir: Path) -> list[Arm]:
    from kvmesh.client import KvmeshClient

    stack = kvmesh_stack(workdir, "bench-vllm-sessions", SHAPE, both=1, pool=True,
                         cachesvc={"pool_capacity_mb": POOL_MB, "pool_eviction": "session"})
    arms = [Arm("with signals", True, [], args.context), Arm("without", False, [], args.context)]
    try:
        metrics = next(s.endpoints["metrics"] for s in stack.services if s.name.startswith("both"))
        with KvmeshClient(stack.router_grpc, timeout_s=300) as client:
            client.complete(tokens(random.Random(-1), 64), max_tokens=2, temperature=0)  # warm-up
            for r in range(args.rounds):
                for arm in (arms if r % 2 == 0 else arms[::-1]):
                    rng = random.Random(f"{args.seed}-{r}-{arm.name}")
                    turn = one_arm(client, metrics, rng, arm.signals, args.context, args.others, args.new,
                                   args.pause_s, args.settle_s)
                    arm.resumed.append(turn)
                    print(f"round {r + 1} {arm.name}: TTFT {turn.ttft_s * 1e3:.0f} ms, cached {turn.cached} of "
                          f"{turn.prompt} prompt tokens, pool fetch {turn.fetched / 1e6:.1f} MB", flush=True)
    finally:
        stack.stop()
    return arms


def report(arms: list[Arm], args: argparse.Namespace) -> str:
    with_, without = arms
    rows = [{"arm": a.name, "resumed turns": len(a.resumed),
             "TTFT p50 ms": f"{a.median(lambda t: t.ttft_s) * 1e3:.0f}",
             "cached / context": f"{a.median(lambda t: t.cached) / a.context:.0%}",
             "cached / prompt tokens": f"{a.median(lambda t: t.cached):.0f} / {a.median(lambda t: t.prompt):.0f}",
             "pool fetch MB": f"{a.median(lambda t: t.fetched) / 1e6:.1f}"} for a in arms]
    ratio = with_.median(lambda t: t.ttft_s) / without.median(lambda t: t.ttft_s)
    cover = with_.median(lambda t: t.cached) / with_.context
    per_round = ", ".join(f"{w.ttft_s / o.ttft_s:.2f}x" for w, o in zip(with_.resumed, without.resumed))
    setup = (f"One vLLM instance (`--engine-backend vllm --both 1`, SmolLM2-135M fp32, 1 thread; vLLM's cache "
             f"{SHAPE.vllm_blocks} blocks of {SHAPE.block_size} tokens), cachesvc's pool {POOL_MB} MB with eviction "
             f"`session`. Each round: turn 1 ({args.context} tokens), {args.others} other prompts of "
             f"{args.context} tokens (no session), turn 2 (turn 1's prompt and answer, {args.new} new tokens); "
             f"{args.rounds} rounds, the arms alternating. With signals: `session_id` on both turns, "
             f"`session_pause_s` {args.pause_s:g} on turn 1, `session_end` on turn 2. Medians of turn 2:")
    ttft = (f"- turn 2's TTFT with signals / without: **{ratio:.2f}x** (per round {per_round}; target <= 0.5x: "
            f"{'met' if ratio <= 0.5 else 'not met'})")
    cached = (f"- turn 2's cached tokens with signals over turn 1's context: **{cover:.0%}** (target >= 90%: "
              f"{'met' if cover >= 0.9 else 'not met'})")
    return "\n".join([setup, "", markdown_table(rows, list(rows[0])), "", ttft, cached, "",
                      f"Load average (1, 5, 15 min) at the end: {load_average()}."])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench vllm --sessions", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=1200, help="turn 1's prompt tokens")
    p.add_argument("--others", type=int, default=4, help="other prompts between the turns")
    p.add_argument("--new", type=int, default=64, help="turn 2's new tokens")
    p.add_argument("--pause-s", type=float, default=60.0, help="the pause turn 1 announces (with signals)")
    p.add_argument("--settle-s", type=float, default=1.5, help="wait after turn 1 and after the others")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--workdir", type=Path, help="the stack's state directory (default: a temporary one)")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md as it is")
    args = p.parse_args(argv)
    if args.context + ANSWER_TOKENS + args.new > SHAPE.max_model_len:
        p.error(f"--context + {ANSWER_TOKENS} + --new must fit max_model_len {SHAPE.max_model_len}")
    if args.workdir:
        arms = run(args, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="kvmesh-bench-vllm-sessions-") as d:
            arms = run(args, Path(d))
    command = "kvmesh bench vllm --sessions" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in (("rounds", args.rounds), ("context", args.context),
                                                   ("others", args.others)) if v != p.get_default(k))
    publish(SECTION, command, report(arms, args), write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
