"""The KV canary on a vLLM engine (``kvmesh.vllm.canary``), in this process with the real model: reuses of a clean
prefix raise no alarm; a cached prefix corrupted in vLLM's paged KV after it was written (two layers swapped, or
its bytes read as another dtype) is caught on the next reuse, its blocks leave vLLM's prefix cache and the pool
is told their keys."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from kvmesh.contracts.engine import EngineRequest
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.settings import EngineSettings

from tests.vllm.conftest import ENGINE

pytestmark = pytest.mark.vllm


def _cached_block_ids(engine) -> list[int]:
    pool = engine.llm.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    ids: set[int] = set()
    for blocks in pool.cached_block_hash_to_block._cache.values():
        ids.update(blocks if isinstance(blocks, dict) else [blocks.block_id])
    return sorted(ids)


def _swap_layers(engine) -> int:
    ids = _cached_block_ids(engine)
    paged = engine.bridge.paged
    wire = paged.read(ids)
    paged.write(ids, wire[:, [1, 0, *range(2, wire.shape[1])]].contiguous())
    return len(ids)


def _reinterpret(engine) -> int:
    """fp32 KV read as if it were bf16: each row's bytes taken as twice as many 16-bit values, the first half kept."""
    ids = _cached_block_ids(engine)
    paged = engine.bridge.paged
    wire = paged.read(ids).contiguous()
    misread = wire.view(torch.bfloat16)[..., :wire.shape[-1]].to(torch.float32)
    paged.write(ids, misread.contiguous())
    return len(ids)


async def _generate(engine, rid: str, prompt: list[int], max_tokens: int = 4) -> tuple[list[int], int]:
    tokens, cached = [], 0
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    async for out in engine.generate(EngineRequest(rid, tuple(prompt), params)):
        tokens.extend(out.token_ids)
        cached = max(cached, out.cached_tokens)
    return tokens, cached


async def _settled(engine, timeout: float = 120.0) -> None:
    """Until the canary has nothing pending or running."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine.canary.pending or engine.canary.running is not None:
        assert loop.time() < deadline, "the canary's checks did not finish"
        await asyncio.sleep(0.1)


async def _phase(engine, quarantined: list, corrupt, reuses: int, seed: int) -> dict:
    """A fresh prefix cached (vLLM's prefix cache emptied first, so only its blocks are there), ``corrupt``-ed in
    place, reused ``reuses`` times (each check settled), then asked for once more."""
    assert await engine.run(engine.llm.reset_prefix_cache)
    before, seen = dict(engine.canary_counts()), len(quarantined)
    rng = random.Random(seed)
    prefix = [rng.randrange(100, 40000) for _ in range(300)]  # 2 whole vLLM blocks of 128
    await _generate(engine, f"warm-{seed}", prefix + [7])
    await _settled(engine)
    if corrupt is not None:
        assert await engine.run(lambda: corrupt(engine)) > 0
    cached = []
    for i in range(reuses):
        _, c = await _generate(engine, f"reuse-{seed}-{i}", prefix + [rng.randrange(100, 40000) for _ in range(8)])
        cached.append(c)
        await _settled(engine)
    _, after = await _generate(engine, f"after-{seed}", prefix + [11])
    await _settled(engine)
    counts = {k: n - before.get(k, 0) for k, n in engine.canary_counts().items()}
    return {"counts": counts, "quarantined": quarantined[seen:], "cached": cached, "after": after,
            "largest_ok": engine.canary.largest_ok}


def test_the_canary_passes_clean_reuses_and_catches_corrupted_ones():
    """One engine (vLLM takes one KV connector per process): 12 clean reuses, then a layer swap, then a dtype
    reinterpretation, each on a prefix of its own."""
    from kvmesh.vllm.engine import start_vllm

    async def run() -> list[dict]:
        engine = await start_vllm(EngineSettings(**ENGINE, canary_share=1.0, canary_budget=1.0))
        quarantined: list[tuple[list[int], str]] = []
        engine.on_quarantine(lambda keys, path: quarantined.append((keys, path)))
        try:
            return [await _phase(engine, quarantined, None, 12, 1),
                    await _phase(engine, quarantined, _swap_layers, 1, 2),
                    await _phase(engine, quarantined, _reinterpret, 1, 3)]
        finally:
            await engine.close()

    clean, *corrupted = asyncio.run(run())
    assert all(c >= 256 for c in clean["cached"])
    assert clean["counts"].get(("local", "ok"), 0) == 13  # the 12 reuses and the last request
    assert clean["counts"].get(("local", "diverged"), 0) == 0 and not clean["quarantined"]
    assert clean["after"] >= 256  # nothing was dropped from the prefix cache
    print(f"clean reuses: largest logprob difference {clean['largest_ok']:.2e}")
    assert clean["largest_ok"] < 0.25 * 0.02  # fp32: far inside the tolerance
    for r in corrupted:
        assert r["cached"][0] >= 256  # the corrupted blocks were served
        assert r["counts"].get(("local", "diverged"), 0) == 1
        (keys, path), = r["quarantined"]
        assert path == "local" and len(keys) == (300 + 8) // 16
        assert r["after"] == 0  # vLLM matches none of it again: the last request recomputed it
