"""How long a prefill takes, from the engine's measured speed: a linear model in computed tokens, plus the time
to fetch blocks from the pool. Mooncake's estimated TTFT is built from these."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    prefill_tok_per_s: float = 240.0   # measured on this machine: SmolLM2-135M, 1 thread, fp32
    prefill_overhead_s: float = 0.03   # per prefill (first-token sampling, scheduling)
    fetch_gbps: float = 1.0            # pool → instance, per the transfer benchmark
    block_bytes: int = 737_280         # SmolLM2-135M fp32, 16-token blocks

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_overhead_s + max(0, tokens) / self.prefill_tok_per_s if tokens > 0 else 0.0

    def fetch_s(self, blocks: int) -> float:
        return blocks * self.block_bytes / (self.fetch_gbps * 1e9)

    @classmethod
    def calibrate(cls, engine, sizes: tuple[int, int] = (64, 512), fetch_gbps: float = 1.0) -> "CostModel":
        """Fit the prefill line on ``engine`` (an LLMEngine) with two cold prompts."""
        from kvmesh.engine.sequence import SamplingParams  # noqa: PLC0415

        times = []
        for n in sizes:
            engine.blocks.evict(engine.blocks.num_cached_blocks)
            prompt = [(i * 7919) % 30000 + 100 for i in range(n)]
            t0 = time.perf_counter()
            engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
            times.append(time.perf_counter() - t0)
        slope = (times[1] - times[0]) / (sizes[1] - sizes[0])
        overhead = max(0.0, times[0] - slope * sizes[0])
        return cls(1.0 / max(slope, 1e-9), overhead, fetch_gbps, engine.layout.block_nbytes)
