"""The prompt's logprobs at the router: vLLM's ``prompt_logprobs`` and a completion's ``echo`` read from a body
(with errors naming the field), their response shapes, and a request that needs them sent only to instances whose
heartbeat says they compute them."""

from __future__ import annotations

import types

import pytest
from kvmesh.contracts.engine import TokenLogprobs
from kvmesh.contracts.messages import FEATURES, Heartbeat, InstanceLoad
from kvmesh.contracts.sampling import PROMPT_LOGPROBS

from services.router import openai_body
from services.router.core import Router
from services.router.errors import ErrorKind, RequestError
from services.router.logprobs import completion_logprobs, echoed_logprobs, joined, prompt_logprobs_json
from services.router.registry import Instance


def sampling(chat: bool = False, **body):
    return openai_body.sampling_from_body({"prompt": "x", **body}, chat)[0]


def refused(words: str, chat: bool = False, **body) -> None:
    with pytest.raises(RequestError) as e:
        sampling(chat, **body)
    assert e.value.kind == ErrorKind.INVALID and words in e.value.message, e.value.message


def test_prompt_logprobs_is_read_on_both_endpoints():
    assert sampling(prompt_logprobs=3).prompt_logprobs == 3
    assert sampling(True, prompt_logprobs=0).prompt_logprobs == 0
    assert sampling().prompt_logprobs is None and sampling(logprobs=2).prompt_logprobs is None


def test_echo_with_logprobs_scores_the_prompt_with_as_many_alternatives():
    assert sampling(echo=True, logprobs=2).prompt_logprobs == 2
    assert sampling(echo=True).prompt_logprobs is None  # the prompt's text alone: nothing to score
    assert sampling(echo=True, logprobs=1, prompt_logprobs=4).prompt_logprobs == 4  # the explicit field wins


def test_echo_with_max_tokens_zero_generates_one_token_the_answer_leaves_out():
    p = sampling(echo=True, logprobs=1, max_tokens=0)
    assert p.max_tokens == 1
    assert openai_body.shape({"echo": True, "max_tokens": 0}).echo_only
    assert not openai_body.shape({"echo": True, "max_tokens": 1}).echo_only
    refused("max_tokens must be >= 1", max_tokens=0)  # without echo there is nothing to answer


@pytest.mark.parametrize("body,words", [
    ({"prompt_logprobs": -1}, "the whole vocabulary"),
    ({"prompt_logprobs": 21}, "prompt_logprobs must be an integer in [0, 20]"),
    ({"prompt_logprobs": "5"}, "prompt_logprobs must be an integer"),
    ({"prompt_logprobs": 1, "stream": True}, "not a stream"),
])
def test_bad_prompt_logprobs_are_400s_naming_the_field(body, words):
    refused(words, **body)


def test_a_chats_echo_scores_nothing():
    """A chat's echo repeats its last message in the answer (vLLM's rule); it asks the engines for nothing."""
    assert sampling(True, echo=True, logprobs=True, top_logprobs=2).prompt_logprobs is None
    refused("max_tokens must be >= 1", True, echo=True, max_tokens=0)


def test_the_shape_says_whether_the_answer_carries_the_field():
    assert openai_body.shape({"prompt_logprobs": 0}).prompt_logprobs
    assert not openai_body.shape({"echo": True, "logprobs": 1}).prompt_logprobs


def text(token_id: int) -> str:
    return f"<{token_id}>"


SCORED = (TokenLogprobs(7, -1.5, ((9, -0.5), (7, -1.5)), 2), TokenLogprobs(8, -0.25, ((8, -0.25), (1, -2.0)), 1))


def test_an_echoed_prompt_reads_as_the_legacy_shape_its_first_token_without_a_logprob():
    out = echoed_logprobs([5, 7, 8], SCORED, text)
    assert out == {"tokens": ["<5>", "<7>", "<8>"], "token_logprobs": [None, -1.5, -0.25],
                   "top_logprobs": [None, {"<9>": -0.5, "<7>": -1.5}, {"<8>": -0.25, "<1>": -2.0}],
                   "text_offset": [0, 3, 6]}
    then = completion_logprobs([((TokenLogprobs(3, -0.1, ((3, -0.1),)),), "<3>")], text, 9)
    assert joined(out, then)["text_offset"] == [0, 3, 6, 9]
    assert joined(out, then)["token_logprobs"] == [None, -1.5, -0.25, -0.1]


