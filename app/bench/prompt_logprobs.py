"""Prompt-logprobs benchmark: what scoring a prompt (``SamplingParams.prompt_logprobs``; a completion's ``echo`` with
``logprobs``) costs the engine.

    kvmesh bench prompt-logprobs [--threads 1] [--lengths 128,512,2048] [--rounds 3] [--no-write]

For each prompt length, the time to the first token of one prompt on the default model: computed cold without
scoring (the baseline), scored with ``prompt_logprobs`` 0 (each token's own logprob and rank) and 5, and served warm
without scoring (its whole prefix cached: what a scored prompt gives up, since it is always computed whole). Rounds
alternate the four and the smallest of each is kept (a shared machine). Ratios are against the cold baseline of
the same round set; the scored prompt's extra work is the lm_head over every prompt row (in slices of
``llm_engine.PROMPT_LOGPROB_ROWS``) and a log-softmax, rank and top-k per row.
"""

from __future__ import annotations

import argparse
import random
import time

from kvmesh.contracts.engine import EngineRequest
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.llm_engine import PROMPT_LOGPROB_ROWS, LLMEngine
from kvmesh.settings import EngineSettings

from app.bench.report import markdown_table, publish

SECTION = "Scoring a prompt: prompt logprobs vs a plain prefill"
ARMS = ("cold", "scored 0", "scored 5", "warm")


def ttft(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> float:
    """Seconds from adding ``prompt`` to its first token (the engine otherwise idle)."""
    rid = f"p{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(EngineRequest(rid, tuple(prompt), params))
    while not engine._requests[rid].seq.output_token_ids:
        engine.step()
    took = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    engine.completion(rid)
    return took


def arm(engine: LLMEngine, name: str, n: int, rng: random.Random) -> float:
    """One arm's time to the first token of a fresh prompt of ``n`` random token ids (never seen: nothing of it
    cached), or for ``warm`` of a prompt just computed."""
    prompt = [rng.randrange(100, engine.model_config.vocab_size) for _ in range(n)]
    plain = SamplingParams(max_tokens=1, ignore_eos=True)
    if name == "cold":
        return ttft(engine, prompt, plain)
    if name == "warm":
        ttft(engine, prompt, plain)  # now cached
        return ttft(engine, prompt, plain)
    return ttft(engine, prompt, SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=int(name.split()[1])))


def run(threads: int, lengths: list[int], rounds: int) -> list[dict]:
    engine = LLMEngine(EngineSettings(threads=threads, kv_cache_mb=512, max_batched_tokens=1024))
    rows = []
    for n in lengths:
        rng = random.Random(n)
        arm(engine, "cold", n, rng)  # warm-up
        best = {a: float("inf") for a in ARMS}
        for _ in range(rounds):
            for a in ARMS:
                best[a] = min(best[a], arm(engine, a, n, rng))
        base = best["cold"]
        rows.append({"prompt tokens": n, **{f"{a} ms": f"{best[a] * 1e3:.1f}" for a in ARMS},
                     "scored 0 / cold": f"{best['scored 0'] / base:.2f}x",
                     "scored 5 / cold": f"{best['scored 5'] / base:.2f}x",
                     "warm / cold": f"{best['warm'] / base:.2f}x"})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", default="128,512,2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = run(args.threads, lengths, args.rounds)
    body = (f"Default model (SmolLM2-135M, a 49,152-token vocabulary), {args.threads} thread(s), step budget 1,024 "
            "tokens, a fresh prompt of random token ids each time; time to the first token of one prompt, "
            f"{args.rounds} alternating rounds, the smallest of each kept. `cold`: nothing cached, not scored (the "
            f"baseline); `scored N`: `prompt_logprobs` N, every prompt row's logits taken {PROMPT_LOGPROB_ROWS} "
            "rows at a time; `warm`: not scored, the prompt cached (only its last token computed): the reuse a "
            "scored prompt forgoes.\n\n"
            + markdown_table(rows, ["prompt tokens", *(f"{a} ms" for a in ARMS), "scored 0 / cold",
                                    "scored 5 / cold", "warm / cold"]))
    publish(SECTION, f"kvmesh bench prompt-logprobs --threads {args.threads} --lengths {args.lengths} "
                     f"--rounds {args.rounds}", body, write=not args.no_write)


if __name__ == "__main__":
    main()
