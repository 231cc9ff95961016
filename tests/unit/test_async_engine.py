"""The engine thread survives callers that go away: a request cancelled while its command waits in the queue
(the router cancels a Prefill whose decode died) and a command that raises."""

from __future__ import annotations

import asyncio
import threading

from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.llm_engine import LLMEngine
from kvmesh.settings import EngineSettings


def test_a_cancelled_caller_and_a_failing_command_leave_the_engine_thread_serving(tiny_config):
    async def run() -> tuple[list[int], bool]:
        engine = AsyncEngine(LLMEngine(EngineSettings(num_blocks=32, block_size=4), model_config=tiny_config),
                             asyncio.get_running_loop())
        try:
            gate = threading.Event()
            blocker = asyncio.ensure_future(engine.call(lambda e: gate.wait(10)))  # holds the engine thread
            await asyncio.sleep(0.05)

            async def consume() -> None:
                async for _ in engine.generate("gone", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2)):
                    pass

            gone = asyncio.ensure_future(consume())  # its add_request waits behind the blocker...
            await asyncio.sleep(0.05)
            gone.cancel()  # ...and its caller leaves before the engine gets to it
            await asyncio.sleep(0.05)
            gate.set()
            await blocker
            try:
                await engine.call(lambda e: 1 / 0)
            except ZeroDivisionError:
                pass
            out = [o async for o in engine.generate("next", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3,
                                                                                            ignore_eos=True))]
            return [t for o in out for t in o.new_token_ids], engine._thread.is_alive()
        finally:
            engine.close()

    tokens, alive = asyncio.run(asyncio.wait_for(run(), 30))
    assert len(tokens) == 3 and alive


def test_step_totals_count_prompt_steps_apart_from_decode_only_steps(tiny_config):
    async def run():
        engine = AsyncEngine(LLMEngine(EngineSettings(num_blocks=32, block_size=4), model_config=tiny_config),
                             asyncio.get_running_loop())
        try:
            async def one(rid: str) -> None:
                async for _ in engine.generate(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True)):
                    pass

            await one("a")
            return engine.step_totals
        finally:
            engine.close()

    totals = asyncio.run(asyncio.wait_for(run(), 30))
    assert totals.steps == {"prefill": 1, "decode": 3}  # the prompt's step samples token 1, then one per step
    assert totals.rows == {"prefill": 1, "decode": 3}
    assert totals.seconds["decode"] > 0 and totals.seconds["prefill"] > 0
