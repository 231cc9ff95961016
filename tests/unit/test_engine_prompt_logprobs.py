"""Prompt log-probabilities from the native engine (``SamplingParams.prompt_logprobs``): each prompt token's
logprob after the first under the model's distribution at the position before it, its rank there and the N most
likely, equal to Hugging Face's on the same weights; computed over the whole prompt even when a prefix is cached,
in chunks as the prefill runs; a failure computing them fails that request alone."""

from __future__ import annotations

import asyncio

import pytest
import torch
from kvmesh.contracts.engine import EngineRequest, TokenLogprobs
from kvmesh.contracts.sampling import PROMPT_LOGPROBS, SamplingParams
from kvmesh.engine import llm_engine
from kvmesh.engine.async_engine import AsyncEngine

from .helpers import engine_from_hf, pushed, req, run

PROMPT = [11, 42, 7, 7, 130, 66, 201, 5, 9, 9, 31, 17, 250, 3]
N = 4


@pytest.fixture
def make(hf, cfg):  # hf, cfg: the tiny model (conftest)
    return lambda **kw: engine_from_hf(hf, cfg, attention="torch", **kw)


def reference(hf, prompt: list[int]) -> torch.Tensor:
    """Hugging Face's log-probabilities at each prompt position but the last ``[len(prompt) - 1, vocab]``."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_scores(entries: list[TokenLogprobs], prompt: list[int], ref: torch.Tensor, n: int) -> None:
    """One entry per prompt token after the first: the token, its logprob, rank and the n best in ``ref``."""
    assert [e.token_id for e in entries] == prompt[1:]
    for e, row in zip(entries, ref, strict=True):
        assert e.logprob == pytest.approx(row[e.token_id].item(), abs=1e-4)
        assert e.rank == int((row > row[e.token_id] + 1e-5).sum()) + 1
        values, ids = row.topk(n)
        assert [t for t, _ in e.top] == ids.tolist()
        assert [v for _, v in e.top] == pytest.approx(values.tolist(), abs=1e-4)


def scored(n: int | None = N, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 3), ignore_eos=True, prompt_logprobs=n, **kw)


def test_each_prompt_tokens_logprob_rank_and_top_n_equal_hugging_faces(hf, make):
    (out,) = make().generate([PROMPT], scored())
    assert_scores(out.prompt_logprobs, PROMPT, reference(hf, PROMPT), N)
    assert out.cached_tokens == 0 and len(out.token_ids) == 3


def test_zero_gives_each_tokens_own_logprob_and_rank_alone(hf, make):
    (out,) = make().generate([PROMPT], scored(0))
    assert_scores(out.prompt_logprobs, PROMPT, reference(hf, PROMPT), 0)
    assert all(e.top == () and e.rank >= 1 for e in out.prompt_logprobs)


def test_none_computes_nothing_and_a_one_token_prompt_has_nothing_to_score(make):
    (plain,) = make().generate([PROMPT], SamplingParams(max_tokens=2, ignore_eos=True))
    (single,) = make().generate([[42]], scored())
    assert plain.prompt_logprobs == [] and single.prompt_logprobs == [] and len(single.token_ids) == 3


def test_a_prompt_prefilled_in_chunks_scores_as_one_pass_does(hf, make):
    """A step budget of 5 tokens cuts the 14-token prompt into 3 chunks (each scores its own rows)."""
    (out,) = make(max_batched_tokens=5).generate([PROMPT], scored())
    assert_scores(out.prompt_logprobs, PROMPT, reference(hf, PROMPT), N)


def test_logits_are_taken_a_slice_of_rows_at_a_time(hf, make, monkeypatch):
    monkeypatch.setattr(llm_engine, "PROMPT_LOGPROB_ROWS", 3)
    engine = make()
    calls = []
    real = engine.model.logits
    engine.model.logits = lambda h: calls.append(h.shape[0]) or real(h)
    (out,) = engine.generate([PROMPT], scored())
    assert_scores(out.prompt_logprobs, PROMPT, reference(hf, PROMPT), N)
    assert max(calls) == 3 and sum(calls) == len(PROMPT) - 1


def test_a_cached_prefix_is_computed_again_and_what_follows_reuses_the_cache(hf, make):
    engine = make()
    engine.generate([PROMPT], SamplingParams(max_tokens=1, ignore_eos=True))  # the prompt's blocks now cached
    (out,) = engine.generate([PROMPT], scored())
    assert out.cached_tokens == 0
    assert_scores(out.prompt_logprobs, PROMPT, reference(hf, PROMPT), N)
    (again,) = engine.generate([PROMPT], SamplingParams(max_tokens=1, ignore_eos=True))
    assert again.cached_tokens > 0  # its blocks went (back) into the cache for the next request


def test_a_scoring_request_beside_others_changes_none_of_their_tokens(make):
    other = [3, 1, 4, 1, 5, 9, 2, 6]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = make().generate([other], greedy)[0].token_ids
    done = run(make(), [("s", PROMPT, scored(max_tokens=6)), ("o", other, greedy)])
    assert done["o"].token_ids == alone and done["o"].prompt_logprobs == []
    assert len(done["s"].prompt_logprobs) == len(PROMPT) - 1
    assert done["s"].token_ids == make().generate([PROMPT], greedy)[0].token_ids  # its own output unchanged too


def test_a_failure_computing_them_fails_that_request_alone(make):
    engine = make()

    def exploding(h: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("lm_head exploded")

    engine.model.logits = exploding
    other = [3, 1, 4, 1, 5, 9, 2, 6]
    done = run(engine, [("s", PROMPT, scored()), ("o", other, SamplingParams(max_tokens=4, ignore_eos=True))])
    assert done["s"].error is not None and "prompt's logprobs" in str(done["s"].error)
    assert done["o"].error is None and len(done["o"].token_ids) == 4
    assert engine.blocks.num_free_blocks + engine.blocks.num_cached_blocks >= engine.kv.num_blocks - 1


def test_a_pushed_prompt_is_recomputed_for_them(hf, make):
    """Pushed KV brings no prompt logits: decode computes the prompt itself rather than answer without them."""
    prefill = make()
    (first,) = prefill.generate([PROMPT], SamplingParams(max_tokens=1, ignore_eos=True))
    blocks = prefill.kv.read_blocks(list(range(len(PROMPT) // 4)))
    decode = make()
    decode.add_request(req("p", PROMPT, scored(), imported=pushed(decode.layout, blocks, (len(PROMPT) // 4) * 4,
                                                                  first.token_ids[0])))
    while decode.has_unfinished():
        decode.step()
    out = decode.completion("p")
    assert out.cached_tokens == 0
    assert_scores(out.prompt_logprobs, PROMPT, reference(hf, PROMPT), N)


def test_a_continued_request_may_not_ask_for_them():
    with pytest.raises(ValueError, match="first run"):
        EngineRequest("c", tuple(PROMPT), scored(), generated=2)


def test_they_are_checked_and_name_their_feature():
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)
    assert PROMPT_LOGPROBS in scored().features and PROMPT_LOGPROBS not in SamplingParams().features


def test_the_async_engine_hands_them_over_with_the_first_output_only(hf, make):
    async def go():
        engine = AsyncEngine(make(), asyncio.get_running_loop())
        try:
            return [o async for o in engine.generate(EngineRequest("r", tuple(PROMPT), scored()))]
        finally:
            await engine.close()

    outs = asyncio.run(asyncio.wait_for(go(), 60))
    assert_scores(list(outs[0].prompt_logprobs), PROMPT, reference(hf, PROMPT), N)
    assert all(o.prompt_logprobs == () for o in outs[1:])
