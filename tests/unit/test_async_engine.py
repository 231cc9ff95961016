"""The engine thread survives callers that go away: a request cancelled while its command waits in the queue
(the router cancels a Prefill whose decode died) and a command that raises."""

from __future__ import annotations

import asyncio
import threading

import pytest
from kvmesh.contracts.engine import EngineRequest, Speed
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.llm_engine import LLMEngine
from kvmesh.settings import EngineSettings

from .helpers import req


def test_a_cancelled_caller_and_a_failing_command_leave_the_engine_thread_serving(tiny_config):
    async def run() -> tuple[list[int], bool]:
        engine = AsyncEngine(LLMEngine(EngineSettings(num_blocks=32, block_size=4), model_config=tiny_config),
                             asyncio.get_running_loop())
        try:
            gate = threading.Event()
            blocker = asyncio.ensure_future(engine.call(lambda e: gate.wait(10)))  # holds the engine thread
            await asyncio.sleep(0.05)

            async def consume() -> None:
                async for _ in engine.generate(EngineRequest("gone", (1, 2, 3, 4, 5), SamplingParams(max_tokens=2))):
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
            out = [o async for o in engine.generate(EngineRequest(
                "next", (1, 2, 3, 4, 5), SamplingParams(max_tokens=3, ignore_eos=True)))]
            return [t for o in out for t in o.token_ids], engine._thread.is_alive()
        finally:
            await engine.close()

    tokens, alive = asyncio.run(asyncio.wait_for(run(), 30))
    assert len(tokens) == 3 and alive


def test_step_totals_count_prompt_steps_apart_from_decode_only_steps(tiny_config):
    async def run():
        engine = AsyncEngine(LLMEngine(EngineSettings(num_blocks=32, block_size=4), model_config=tiny_config),
                             asyncio.get_running_loop())
        try:
            async def one(rid: str) -> None:
                async for _ in engine.generate(EngineRequest(rid, (1, 2, 3, 4, 5),
                                                               SamplingParams(max_tokens=4, ignore_eos=True))):
                    pass

            await one("a")
            return engine.step_totals
        finally:
            await engine.close()

    totals = asyncio.run(asyncio.wait_for(run(), 30))
    # the prompt's step samples token 1, then one per step
    assert (totals.prefill.steps, totals.decode.steps) == (1, 3)
    assert (totals.prefill.rows, totals.decode.rows) == (1, 3)
    assert totals.decode.seconds > 0 and totals.prefill.seconds > 0
    assert all(0 < c.cpu_seconds <= c.seconds * 1.05 + 1e-3 for c in (totals.prefill, totals.decode))


def test_prompt_steps_and_decode_only_steps_feed_separate_speed_fits(tiny_config):
    """The prefill speed the router prices prompts with is fitted over steps with prompt tokens only; decode-only
    steps fit the batch's step over its rows (their first step is each fit's warm-up, not counted)."""
    async def run():
        engine = AsyncEngine(LLMEngine(EngineSettings(num_blocks=64, block_size=4), model_config=tiny_config),
                             asyncio.get_running_loop())
        try:
            async def one(rid: str, prompt: list[int]) -> None:
                async for _ in engine.generate(EngineRequest(rid, tuple(prompt),
                                                               SamplingParams(max_tokens=4, ignore_eos=True))):
                    pass

            for i in range(3):
                await one(f"r{i}", [1 + i, 2, 3, 4, 5, 6])
            return engine.pacer.speed_fit.fit(), engine.pacer.decode_speed.fit()
        finally:
            await engine.close()

    prefill, decode = asyncio.run(asyncio.wait_for(run(), 30))
    assert prefill is not None and 1 <= prefill.samples <= 2  # 3 prompt steps, less the warm-up (and outliers)
    assert decode is not None and 3 <= decode.samples <= 8  # 3 x 3 decode-only steps, less the warm-up


