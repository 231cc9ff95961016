"""Per-token log-probabilities from the native engine: the model's own distribution (fp32 log-softmax of its
logits, before temperature and filters) at each generated position, equal to Hugging Face's on the same weights;
the N most likely in order; carried across a PD hand-off with the first token; a failure computing them fails
that request alone."""

from __future__ import annotations

import asyncio

import pytest
import torch
from kvmesh.contracts.engine import EngineRequest, ExportPlan, TokenLogprobs
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.model_source.hf_config import ModelConfig

from .helpers import engine_from_hf, hf_tiny, prompt_logits, pushed, req, run

PROMPT = [11, 42, 7, 7, 130, 66, 201]
N = 5


CFG = ModelConfig.tiny()


@pytest.fixture(scope="module")
def hf():
    return hf_tiny(CFG)


@pytest.fixture
def make(hf):
    return lambda **kw: engine_from_hf(hf, CFG, attention="torch", **kw)


def hf_log_softmax(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Hugging Face's log-probabilities at each generated position ``[len(tokens), vocab]``."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_matches(entries: list[TokenLogprobs], tokens: list[int], reference: torch.Tensor, n: int) -> None:
    """Each entry: its token, that token's logprob in ``reference``, and ``reference``'s n best in order."""
    assert [e.token_id for e in entries] == tokens
    for e, row in zip(entries, reference, strict=True):
        assert e.logprob == pytest.approx(row[e.token_id].item(), abs=1e-4)
        values, ids = row.topk(n)
        assert [t for t, _ in e.top] == ids.tolist()
        assert [v for _, v in e.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_a_greedy_runs_logprobs_are_the_log_softmax_of_the_models_logits_at_each_position(make):
    (out,) = make().generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=N))
    engine = make(enable_prefix_caching=False)
    rows = [prompt_logits(engine, PROMPT + out.token_ids[:i])[0] for i in range(len(out.token_ids))]
    assert_matches(out.logprobs, out.token_ids, torch.log_softmax(torch.stack(rows).float(), dim=-1), N)


def test_a_greedy_runs_logprobs_equal_hugging_faces(hf, make):
    (out,) = make().generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=N))
    assert_matches(out.logprobs, out.token_ids, hf_log_softmax(hf, PROMPT, out.token_ids), N)
    assert all(e.top[0][0] == e.token_id for e in out.logprobs)  # greedy: the sampled token is the best


def test_sampled_tokens_report_the_models_distribution_not_the_tempered_one(hf, make):
    params = SamplingParams(max_tokens=6, temperature=1.7, top_k=40, top_p=0.8, seed=3, ignore_eos=True,
                            logprobs=N)
    (out,) = make().generate([PROMPT], params)
    assert_matches(out.logprobs, out.token_ids, hf_log_softmax(hf, PROMPT, out.token_ids), N)


def test_the_top_n_are_ordered_most_likely_first_and_the_sampled_tokens_logprob_is_there(make):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True, logprobs=20)
    (out,) = make().generate([PROMPT], params)
    assert len(out.logprobs) == len(out.token_ids) == 8
    for e in out.logprobs:
        values = [v for _, v in e.top]
        assert len(e.top) == 20 and values == sorted(values, reverse=True)
        assert e.logprob <= values[0] <= 0.0
        assert dict(e.top).get(e.token_id, e.logprob) == e.logprob  # where it is among the best, the same value


def test_logprobs_zero_gives_the_sampled_tokens_alone_and_none_gives_nothing(make):
    with_zero, without = make().generate([PROMPT, PROMPT], [SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0),
                                                            SamplingParams(max_tokens=4, ignore_eos=True)])
    assert [e.token_id for e in with_zero.logprobs] == with_zero.token_ids
    assert all(e.top == () for e in with_zero.logprobs)
    assert without.logprobs == [] and without.token_ids == with_zero.token_ids


def test_rows_asking_different_n_in_one_batch_each_get_their_own(make):
    asks = [None, 0, 3, 20]
    outs = make().generate([PROMPT] * 4, [SamplingParams(max_tokens=3, ignore_eos=True, logprobs=n) for n in asks])
    assert [len(o.logprobs[0].top) if o.logprobs else None for o in outs] == [None, 0, 3, 20]
    assert outs[2].logprobs[0].top == outs[3].logprobs[0].top[:3]


