"""Logprobs at the router: the OpenAI fields that ask for them (a bad value is a 400 naming its field), the
protocol that carries them, and the two response shapes, which the official ``openai`` types read."""

from __future__ import annotations

import pytest
from kvmesh.contracts.engine import TokenLogprobs, logprobs_from_proto, logprobs_to_proto
from kvmesh.contracts.sampling import SamplingParams, sampling_from_proto, sampling_to_proto
from kvmesh.proto.v1 import common_pb2

from services.router.errors import ErrorKind, RequestError
from services.router.logprobs import LOGPROB_FLOOR, chat_logprobs, completion_logprobs
from services.router.openai_body import sampling_from_body

# ---- asking for them ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("body,chat,want", [
    ({}, False, None), ({"logprobs": None}, False, None), ({"logprobs": 0}, False, 0),
    ({"logprobs": 5}, False, 5), ({"logprobs": 20}, False, 20),
    ({}, True, None), ({"logprobs": False}, True, None), ({"logprobs": True}, True, 0),
    ({"logprobs": True, "top_logprobs": 3}, True, 3), ({"logprobs": True, "top_logprobs": None}, True, 0),
    ({"top_logprobs": 0}, True, None), ({"logprobs": False, "top_logprobs": 0}, True, None),
])
def test_the_fields_ask_for_each_tokens_logprob_and_the_n_most_likely(body, chat, want):
    assert sampling_from_body(body, chat)[0].logprobs == want


@pytest.mark.parametrize("body,chat,words", [
    ({"logprobs": -1}, False, "logprobs must be an integer in [0, 20], not -1"),
    ({"logprobs": 21}, False, "logprobs must be an integer in [0, 20], not 21"),
    ({"logprobs": True}, False, "logprobs must be an integer, not a boolean"),
    ({"logprobs": "3"}, False, "logprobs must be an integer, not a string"),
    ({"logprobs": True, "top_logprobs": -1}, True, "top_logprobs must be an integer in [0, 20], not -1"),
    ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs must be an integer in [0, 20], not 21"),
    ({"logprobs": True, "top_logprobs": 2.5}, True, "top_logprobs must be an integer"),
    ({"top_logprobs": 2}, True, 'top_logprobs needs "logprobs": true'),
    ({"logprobs": False, "top_logprobs": 20}, True, 'top_logprobs needs "logprobs": true'),
    ({"logprobs": 5}, True, "logprobs must be true or false, not an integer"),
])
def test_a_bad_logprobs_field_is_invalid_naming_it(body, chat, words):
    with pytest.raises(RequestError) as e:
        sampling_from_body(body, chat)
    assert e.value.kind == ErrorKind.INVALID and words in e.value.message
    assert e.value.kind.http == 400


@pytest.mark.parametrize("n", [None, 0, 7, 20])
def test_the_ask_travels_to_prefill_and_decode(n):
    p = SamplingParams(logprobs=n)
    assert sampling_from_proto(sampling_to_proto(p)) == p


def test_a_grpc_ask_out_of_range_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"logprobs must be in \[0, 20\]"):
        sampling_from_proto(common_pb2.SamplingParams(logprobs=21))


def test_token_logprobs_cross_the_protocol_as_float32():
    lp = TokenLogprobs(9, -0.5, ((9, -0.5), (3, -1.25), (70000, -30.0)))
    assert logprobs_from_proto(logprobs_to_proto(lp)) == lp
    assert logprobs_from_proto(logprobs_to_proto(TokenLogprobs(1, -2.0))) == TokenLogprobs(1, -2.0)


def test_top_ids_without_their_logprobs_do_not_read():
    with pytest.raises(ValueError, match="2 top token ids but 1 logprobs"):
        logprobs_from_proto(common_pb2.TokenLogprobs(token_id=1, top_token_ids=[1, 2], top_logprobs=[-1.0]))


# ---- the response shapes ------------------------------------------------------------------------------------

TEXTS = {1: "Hel", 2: "lo", 3: " world", 4: "!", 5: "é"}
STEPS = [TokenLogprobs(1, -0.25, ((1, -0.25), (4, -2.0))),
         TokenLogprobs(2, -3.0, ((3, -0.5), (4, -1.0))),    # sampled, not among the most likely
         TokenLogprobs(5, float("-inf"), ((3, -0.1), (4, -1.5)))]


def text(token_id: int) -> str:
    return TEXTS[token_id]


def test_completions_list_each_token_its_logprob_the_most_likely_and_where_it_starts():
    got = completion_logprobs([(STEPS[:2], "Hello"), (STEPS[2:], "é")], text)
    assert got["tokens"] == ["Hel", "lo", "é"]
    assert got["token_logprobs"] == [-0.25, -3.0, LOGPROB_FLOOR]
    assert got["top_logprobs"] == [{"Hel": -0.25, "!": -2.0}, {" world": -0.5, "!": -1.0, "lo": -3.0},
                                   {" world": -0.1, "!": -1.5, "é": LOGPROB_FLOOR}]
    assert got["text_offset"] == [0, 3, 5]


def test_a_streamed_piece_starts_where_the_text_streamed_before_it_ends():
    assert completion_logprobs([(STEPS[1:2], "lo")], text, offset=3)["text_offset"] == [3]
    assert completion_logprobs([([], "")], text, offset=3)["tokens"] == []


def test_chat_lists_each_token_with_its_bytes_and_the_most_likely_in_order():
    got = chat_logprobs(STEPS[1:], text)
    assert got["refusal"] is None
    first, second = got["content"]
    assert first == {"token": "lo", "logprob": -3.0, "bytes": [108, 111], "top_logprobs": [
        {"token": " world", "logprob": -0.5, "bytes": list(b" world")},
        {"token": "!", "logprob": -1.0, "bytes": [33]}]}
    assert second["token"] == "é" and second["bytes"] == [0xC3, 0xA9] and second["logprob"] == LOGPROB_FLOOR


def test_the_official_openai_types_read_both_shapes():
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    completion = Completion.model_validate({
        "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "text": "Hello", "finish_reason": "length",
                     "logprobs": completion_logprobs([(STEPS[:2], "Hello")], text)}]})
    assert completion.choices[0].logprobs.top_logprobs[1]["lo"] == -3.0
    chat = ChatCompletion.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hello"},
                     "logprobs": chat_logprobs(STEPS, text)}]})
    assert chat.choices[0].logprobs.content[1].top_logprobs[0].token == " world"
    chunk = ChatCompletionChunk.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None,
                     "logprobs": chat_logprobs(STEPS[1:2], text)}]})
    assert chunk.choices[0].logprobs.content[0].logprob == -3.0
