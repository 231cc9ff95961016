"""OpenAI's and vLLM's logit adjustments through the real stack (1 prefill + 1 decode, the default model): each
changes the greedy answer the way it says, through PD (prefill samples the first token, decode the rest), over
HTTP and the gRPC SDK, and a bad value is a 400 naming it."""

from __future__ import annotations

from collections import Counter

import pytest

from .test_mesh import openai_client, post

pytestmark = pytest.mark.slow
PROMPT = "List the days of the week, then list them again, and again:"


def complete(mesh, **extra) -> dict:
    status, out, _ = post(mesh, "/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                                                    "return_token_ids": True, **extra})
    assert status == 200, out
    return out["choices"][0]


def repeats(ids: list[int]) -> int:
    return sum(n - 1 for n in Counter(ids).values())


def test_penalties_change_the_greedy_answer_and_cut_its_repeats(mesh):
    plain = complete(mesh)
    for extra in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 1.8}):
        penalized = complete(mesh, **extra)
        assert penalized["token_ids"] != plain["token_ids"], extra
        assert repeats(penalized["token_ids"]) < repeats(plain["token_ids"]), (extra, penalized["text"])


def test_logit_bias_forces_and_bans_tokens_from_the_first_one_on(mesh):
    plain = complete(mesh, max_tokens=4)
    first = plain["token_ids"][0]
    banned = complete(mesh, max_tokens=4, logit_bias={str(first): -100})
    assert banned["token_ids"][0] != first  # the first token comes from prefill: it applies the bias too
    forced = complete(mesh, max_tokens=4, logit_bias={"1000": 100})
    assert forced["token_ids"] == [1000] * 4


def test_min_tokens_holds_off_the_end(mesh):
    stop = complete(mesh)["token_ids"][2]  # the greedy answer's third token, made a stop token
    early = complete(mesh, stop_token_ids=[stop])
    assert early["finish_reason"] == "stop" and len(early["token_ids"]) <= 3
    held = complete(mesh, stop_token_ids=[stop], min_tokens=10)
    assert len(held["token_ids"]) >= 10 and stop not in held["token_ids"][:10]


def test_the_sdk_sends_them_and_bad_values_are_400s(mesh):
    from kvmesh.client import KvmeshClient

    with KvmeshClient(f"127.0.0.1:{mesh.grpc_port}") as client:
        c = client.complete(PROMPT, max_tokens=4, temperature=0, logit_bias={1000: 100.0})
    assert c.token_ids == [1000] * 4
    for extra, words in (({"logit_bias": {"99999999": 1}}, "logit_bias names token 99999999"),
                         ({"min_p": -1}, "min_p must be in [0, 1]"), ({"best_of": 2}, "best_of is not supported")):
        status, out, _ = post(mesh, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **extra})
        assert status == 400 and words in out["error"]["message"], out


def test_special_tokens_stay_in_the_text_when_asked(mesh):
    """``skip_special_tokens: false`` through PD (prefill's first token, decode's rest), HTTP whole and
    streamed and the SDK: the same tokens, their text kept; the EOS that stops the answer never shows."""
    from kvmesh.client import KvmeshClient

    forced = {"max_tokens": 3, "logit_bias": {"1": 100}}  # <|im_start|>, a special token
    plain = complete(mesh, **forced)
    kept = complete(mesh, skip_special_tokens=False, **forced)
    assert plain["token_ids"] == kept["token_ids"] == [1, 1, 1]
    assert plain["text"] == "" and kept["text"] == "<|im_start|>" * 3
    chunks = openai_client(mesh).completions.create(model=kept_model(mesh), prompt=PROMPT, max_tokens=3,
                                                    temperature=0, stream=True, logit_bias={"1": 100},
                                                    extra_body={"skip_special_tokens": False})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == kept["text"]
    with KvmeshClient(f"127.0.0.1:{mesh.grpc_port}") as client:
        c = client.complete(PROMPT, max_tokens=3, temperature=0, logit_bias={1: 100.0}, skip_special_tokens=False)
    assert c.text == kept["text"]
    eos = complete(mesh, max_tokens=3, logit_bias={"2": 100}, skip_special_tokens=False)  # <|im_end|>, the EOS
    assert eos["token_ids"] == [2] and eos["text"] == "" and eos["finish_reason"] == "stop"


def kept_model(mesh) -> str:
    return openai_client(mesh).models.list().data[0].id
