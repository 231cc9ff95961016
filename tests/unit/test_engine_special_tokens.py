"""``SamplingParams.skip_special_tokens``: the output text leaves special tokens out (the default) or keeps them,
the tokens the same either way; and the token that stops the output (EOS, a stop token) adds no text in either
(vLLM's rule). On the tiny random model with the byte tokenizer (special tokens 0 ``<|endoftext|>``,
1 ``<|im_start|>``, 2 ``<|im_end|>``, its EOS), steered with ``logit_bias``."""

from __future__ import annotations

import dataclasses

import pytest
from kvmesh.contracts.sampling import SPECIAL_TOKENS, SamplingParams, sampling_from_proto, sampling_to_proto

from .test_engine_continuation import PROMPT, stream

IM_START, IM_END, A = 1, 2, 68  # A: the byte "A"


def test_special_tokens_are_left_out_of_the_text_unless_asked(byte_engine):
    forced = SamplingParams(max_tokens=4, logit_bias=((IM_START, 100.0),))
    skipped = stream(byte_engine(), "skip", PROMPT, forced)
    kept = stream(byte_engine(), "keep", PROMPT, dataclasses.replace(forced, skip_special_tokens=False))
    assert skipped[0] == kept[0] == [IM_START] * 4
    assert skipped[1] == "" and kept[1] == "<|im_start|>" * 4


def test_the_token_that_stops_the_output_adds_no_text(byte_engine):
    eos = SamplingParams(max_tokens=4, logit_bias=((IM_END, 100.0),), skip_special_tokens=False)
    assert stream(byte_engine(), "eos", PROMPT, eos) == ([IM_END], "", "stop")
    past = stream(byte_engine(), "past", PROMPT, dataclasses.replace(eos, ignore_eos=True))
    assert past == ([IM_END] * 4, "<|im_end|>" * 4, "length")  # not a stop here: its text shows
    stop_a = SamplingParams(max_tokens=4, logit_bias=((A, 100.0),), stop_token_ids=(A,))
    assert stream(byte_engine(), "a", PROMPT, stop_a) == ([A], "", "stop")  # a stop token that is plain text, too
    assert stream(byte_engine(), "a2", PROMPT, dataclasses.replace(stop_a, stop_token_ids=()))[1] == "AAAA"


def test_a_continued_request_keeps_its_special_tokens(byte_engine):
    params = SamplingParams(max_tokens=6, logit_bias=((IM_START, 100.0),), skip_special_tokens=False)
    whole = stream(byte_engine(), "whole", PROMPT, params)
    first = stream(byte_engine(), "first", PROMPT, dataclasses.replace(params, max_tokens=2))
    rest = stream(byte_engine(), "rest", PROMPT + first[0], params, generated=2)
    assert first[1] + rest[1] == whole[1] == "<|im_start|>" * 6


def test_the_wire_and_the_engine_feature():
    keep = SamplingParams(skip_special_tokens=False)
    assert sampling_to_proto(keep).keep_special_tokens and sampling_from_proto(sampling_to_proto(keep)) == keep
    assert not sampling_to_proto(SamplingParams()).keep_special_tokens  # what an older router sends: skip
    assert sampling_from_proto(sampling_to_proto(SamplingParams())).skip_special_tokens
    assert SPECIAL_TOKENS in keep.features and SPECIAL_TOKENS not in SamplingParams().features


@pytest.mark.parametrize("skip", [True, False])
def test_greedy_tokens_do_not_depend_on_the_text_kept(byte_engine, skip):
    params = SamplingParams(max_tokens=12, ignore_eos=True, skip_special_tokens=skip)
    assert stream(byte_engine(), "r", PROMPT, params)[0] == stream(byte_engine(), "r", PROMPT, SamplingParams(
        max_tokens=12, ignore_eos=True))[0]
