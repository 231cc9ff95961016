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


def test_requests_are_served_earliest_deadline_first_and_counted_against_their_targets():
    """vLLM's priority scheduling runs the request due first (its TTFT deadline; one without a target is due a
    minute after it arrived), and the engine counts who met their targets, as the native engine does (goodput)."""
    from kvmesh.contracts.slo import SLO
    from kvmesh.vllm.engine import start_vllm

    async def run() -> tuple[list[str], dict[str, int]]:
        engine = await start_vllm(EngineSettings(**ENGINE, max_num_seqs=1))
        try:
            order: list[str] = []

            async def one(rid: str, slo: SLO) -> None:
                params = SamplingParams(max_tokens=3, ignore_eos=True)
                async for out in engine.generate(EngineRequest(rid, (101, 102, 103, 104 + len(rid)), params,
                                                               slo=slo)):
                    if out.token_ids and rid not in order:
                        order.append(rid)

            gate = threading.Event()
            engine.queue(gate.wait)  # the three queue up while the engine thread waits
            tasks = [asyncio.create_task(one("none", SLO())), asyncio.create_task(one("lax", SLO(ttft_s=40))),
                     asyncio.create_task(one("tight", SLO(ttft_s=20, itl_s=30)))]
            await asyncio.sleep(0.1)
            gate.set()
            await asyncio.gather(*tasks)
            return order, dict(vars(engine.stats().slo))
        finally:
            await engine.close()

    order, slo = asyncio.run(run())
    assert order == ["tight", "lax", "none"]  # due in 20 s, 40 s, and 60 s (no target)
    assert slo["met"] + slo["missed"] == 2  # the one without a target is not counted


def test_a_requests_session_reaches_vllm_as_its_session_id_and_a_kv_hint(monkeypatch):
    """The agent hint contract on vLLM: a request's session (and a sub-agent's parent) is on vLLM's own
    ``Request`` (its ``session_id``, which vLLM's KV events carry, and an orchestrator's ``KvHintsEnvelope``), as
    the KV connector sees it when vLLM admits the request."""
    from kvmesh.contracts.engine import SessionHint
    from kvmesh.vllm.connector import KvmeshConnector
    from kvmesh.vllm.engine import start_vllm
    from kvmesh.vllm.requests import SESSION_ACTION

    seen: dict[str, tuple] = {}
    admitted = KvmeshConnector.get_num_new_matched_tokens

    def record(self, request, num_computed_tokens):
        seen[request.request_id] = (request.session_id, request.kv_hints)
        return admitted(self, request, num_computed_tokens)

    monkeypatch.setattr(KvmeshConnector, "get_num_new_matched_tokens", record)

    async def run() -> None:
        engine = await start_vllm(EngineSettings(**ENGINE))
        try:
            params = SamplingParams(max_tokens=2, ignore_eos=True)
            for rid, session in (("agent", SessionHint("t/run:sub", parent="t/run")), ("plain", None)):
                async for _ in engine.generate(EngineRequest(rid, (101, 102, 103, 104), params, session=session)):
                    pass
        finally:
            await engine.close()

    asyncio.run(run())
    (agent_sid, agent_hints), = [v for k, v in seen.items() if "agent" in k]
    (plain_sid, plain_hints), = [v for k, v in seen.items() if "plain" in k]
    assert agent_sid == "t/run:sub" and plain_sid is None and plain_hints is None
    (action,) = agent_hints.actions
    assert (action.action_type, action.action_version) == (SESSION_ACTION, "1")
    assert action.payload == {"session_id": "t/run:sub", "parent_session_id": "t/run", "session_end": False}
