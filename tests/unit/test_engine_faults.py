"""Per-request fault isolation in the engine step: one hostile or broken request in a batch of good ones. The
good ones get exactly the tokens they get alone, the broken one gets its error (or, for a temperature too small
to divide by, is served greedily), and the engine serves the next request. A forward pass that fails fails
that step's sequences with a clear error, and the next step is served."""

from __future__ import annotations

import asyncio

import pytest
from kvmesh.contracts.engine import EngineRequest, ExportPieces, ExportPlan
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.llm_engine import LLMEngine
from kvmesh.engines import SequenceError
from kvmesh.settings import EngineSettings

from .helpers import NanLogits, req, run

GOOD = [([5, 17, 33, 2, 99], SamplingParams(max_tokens=8, ignore_eos=True)),
        ([40, 41, 42, 43, 44, 45, 46, 47, 48], SamplingParams(max_tokens=8, temperature=0.8, seed=7,
                                                              ignore_eos=True)),
        ([200, 3, 9], SamplingParams(max_tokens=8, temperature=1.2, top_k=20, top_p=0.9, seed=2**64 - 1,
                                     ignore_eos=True))]
HOSTILE_PROMPT = [7, 7, 130, 66, 201, 11]
TINY_T = 1.401298464324817e-45  # what Hypothesis found: 1 / T overflowed and the whole batch got a 503


@pytest.fixture
def make(tiny_config):
    return lambda logits_hook=None: LLMEngine(EngineSettings(num_blocks=64, block_size=4, max_batched_tokens=256,
                                                           attention="torch"), model_config=tiny_config,
                                              logits_hook=logits_hook)


def solo(make, prompt: list[int], params: SamplingParams) -> list[int]:
    return run(make(), [("solo", prompt, params)])["solo"].token_ids


def good_reqs() -> list[tuple[str, list[int], SamplingParams]]:
    return [(f"good-{i}", p, s) for i, (p, s) in enumerate(GOOD)]


def assert_good_as_alone(make, done: dict) -> None:
    for i, (prompt, params) in enumerate(GOOD):
        c = done[f"good-{i}"]
        assert c.error is None and c.token_ids == solo(make, prompt, params), f"good-{i}"


def test_a_tiny_temperature_beside_good_requests_is_served_greedily(make):
    engine = make()
    hostile = SamplingParams(max_tokens=8, temperature=TINY_T, ignore_eos=True)
    done = run(engine, [*good_reqs()[:2], ("hostile", HOSTILE_PROMPT, hostile), *good_reqs()[2:]])
    assert done["hostile"].error is None
    assert done["hostile"].token_ids == solo(make, HOSTILE_PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
    assert_good_as_alone(make, done)
    nxt = run(engine, [("next", *GOOD[1])])["next"]
    assert nxt.token_ids == solo(make, *GOOD[1])


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=8, ignore_eos=True),
                                    SamplingParams(max_tokens=8, temperature=0.9, seed=1, ignore_eos=True)])
def test_nan_logits_fail_that_request_alone_as_an_internal_error(make, params):
    nan = NanLogits("hostile")
    engine = make(logits_hook=nan)
    done = run(engine, [*good_reqs()[:1], ("hostile", HOSTILE_PROMPT, params), *good_reqs()[1:]])
    err = done["hostile"].error
    assert isinstance(err, SequenceError) and not err.client_fault
    assert "hostile" in str(err) and "not finite" in str(err)
    assert done["hostile"].finish_reason == "error" and done["hostile"].token_ids == []
    assert_good_as_alone(make, done)
    assert engine.blocks.num_free_blocks + engine.blocks.num_cached_blocks == engine.kv.num_blocks
    nan.ids.clear()
    assert run(engine, [("next", HOSTILE_PROMPT, params)])["next"].token_ids == solo(make, HOSTILE_PROMPT, params)


def test_nan_logits_mid_decode_keep_the_tokens_so_far_and_fail_there(make):
    nan = NanLogits()
    engine = make(logits_hook=nan)
    for rid, prompt, params in [*good_reqs(), ("hostile", HOSTILE_PROMPT, GOOD[0][1])]:
        engine.add_request(req(rid, prompt, params))
    for _ in range(3):
        engine.step()
    nan.ids.add("hostile")
    done = {}
    while len(done) < 4:
        for out in engine.step().outputs:
            if out.finished:
                done[out.request_id] = engine.completion(out.request_id)
    assert done["hostile"].error is not None and len(done["hostile"].token_ids) == 3
    assert_good_as_alone(make, done)


def test_a_stop_check_that_raises_fails_that_request_alone(make):
    engine = make()
    check = engine._finish_reason

    def broken(seq, token):
        if seq.request_id == "hostile":
            raise RuntimeError("stop checker exploded")
        return check(seq, token)

    engine._finish_reason = broken
    done = run(engine, [*good_reqs(), ("hostile", HOSTILE_PROMPT, GOOD[0][1])])
    err = done["hostile"].error
    assert err is not None and not err.client_fault and "stop checker exploded" in str(err)
    assert_good_as_alone(make, done)


