"""``engine.prefill_order``: on a real (tiny) engine, a prompt whose prefix is cached is served before a long cold
one that arrived just before it under ``least_work``, and after it under ``arrival``; the pacer looks the waiting
prompts' cached prefixes up, and the setting is refused for vLLM instances."""

from __future__ import annotations

import pytest
from kvmesh.contracts.names import PrefillOrder
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.llm_engine import LLMEngine
from kvmesh.engine.pacer import Pacer
from kvmesh.settings import EngineSettings

from .helpers import req, run

ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def first_tokens(tiny_config, order: PrefillOrder,
                 warm_params: SamplingParams = ONE) -> tuple[list[str], dict[str, int]]:
    """A 64-token prefix cached, then a cold 64-token prompt and the cached prefix + 2 tokens, queued in that
    order on an engine whose steps carry 16 prompt tokens: the order their first tokens come in, and each
    waiting prompt's cached prefix as the pacer found it."""
    e = LLMEngine(EngineSettings(num_blocks=256, block_size=4, max_batched_tokens=16), model_config=tiny_config)
    shared = list(range(10, 74))
    run(e, [("earlier", [*shared, 5], ONE)])
    pacer = Pacer(0.5, 0.0, order)
    for n in (16, 16, 32, 64):  # a measured prefill line, so the pacer plans (as after the engine's calibration)
        pacer.speed_fit.observe(n, 0.01 + n / 1500)
        pacer.chunk_speed.observe(n, 0.01 + n / 1500)
    e.add_request(req("cold", list(range(100, 164)), ONE))
    e.add_request(req("warm", [*shared, 6, 7], warm_params))
    seqs = {s.request_id: s for s in e.scheduler.waiting}
    firsts: list[str] = []
    estimates: dict[str, int] = {}
    while e.has_unfinished():
        pacer.plan(e.scheduler)
        estimates = estimates or {rid: s.cached_estimate for rid, s in seqs.items()}
        for out in e.step(pacer.cap).outputs:
            if out.new_token_ids and out.request_id not in firsts:
                firsts.append(out.request_id)
    return firsts, estimates


def test_least_work_serves_the_cached_prompt_before_the_cold_one_that_came_first(tiny_config):
    firsts, estimates = first_tokens(tiny_config, PrefillOrder.LEAST_WORK)
    assert firsts == ["warm", "cold"]
    assert estimates == {"cold": 0, "warm": 64}  # 16 full blocks of 4 found for it, none for the cold one


def test_a_prompt_that_scores_itself_is_priced_as_the_whole_prompt_it_computes(tiny_config):
    """``prompt_logprobs`` reuses no cached prefix: its 66 tokens are more work than the cold 64."""
    scored = SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    firsts, estimates = first_tokens(tiny_config, PrefillOrder.LEAST_WORK, scored)
    assert firsts == ["cold", "warm"] and estimates == {"cold": 0, "warm": 0}


def test_arrival_serves_them_in_the_order_they_came(tiny_config):
    firsts, estimates = first_tokens(tiny_config, PrefillOrder.ARRIVAL)
    assert firsts == ["cold", "warm"]
    assert estimates == {"cold": 0, "warm": 0}  # nothing looked up: the order does not read it


def test_the_order_is_a_setting_and_the_vllm_backend_refuses_least_work():
    assert EngineSettings(prefill_order="least_work").prefill_order is PrefillOrder.LEAST_WORK
    with pytest.raises(ValueError, match="prefill_order"):
        EngineSettings(prefill_order="shortest")
    with pytest.raises(ValueError, match="vLLM orders its own queue"):
        EngineSettings(backend="vllm", prefill_order="least_work")