def test_the_chunk_cap_is_sized_against_the_batch_the_waiting_prompts_settle_at(tiny_config):
    """One stream running, fifteen prompts waiting: the cap follows ``chunk_budget`` with the settled batch."""
    from kvmesh.engine.slo import chunk_budget

    async def run():
        engine = AsyncEngine(LLMEngine(EngineSettings(num_blocks=256, block_size=4, max_batched_tokens=4096),
                                       model_config=tiny_config), asyncio.get_running_loop())
        try:
            for n, seconds in [(64, 0.03 + 64 / 1500)] * 4 + [(128, 0.03 + 128 / 1500)] * 4:
                engine.pacer.speed_fit.observe(n, seconds)
            for rows in [1, 2, 4, 8, 16, 1, 2, 4, 8]:
                engine.pacer.decode_speed.observe(rows, 0.035 + rows / 500)

            def setup(e: LLMEngine):
                e.add_request(req("running", [1, 2, 3, 4, 5], SamplingParams(max_tokens=64, ignore_eos=True)))
                e.step()  # its prompt: now a decode row
                for i in range(15):
                    e.add_request(req(f"w{i}", [7 + i, 2, 3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True)))
                pacer = engine.pacer
                pacer._steps = 0  # the next sizing refits
                pacer.plan(e.scheduler)
                # read on the engine thread: once this returns, its loop steps the requests and plans again
                return pacer.cap, pacer._fit, pacer._decode_fit

            return await engine.call(setup)
        finally:
            await engine.close()

    cap, prefill, decode = asyncio.run(asyncio.wait_for(run(), 30))
    assert cap == chunk_budget(prefill.overhead_s, prefill.tok_per_s, 1, engine_stall(),
                               (decode.overhead_s, decode.tok_per_s), 16)
    assert cap > 4 * chunk_budget(prefill.overhead_s, prefill.tok_per_s, 1, engine_stall(),
                                  (decode.overhead_s, decode.tok_per_s), 1)


def engine_stall() -> float:
    return EngineSettings().mixed_step_stall


def test_streams_with_an_itl_target_cap_the_mixed_step_within_it_by_the_measured_lines(tiny_config):
    """One stream with a 150 ms ITL target (and a late gap to lend), a prompt waiting: the cap is what fits 0.85
    of the target after the decode row, at the measured cost of a prompt token from the prompt's position."""
    from kvmesh.contracts.slo import SLO
    from kvmesh.engine.slo import HEADROOM, StepCost

    async def run():
        engine = AsyncEngine(LLMEngine(EngineSettings(num_blocks=256, block_size=4, max_batched_tokens=4096),
                                       model_config=tiny_config), asyncio.get_running_loop())
        try:
            for n, seconds in [(64, 0.03 + 64 / 400), (128, 0.03 + 128 / 400)] * 4:
                engine.pacer.speed_fit.observe(n, seconds)
                engine.pacer.chunk_speed.observe(n, seconds)
            for rows in [1, 2, 4, 8, 1, 2, 4, 8]:
                engine.pacer.decode_speed.observe(rows, 0.02 + rows / 500)

            def setup(e: LLMEngine):
                e.add_request(req("stream", [1, 2, 3, 4, 5], SamplingParams(max_tokens=200, ignore_eos=True),
                                  slo=SLO(itl_s=0.15)))  # 199 gaps: one may run late
                e.step()  # its prompt: now a decode row
                e.add_request(req("prompt", [i % 250 + 1 for i in range(400)], SamplingParams(max_tokens=2)))
                pacer = engine.pacer
                pacer._steps = 0  # the next sizing refits
                pacer.plan(e.scheduler)
                # read on the engine thread: once this returns, its loop steps both requests, observes those
                # steps and plans again
                return pacer.cap, pacer._chunk_fit, pacer._decode_fit, pacer.context

            return await engine.call(setup)
        finally:
            await engine.close()

    cap, prefill, decode, context = asyncio.run(asyncio.wait_for(run(), 30))
    step = decode.overhead_s + 1 / decode.tok_per_s
    assert cap == StepCost(step, 1 / prefill.tok_per_s, context).tokens_within(HEADROOM * 0.15, 0)
    assert cap < int((HEADROOM * 0.15 - step) * prefill.tok_per_s)  # the prompt's later tokens cost more