def test_a_failing_logprob_computation_fails_that_request_alone(make, monkeypatch):
    from kvmesh.engine import llm_engine

    real = llm_engine.token_logprobs

    def exploding(logits, tokens, tops):
        if 7 in tops:  # the hostile request asks for 7
            raise RuntimeError("logprobs exploded")
        return real(logits, tokens, tops)

    monkeypatch.setattr(llm_engine, "token_logprobs", exploding)
    engine = make()
    good = [SamplingParams(max_tokens=5, ignore_eos=True, logprobs=2),
            SamplingParams(max_tokens=5, temperature=0.9, seed=4, ignore_eos=True, logprobs=0),
            SamplingParams(max_tokens=5, ignore_eos=True)]
    prompts = [[5, 17, 33, 2, 99], [40, 41, 42, 43], [200, 3, 9]]
    done = run(engine, [*((f"good-{i}", p, s) for i, (p, s) in enumerate(zip(prompts, good))),
                        ("hostile", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True, logprobs=7))])
    err = done["hostile"].error
    assert err is not None and not err.client_fault and "logprobs exploded" in str(err)
    assert done["hostile"].finish_reason == "error" and done["hostile"].token_ids == []
    monkeypatch.setattr(llm_engine, "token_logprobs", real)
    for i, (p, s) in enumerate(zip(prompts, good)):
        (alone,) = make().generate([p], s)
        got = done[f"good-{i}"]
        assert got.error is None and got.token_ids == alone.token_ids and got.logprobs == alone.logprobs
    assert engine.blocks.num_free_blocks + engine.blocks.num_cached_blocks == engine.kv.num_blocks


def test_an_imported_first_token_carries_the_logprobs_prefill_computed(make):
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=N)
    (whole,) = make().generate([PROMPT], params)
    prefill = make()
    prefill.add_request(req("p", PROMPT, SamplingParams(max_tokens=1, ignore_eos=True, logprobs=N),
                            export=ExportPlan()))
    (first,) = [o for o in prefill.step().outputs if o.new_token_ids]
    decode = make()
    decode.add_request(req("d", PROMPT, params, imported=pushed(decode.layout, first.exported.blocks, len(PROMPT),
                                                                first.new_token_ids[0],
                                                                first_logprobs=first.logprobs[0])))
    while decode.has_unfinished():
        decode.step()
    out = decode.completion("d")
    assert out.cached_tokens == len(PROMPT)  # imported, not recomputed
    assert out.token_ids == whole.token_ids
    assert out.logprobs[0] == first.logprobs[0]
    for got, want in zip(out.logprobs, whole.logprobs, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]


def test_a_pushed_first_token_without_the_logprobs_asked_for_is_recomputed(make):
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2)
    prefill = make()
    prefill.add_request(req("p", PROMPT, SamplingParams(max_tokens=1, ignore_eos=True), export=ExportPlan()))
    (first,) = [o for o in prefill.step().outputs if o.new_token_ids]
    decode = make()
    decode.add_request(req("d", PROMPT, params, imported=pushed(decode.layout, first.exported.blocks, len(PROMPT),
                                                                first.new_token_ids[0])))
    while decode.has_unfinished():
        decode.step()
    out = decode.completion("d")
    (alone,) = make().generate([PROMPT], params)
    assert out.cached_tokens == 0 and out.token_ids == alone.token_ids and out.logprobs == alone.logprobs


def test_the_async_engine_hands_them_over_with_each_output(make):
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3)

    async def go():
        engine = AsyncEngine(make(), asyncio.get_running_loop())
        try:
            return [o async for o in engine.generate(EngineRequest("r", tuple(PROMPT), params))]
        finally:
            await engine.close()

    outs = asyncio.run(asyncio.wait_for(go(), 60))
    (alone,) = make().generate([PROMPT], params)
    assert all(len(o.logprobs) == len(o.token_ids) for o in outs)
    assert [lp for o in outs for lp in o.logprobs] == alone.logprobs
