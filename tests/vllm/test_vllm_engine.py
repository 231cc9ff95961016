"""The vLLM backend in this process (``kvmesh.vllm.engine``), without a stack: what it measures for the router."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from kvmesh.contracts.engine import EngineRequest
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.routing.cost import SpeedEstimator
from kvmesh.settings import EngineSettings

from tests.vllm.conftest import ENGINE

pytestmark = pytest.mark.vllm


class Recorded(SpeedEstimator):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def observe(self, tokens: int, seconds: float) -> None:
        self.seen.append(tokens)
        super().observe(tokens, seconds)


def test_the_prefill_speed_is_fitted_from_what_each_step_computed_not_from_each_requests_wait():
    """Two prompts that vLLM prefills in one step are one sample of both prompts' tokens (fitting each request's
    own tokens over its time to the first token counted that step twice, at half the speed, and any wait in the
    queue as compute); decode-only steps are no prefill samples."""
    from kvmesh.vllm.engine import start_vllm

    async def run() -> list[int]:
        engine = await start_vllm(EngineSettings(**ENGINE, max_batched_tokens=2048))
        try:
            engine.speed_fit = recorded = Recorded()
            rng = random.Random(0)
            prompts = [[rng.randrange(100, 40000) for _ in range(300)] for _ in range(2)]

            async def one(i: int) -> None:
                params = SamplingParams(max_tokens=4, ignore_eos=True)
                async for _ in engine.generate(EngineRequest(f"r{i}", tuple(prompts[i]), params)):
                    pass

            gate = threading.Event()
            engine.queue(gate.wait)  # the engine thread waits here while both requests queue up behind
            tasks = [asyncio.create_task(one(i)) for i in range(2)]
            await asyncio.sleep(0)  # each task runs until it waits for its request to be added
            gate.set()
            await asyncio.gather(*tasks)
            return recorded.seen
        finally:
            await engine.close()

    seen = asyncio.run(run())
    assert seen == [600]