def test_a_detokenizer_that_raises_fails_that_request_alone(make):
    engine = make()

    class Broken:
        def push(self, token):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "detokenizer exploded")

    for rid, prompt, params in [*good_reqs(), ("hostile", HOSTILE_PROMPT, GOOD[0][1])]:
        engine.add_request(req(rid, prompt, params))
    engine._requests["hostile"].detok = Broken()
    done = run(engine, [])
    err = done["hostile"].error
    assert err is not None and not err.client_fault and "detokenizer exploded" in str(err)
    assert_good_as_alone(make, done)


def test_sampling_that_raises_for_one_row_fails_that_request_alone(make, monkeypatch):
    """Whatever raises while a batch is sampled (not a value ``sample`` itself isolates): each row is then
    sampled alone, with fresh generators, so the seeded rows draw what they draw alone."""
    from kvmesh.engine import llm_engine

    real = llm_engine.sample
    hostile = SamplingParams(max_tokens=8, temperature=0.5, seed=424242, ignore_eos=True)

    def exploding(logits, params, generators, mask=None, histories=None):
        if any(p is hostile for p in params):
            raise RuntimeError("sampler exploded")
        return real(logits, params, generators, mask, histories)

    monkeypatch.setattr(llm_engine, "sample", exploding)
    engine = make()
    done = run(engine, [*good_reqs(), ("hostile", HOSTILE_PROMPT, hostile)])
    err = done["hostile"].error
    assert err is not None and not err.client_fault and "sampler exploded" in str(err)
    monkeypatch.setattr(llm_engine, "sample", real)
    assert_good_as_alone(make, done)


def test_a_failed_kv_export_fails_that_request_alone(make):
    engine = make()
    export = engine.blocks.export_prefix

    def broken(seq, *args, **kwargs):
        if seq.request_id == "hostile":
            raise OSError("export failed")
        return export(seq, *args, **kwargs)

    engine.blocks.export_prefix = broken
    engine.add_request(req("hostile", HOSTILE_PROMPT, SamplingParams(max_tokens=1), export=ExportPlan()))
    done = run(engine, good_reqs())
    err = done["hostile"].error
    assert err is not None and "export failed" in str(err) and done["hostile"].finish_reason == "error"
    assert_good_as_alone(make, done)


def test_a_layer_group_read_out_that_fails_during_the_pass_fails_that_request_alone(make):
    """The read-out runs inside the batch's forward pass (``export_layer_groups``): its failure must not fail
    the pass for the rest of the batch, nor leave the failed request holding blocks."""
    engine = make()
    read = engine.kv.read_blocks

    def broken(block_ids, layers=None):
        if layers == (1, 2):
            raise OSError("layer read-out failed")
        return read(block_ids, layers)

    engine.kv.read_blocks = broken
    engine.add_request(req("hostile", HOSTILE_PROMPT, SamplingParams(max_tokens=1),
                           export=ExportPlan(ExportPieces.BY_LAYER_GROUP, layer_groups=2)))
    done = run(engine, good_reqs())
    err = done["hostile"].error
    assert err is not None and "layer read-out failed" in str(err) and done["hostile"].finish_reason == "error"
    assert_good_as_alone(make, done)
    assert engine.blocks.num_free_blocks + engine.blocks.num_cached_blocks == engine.kv.num_blocks


def test_a_failed_forward_pass_fails_that_steps_sequences_and_the_engine_serves_the_next(make):
    engine = make()
    forward, calls = engine.model.forward, []

    def once_broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device fell over")
        return forward(*args, **kwargs)

    engine.model.forward = once_broken
    done = run(engine, good_reqs())
    for c in done.values():
        assert isinstance(c.error, SequenceError) and "forward pass failed" in str(c.error)
        assert "device fell over" in str(c.error) and c.request_id in str(c.error)
    assert engine.blocks.num_free_blocks + engine.blocks.num_cached_blocks == engine.kv.num_blocks
    assert run(engine, [("next", *GOOD[2])])["next"].token_ids == solo(make, *GOOD[2])


def test_the_async_engine_raises_the_error_for_that_request_and_serves_the_others(make):
    async def go():
        engine = AsyncEngine(make(logits_hook=NanLogits("hostile")), asyncio.get_running_loop())

        async def tokens(rid, prompt, params):
            try:
                return [t async for o in engine.generate(EngineRequest(rid, tuple(prompt), params))
                        for t in o.token_ids]
            except SequenceError as e:
                return e

        try:
            got = await asyncio.gather(*(tokens(r, p, s) for r, p, s in good_reqs()),
                                       tokens("hostile", HOSTILE_PROMPT, GOOD[0][1]))
            nxt = await tokens("next", *GOOD[0])
            return got, nxt, engine._thread.is_alive()
        finally:
            await engine.close()

    got, nxt, alive = asyncio.run(asyncio.wait_for(go(), 60))
    assert list(got[:3]) == [solo(make, p, s) for p, s in GOOD]
    assert isinstance(got[3], SequenceError) and "hostile" in str(got[3]) and not got[3].client_fault
    assert nxt == solo(make, *GOOD[0]) and alive