def test_the_engine_measures_its_step_lines_at_start_and_leaves_no_kv_behind(tiny_config):
    """``calibrate``: forward passes over dummy rows feed the prefill, prompt-work and decode lines, so the first
    heartbeat and the first plan price steps at this machine's speed; nothing is cached or announced."""
    async def run():
        engine = AsyncEngine(LLMEngine(EngineSettings(num_blocks=128, block_size=4), model_config=tiny_config),
                             asyncio.get_running_loop())
        try:
            assert engine.speed() == Speed()  # nothing measured: the router keeps its configured speed
            await engine.calibrate()
            speed = engine.speed()
            cached = engine.engine.blocks.num_cached_blocks + len(engine._events) + len(engine._device_keys)
            out = [o async for o in engine.generate(EngineRequest("r", (1, 2, 3), SamplingParams(max_tokens=3)))]
            return speed, engine.pacer._chunk_fit, engine.pacer._decode_fit, cached, out
        finally:
            await engine.close()

    speed, chunk, decode, cached, out = asyncio.run(asyncio.wait_for(run(), 30))
    assert speed.prefill_tok_per_s and speed.prefill_tok_per_s > 0 and speed.decode_step_s and speed.decode_step_s > 0
    assert chunk is not None and decode is not None and cached == 0
    assert sum(len(o.token_ids) for o in out) == 3  # it serves as before


def test_the_calibration_passes_refuse_an_engine_that_holds_requests(tiny_config):
    e = LLMEngine(EngineSettings(num_blocks=64, block_size=4), model_config=tiny_config)
    assert e.time_forward([(0, 16), (0, 1)]) > 0
    e.add_request(req("r", [1, 2, 3], SamplingParams(max_tokens=2)))
    with pytest.raises(RuntimeError, match="holds no request"):
        e.time_forward([(0, 16)])


def test_a_step_reports_what_it_ran(tiny_config):
    """``LLMEngine.step``'s report, which paces the next step: its rows, the decode rows among them, the prompt
    chunks as (first position, tokens) and the tokens computed; a step with nothing to run reports no rows."""
    e = LLMEngine(EngineSettings(num_blocks=64, block_size=4, max_batched_tokens=8), model_config=tiny_config)
    assert e.step().report.rows == 0
    e.add_request(req("a", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
    e.step()  # its prompt: now a decode row
    e.add_request(req("b", list(range(1, 21)), SamplingParams(max_tokens=2)))
    report = e.step().report
    assert (report.rows, report.decode_rows, report.prompt_chunks, report.tokens) == (2, 1, ((0, 7),), 8)
    assert not report.decode_only and report.seconds > 0
    capped = e.step(chunk_tokens=3).report
    assert (capped.decode_rows, capped.prompt_chunks) == (1, ((7, 3),))


@pytest.mark.parametrize("order", ["arrival", "least_work"])
def test_a_least_work_engine_tells_the_queue_a_new_prompt_would_wait_for(tiny_config, order):
    """Its load carries, per edge of ``AHEAD_EDGES_S``, the queued prompt tokens a new prompt with that much compute
    would not pass (all of them for prompts not ranked yet); an engine in arrival order says nothing."""
    async def run() -> tuple[int, tuple[int, ...]]:
        engine = AsyncEngine(LLMEngine(EngineSettings(num_blocks=64, block_size=4, prefill_order=order),
                                       model_config=tiny_config), asyncio.get_running_loop())
        try:
            gate = threading.Event()
            blocker = asyncio.ensure_future(engine.call(lambda e: gate.wait(10)))  # holds the engine thread
            await asyncio.sleep(0.05)
            for rid, n in (("a", 30), ("b", 20)):  # queued while the thread is held: nothing steps them
                engine.engine.add_request(req(rid, list(range(1, n + 1)), SamplingParams(max_tokens=1)))
            load = engine.load()
            gate.set()
            await blocker
            return load.waiting_tokens, load.ahead_tokens
        finally:
            await engine.close()

    waiting, ahead = asyncio.run(asyncio.wait_for(run(), 30))
    assert waiting == 50
    assert ahead == ((50, 50, 50, 50) if order == "least_work" else ())
