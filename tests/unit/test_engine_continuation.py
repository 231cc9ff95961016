"""A request continued on another engine after the first stopped (``EngineRequest.generated``: a migrated
request): the prompt plus the tokens already streamed, and the outputs are exactly those the first engine would
have gone on to give — tokens, text deltas, seeded draws, the grammar, stop strings across the seam, max_tokens.
On the tiny random model with the byte tokenizer, whose random output includes partial UTF-8 characters."""

from __future__ import annotations

import dataclasses
import json

import pytest
from kvmesh.contracts.engine import ExportPlan
from kvmesh.contracts.sampling import SamplingParams, StructuredOutput
from kvmesh.engine.llm_engine import LLMEngine

from .helpers import pushed, req

PROMPT = [1, *range(68, 77)]  # the random model's greedy output: 8 bytes that are no UTF-8, then text
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"]}


@pytest.fixture
def make(byte_engine):
    return byte_engine


def stream(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams, **kw) -> tuple[list, str, str]:
    """Run one request to its end: its tokens, the text of its deltas, and its finish reason."""
    engine.add_request(req(rid, prompt, params, **kw))
    tokens, text, reason = [], "", None
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.request_id == rid:
                assert out.error is None, out.error
                tokens += out.new_token_ids
                text += out.text_delta
                reason = out.finish_reason or reason
    engine.release(rid)
    return tokens, text, reason


def continued(make, params: SamplingParams, at: int, prompt: list[int] = PROMPT) -> tuple[tuple, tuple]:
    """The whole run on one engine, and the same request stopped after ``at`` tokens and continued on another:
    (tokens, text, finish reason) of each, the continued one's being the first part plus the rest."""
    whole = stream(make(), "whole", prompt, params)
    first = whole[0][:at]
    first_text = stream(make(), "first", prompt, _cut(params, at))[1]
    rest = stream(make(), "rest", prompt + first, params, generated=at)
    return whole, (first + rest[0], first_text + rest[1], rest[2])


def _cut(params: SamplingParams, n: int) -> SamplingParams:
    """The same request, ending after ``n`` tokens: what the first instance streamed before it died."""
    return dataclasses.replace(params, max_tokens=n)


@pytest.mark.parametrize("at", [1, 7, 13])
def test_a_greedy_request_continued_elsewhere_gives_the_uninterrupted_tokens_and_text(make, at):
    whole, cont = continued(make, SamplingParams(max_tokens=20, ignore_eos=True), at)
    assert cont == whole and whole[2] == "length"


def test_seeded_sampling_continues_its_sequence(make):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    whole, cont = continued(make, params, 6)
    assert cont == whole
    other = stream(make(), "other", PROMPT, dataclasses.replace(params, seed=99))
    assert other[0] != whole[0]  # the draws depend on the seed, so equality above says something


def test_the_tokens_already_generated_count_towards_max_tokens(make):
    tokens, _, reason = stream(make(), "r", PROMPT + [50, 51, 52], SamplingParams(max_tokens=5, ignore_eos=True),
                               generated=3)
    assert len(tokens) == 2 and reason == "length"


def test_a_stop_string_across_the_seam_stops_the_continued_request(make):
    prompt = [1, *range(89, 98)]  # the random model's greedy text: 4 x "^", then "?"s
    free = SamplingParams(max_tokens=24, ignore_eos=True)
    _, text, _ = stream(make(), "probe", prompt, free)
    # a stop string from the text the first 4 tokens gave into what the next ones give
    head = stream(make(), "head", prompt, _cut(free, 4))[1]
    stop = head[-2:] + text[len(head):len(head) + 2]
    assert len(stop) == 4 and stop not in head
    whole, cont = continued(make, dataclasses.replace(free, stop=(stop,)), 4, prompt)
    assert cont == whole and whole[2] == "stop" and len(whole[0]) < 24


def test_a_structured_request_continues_its_grammar(make):
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    params = SamplingParams(max_tokens=80, structured=spec)
    whole, cont = continued(make, params, 5)
    assert cont == whole and whole[2] == "stop"
    assert json.loads(whole[1]).keys() == {"name", "n"}


def test_tokens_that_break_the_grammar_are_refused(make):
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    not_json = list(b"hello")  # ids of letters: no JSON starts with one
    with pytest.raises(ValueError, match="do not fit the output's grammar"):
        make().add_request(req("r", PROMPT + not_json, SamplingParams(max_tokens=40, structured=spec),
                               generated=len(not_json)))


@pytest.mark.parametrize("generated", [-1, len(PROMPT), 40])
def test_more_tokens_generated_than_prompt_or_max_tokens_is_refused(make, generated):
    with pytest.raises(ValueError, match="already generated"):
        make().add_request(req("r", PROMPT, SamplingParams(max_tokens=40), generated=generated))


def test_through_pd_prefill_samples_the_next_token_and_decode_goes_on(make):
    """A continuation disaggregated: prefill computes prompt + earlier tokens and samples the next one (max_tokens
    earlier + 1), decode imports the KV with that token and streams the rest: the uninterrupted tail."""
    params = SamplingParams(max_tokens=18, temperature=0.8, seed=7, ignore_eos=True)
    whole = stream(make(), "whole", PROMPT, params)
    at = 6
    prompt = PROMPT + whole[0][:at]
    prefill = make()
    prefill.add_request(req("p", prompt, _cut(params, at + 1), export=ExportPlan(), generated=at))
    outs = []
    while prefill.has_unfinished():
        outs += prefill.step().outputs
    kv, first = outs[-1].exported, outs[-1].new_token_ids[0]
    tokens, _, reason = stream(make(), "d", prompt, params, generated=at,
                               imported=pushed(prefill.layout, kv.blocks, kv.num_tokens, first))
    assert whole[0][:at] + tokens == whole[0] and reason == "length"
