"""``kvmesh bench tokenize``: the router's tokenization of long prompts on its event loop, as it was, against on
its tokenize threads with the GIL released, as it is (``Intake.prompt_ids``, ``Tokenizer._ids``).

    kvmesh bench tokenize [--prompts 32] [--tokens 4096] [--threads N] [--rounds 3] [--no-write]

The default model's tokenizer; ``--prompts`` texts of about ``--tokens`` tokens each (distinct slices of this
repository's docs), all handed to one event loop at once, as concurrent requests reach a router, while a ticker on
that loop measures how late it runs (what every other request's streaming waits). Reported per way: prompts per
second, and the loop's lag p50 / p99 / max. ``inline``: ``tokenizer.encode`` on the loop with the GIL held (the
router before); ``threads``: the router's path, the same ids. The ways alternate over ``--rounds``; the best
round of each is kept (the machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from app.bench.report import load_average, markdown_table, publish
from app.bench.stats import percentile

SECTION = "Router tokenization off the event loop"
ROOT = Path(__file__).resolve().parents[2]


def texts(n: int, tokens: int) -> list[str]:
    """``n`` distinct texts of about ``tokens`` tokens (~4 characters a token) from the repository's docs."""
    corpus = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    size = tokens * 4
    step = max(1, (len(corpus) - size) // max(1, n))
    return [corpus[i * step:i * step + size] for i in range(n)]


async def one_way(prompts: list[str], tokenize) -> tuple[float, list[float]]:
    """Tokenize every prompt concurrently on this loop through ``tokenize``; returns (seconds, the ticker's lags)."""
    lags: list[float] = []
    done = False

    async def ticker() -> None:
        while not done:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    await asyncio.gather(*(tokenize(p) for p in prompts))
    elapsed = time.perf_counter() - t0
    done = True
    await tick
    return elapsed, lags


def bench(prompts_n: int, tokens: int, threads: int, rounds: int) -> tuple[str, dict[str, float]]:
    from kvmesh.engine.loader import resolve_model
    from kvmesh.model_source.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(resolve_model(None).hf_dir)
    prompts = texts(prompts_n, tokens)
    raw = tok._tok
    pool = ThreadPoolExecutor(threads, "tokenize")
    sizes = [len(tok.encode(p)) for p in prompts]

    async def inline(text: str) -> list[int]:
        return raw.encode(text, add_special_tokens=True).ids  # the GIL held, on the loop

    async def threaded(text: str) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(pool, tok.encode, text)

    async def same_ids() -> bool:
        return all([await inline(p) == await threaded(p) for p in prompts[:4]])

    assert asyncio.run(same_ids()), "the threaded path gave other ids"
    best: dict[str, tuple[float, list[float]]] = {}
    for r in range(rounds):
        order = [("inline", inline), ("threads", threaded)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            got = asyncio.run(one_way(prompts, fn))
            if name not in best or got[0] < best[name][0]:
                best[name] = got
    pool.shutdown()
    rows = []
    for name, (elapsed, lags) in best.items():
        ms = [x * 1000 for x in lags] or [0.0]
        rows.append({"way": name, "prompts/s": f"{len(prompts) / elapsed:.1f}",
                     "loop lag p50 ms": f"{percentile(ms, 50):.1f}", "p99 ms": f"{percentile(ms, 99):.1f}",
                     "max ms": f"{max(ms):.1f}"})
    ratio = best["inline"][0] / best["threads"][0]
    head = (f"{len(prompts)} prompts of {min(sizes)}-{max(sizes)} tokens (the default model's tokenizer), handed "
            f"to one event loop at once; a ticker on the loop measures its lag. `inline`: encode on the loop, the "
            f"GIL held (the router before); `threads`: the router's tokenize threads ({threads}), the GIL released "
            f"(same ids, checked). Best of {rounds} alternating rounds each. {os.cpu_count()} cores; load average "
            f"{load_average()}.\n\n")
    body = head + markdown_table(rows, list(rows[0])) + f"\n\nThreads / inline: {ratio:.2f}x the prompts per second.\n"
    return body, {"ratio": ratio}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvmesh bench tokenize", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md as it is")
    a = p.parse_args(argv)
    body, _ = bench(a.prompts, a.tokens, a.threads, a.rounds)
    publish(SECTION, "kvmesh bench tokenize", body, write=not a.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