def test_a_token_that_is_not_among_the_best_is_added_to_its_alternatives():
    out = echoed_logprobs([5, 7], (TokenLogprobs(7, -9.0, ((9, -0.5),), 40),), text)
    assert out["top_logprobs"][1] == {"<9>": -0.5, "<7>": -9.0}


def test_vllms_prompt_logprobs_field_names_each_token_its_rank_and_text():
    out = prompt_logprobs_json(SCORED, text)
    assert out[0] is None and len(out) == 3
    assert out[1] == {"7": {"logprob": -1.5, "rank": 2, "decoded_token": "<7>"},
                      "9": {"logprob": -0.5, "rank": 1, "decoded_token": "<9>"}}
    assert list(out[2]) == ["8", "1"] and out[2]["1"]["rank"] == 2
    assert prompt_logprobs_json((TokenLogprobs(4, float("-inf"), (), 9),), text)[1]["4"]["logprob"] == -9999.0


def inst(iid: str, features: tuple[str, ...]) -> Instance:
    beat = Heartbeat(instance_id=iid, role="both", grpc_address="", transfer_address="", ts=0.0,
                     load=InstanceLoad(), model="m", block_size=16, features=features)
    return Instance(beat, 0.0)


def test_a_scoring_request_skips_instances_that_do_not_compute_prompt_logprobs():
    router = types.SimpleNamespace(registry=types.SimpleNamespace(alive=lambda: fleet))
    fleet = [inst("new", FEATURES), inst("old", ("logits",))]
    assert PROMPT_LOGPROBS in FEATURES
    assert Router._lacking(router, (PROMPT_LOGPROBS,)) == {"old"}  # type: ignore[arg-type]
    fleet = [inst("old", ("logits",))]
    with pytest.raises(RequestError) as e:
        Router._lacking(router, (PROMPT_LOGPROBS,))  # type: ignore[arg-type]
    assert e.value.kind == ErrorKind.UNAVAILABLE and "prompt_logprobs" in e.value.message


def test_a_scored_prompts_misses_are_its_own_not_the_caches():
    """The chosen instance held the whole prompt (the index said so) and computed it anyway, because the request
    scored it: the misses are ``scored``, not a stale index that would send operators looking for a cache fault."""
    from services.router.hits import HitLedger, Routed

    keys = list(range(100, 116))
    ledger = HitLedger(block_size=4)

    def causes(scored: bool) -> dict[str, int]:
        routed = Routed(keys, keys, seed=7, compute="a", indexed={"a": 16}, scored=scored)
        return ledger.settle(routed, 66, 0).by_cause()

    assert causes(True) == {"scored": 64, "partial_block": 2}
    assert "scored" not in causes(False)


def test_kept_special_tokens_skip_instances_that_would_drop_them():
    """An engine of a build before ``keep_special_tokens`` would leave the special tokens out of the text (the
    field unknown to it): such a request goes only where the heartbeat says ``special_tokens``."""
    from kvmesh.contracts.sampling import SPECIAL_TOKENS, SamplingParams

    router = types.SimpleNamespace(registry=types.SimpleNamespace(alive=lambda: fleet))
    fleet = [inst("new", FEATURES), inst("old", ("logits", "prompt_logprobs"))]
    needs = SamplingParams(skip_special_tokens=False).features
    assert needs == (SPECIAL_TOKENS,) and SPECIAL_TOKENS in FEATURES
    assert Router._lacking(router, needs) == {"old"}  # type: ignore[arg-type]
    fleet = [inst("old", ("logits",))]
    with pytest.raises(RequestError) as e:
        Router._lacking(router, needs)  # type: ignore[arg-type]
    assert "skip_special_tokens false" in e.value.message
