"""The engine's logit adjustments on a tiny random Llama: penalties give the tokens a reference loop over
transformers' logits gives with vLLM's formulas, a request continued from its earlier output (migration, PD)
penalizes those tokens too, logit_bias and min_tokens steer greedy decoding, and a penalized request leaves its
batch neighbours' tokens as they are alone."""

import pytest
import torch
from kvmesh.contracts.sampling import SamplingParams

from .helpers import engine_from_hf, req

PROMPT = [11, 42, 7, 7, 130, 66, 201, 5, 5, 5]


@pytest.fixture
def engine(hf, cfg):
    return engine_from_hf(hf, cfg, attention="torch")


def reference(hf, prompt: list[int], n: int, p: SamplingParams, earlier: int = 0) -> list[int]:
    """Greedy tokens with the penalties applied by hand (vLLM's formulas) to transformers' logits; ``earlier``:
    the prompt's last tokens are this request's own earlier output."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].clone()
        generated = prompt[len(prompt) - earlier:] + out if earlier else list(out)
        for t in set(prompt + out):
            logits[t] = logits[t] / p.repetition_penalty if logits[t] > 0 else logits[t] * p.repetition_penalty
        for t in set(generated):
            logits[t] -= p.frequency_penalty * generated.count(t) + p.presence_penalty
        out.append(int(logits.argmax()))
    return out


PENALIZED = SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.4,
                           repetition_penalty=1.3)


def test_penalized_greedy_tokens_equal_the_reference(hf, engine):
    (out,) = engine.generate([PROMPT], PENALIZED)
    assert out.token_ids == reference(hf, PROMPT, 12, PENALIZED)
    (plain,) = engine.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))
    assert out.token_ids != plain.token_ids  # the penalties did something here


def test_a_continued_request_penalizes_its_earlier_output_too(hf, engine):
    first = reference(hf, PROMPT, 4, PENALIZED)
    engine.add_request(req("c", PROMPT + first, PENALIZED, generated=4))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step().outputs if o.request_id == "c" for t in o.new_token_ids]
    assert first + tokens == reference(hf, PROMPT, 12, PENALIZED)


def test_logit_bias_and_min_tokens_steer_greedy_decoding(engine):
    (plain,) = engine.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))
    x = next(t for t in range(50, 250) if t not in plain.token_ids)
    (forced,) = engine.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=((x, 100.0),)))
    assert forced.token_ids == [x] * 6
    (banned,) = engine.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True,
                                                         logit_bias=((plain.token_ids[0], -100.0),)))
    assert banned.token_ids[0] != plain.token_ids[0]
    # x is a stop token the bias makes the best one: min_tokens keeps it out of the first 3, the 4th ends it
    (late,) = engine.generate([PROMPT], SamplingParams(max_tokens=10, stop_token_ids=(x,), min_tokens=3,
                                                       logit_bias=((x, 100.0),)))
    assert len(late.token_ids) == 4 and x not in late.token_ids[:3] and late.token_ids[3] == x
    assert late.finish_reason == "stop"


def test_a_penalized_request_leaves_its_neighbours_tokens_as_they_are_alone(engine):
    plain = SamplingParams(max_tokens=8, ignore_eos=True)
    (alone,) = engine.generate([PROMPT[:6]], plain)
    engine.add_request(req("p", PROMPT, PENALIZED))
    engine.add_request(req("q", PROMPT[:6], plain))
    tokens: dict[str, list[int]] = {"p": [], "q": []}
    while engine.has_unfinished():
        for o in engine.step().outputs:
            tokens[o.request_id] += o.new_token_ids
    assert tokens["q"] == alone.token_ids and len(tokens["p"]) == 12
