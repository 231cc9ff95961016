"""The prompt's logprobs on the real stack (the default model, prefill and decode apart): a completion's ``echo``
with ``logprobs`` (what lm-eval's loglikelihood tasks send), vLLM's ``prompt_logprobs`` on both endpoints and the
gRPC SDK. Each prompt token's logprob equals the logprob the model gave that token when it generated it, whether
the prompt's prefix was cached or not; bad input is a 400 naming the field."""

from __future__ import annotations

import json
import urllib.request

import pytest

from .test_faults import router_metric
from .test_mesh import openai_client, post

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is Paris. The capital of Italy is"


def generated(mesh, prompt: list[int], n: int) -> dict:
    status, out, _ = post(mesh, "/v1/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                    "ignore_eos": True, "logprobs": 3, "return_token_ids": True})
    assert status == 200, out
    return out["choices"][0]


def test_an_echoed_prompts_logprobs_are_those_the_model_gave_it_as_it_generated_it(mesh):
    status, ids, _ = post(mesh, "/tokenize", {"prompt": PROMPT})
    assert status == 200, ids
    prompt = ids["tokens"]
    first = generated(mesh, prompt, 4)
    continued = prompt + first["token_ids"]
    for _ in range(2):  # the second time its prefix is cached everywhere: it is computed again all the same
        status, out, _ = post(mesh, "/v1/completions", {"prompt": continued, "max_tokens": 1, "temperature": 0,
                                                        "echo": True, "logprobs": 3})
        assert status == 200, out
        (choice,) = out["choices"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(continued) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
        echoed = lp["token_logprobs"][len(prompt):len(continued)]
        assert echoed == pytest.approx(first["logprobs"]["token_logprobs"], abs=2e-3)
        for ours, theirs in zip(lp["top_logprobs"][len(prompt):len(continued)], first["logprobs"]["top_logprobs"],
                                strict=True):
            assert set(ours) == set(theirs)
        assert choice["text"].startswith(PROMPT + first["text"])  # token ids echo as their text
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # the cache still serves what comes after (its blocks were written as usual)
    status, again, _ = post(mesh, "/v1/completions", {"prompt": continued, "max_tokens": 1, "temperature": 0})
    assert status == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again
    # the scored prompts' misses are counted as theirs, not as the cache's
    assert router_metric(mesh, 'kvmesh_router_missed_prefill_tokens_total{cause="scored"') >= len(continued)


def test_lm_evals_loglikelihood_request_through_the_openai_client(mesh):
    """lm-eval's ``local-completions`` scores a continuation by echoing context + continuation with
    ``logprobs: 1, max_tokens: 1`` and summing ``token_logprobs[ctxlen:-1]``; greediness from ``top_logprobs``."""
    client = openai_client(mesh)
    out = client.completions.create(model=MODEL, prompt=PROMPT + " Rome.", echo=True, logprobs=1, max_tokens=1,
                                    temperature=0, seed=1234)
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT + " Rome.")
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])  # the best and the token itself
    assert "".join(lp.tokens[:-1]) == PROMPT + " Rome." and out.usage.prompt_tokens == len(lp.tokens) - 1


def test_echo_with_max_tokens_zero_answers_the_prompt_alone(mesh):
    status, out, _ = post(mesh, "/v1/completions", {"prompt": [PROMPT, "Hello there"], "max_tokens": 0,
                                                    "echo": True, "logprobs": 0})
    assert status == 200, out
    assert [c["text"] for c in out["choices"]] == [PROMPT, "Hello there"]
    for c in out["choices"]:
        assert "".join(c["logprobs"]["tokens"]) == c["text"] and c["finish_reason"] == "length"
    status, plain, _ = post(mesh, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "echo": True,
                                                      "temperature": 0})
    assert status == 200 and plain["choices"][0]["text"].startswith(PROMPT) and plain["choices"][0]["logprobs"] is None


def test_a_streamed_echo_sends_the_prompt_and_its_logprobs_first(mesh):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 2}
    status, whole, _ = post(mesh, "/v1/completions", body)
    assert status == 200, whole
    req = urllib.request.Request(f"http://127.0.0.1:{mesh.http_port}/v1/completions",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(c["text"] for c in choices) == whole["choices"][0]["text"]
    assert choices[0]["text"].startswith(PROMPT) and choices[0]["logprobs"]["token_logprobs"][0] is None
    tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
    offsets = [o for c in choices for o in c["logprobs"]["text_offset"]]
    assert tokens == whole["choices"][0]["logprobs"]["tokens"]
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"]


def test_vllms_prompt_logprobs_field_on_both_endpoints(mesh):
    status, ids, _ = post(mesh, "/tokenize", {"prompt": PROMPT})
    status, out, _ = post(mesh, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2})
    assert status == 200, out
    field = out["choices"][0]["prompt_logprobs"]
    assert len(field) == ids["count"] and field[0] is None
    for token, entry in zip(ids["tokens"][1:], field[1:], strict=True):
        own = entry[str(token)]
        assert own["rank"] >= 1 and own["logprob"] <= 0 and isinstance(own["decoded_token"], str)
        assert len(entry) <= 3 and sorted(e["rank"] for e in entry.values())[:1] == [1]
    assert out["choices"][0]["logprobs"] is None and "prompt_logprobs" in out["choices"][0]
    status, two, _ = post(mesh, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2, "n": 2,
                                                    "temperature": 1.0, "seed": 5})
    assert status == 200, two
    # the first choice scored the prompt; the second reused its KV and carries the same logprobs
    assert two["choices"][0]["prompt_logprobs"] == two["choices"][1]["prompt_logprobs"]
    assert [e and sorted(e) for e in two["choices"][0]["prompt_logprobs"]] == [e and sorted(e) for e in field]
    status, chat, _ = post(mesh, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": 2, "prompt_logprobs": 0,
                                                          "return_token_ids": True})
    assert status == 200, chat
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"]) and chat["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


PARTIAL = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "My favourite fruit is the"}]


def test_a_chats_echo_answers_the_message_it_continues_whole(mesh):
    """vLLM's chat ``echo``: the last message, when it is the assistant's, before the answer's content."""
    body = {"messages": PARTIAL, "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 4,
            "temperature": 0}
    status, plain, _ = post(mesh, "/v1/chat/completions", body)
    status, echoed, _ = post(mesh, "/v1/chat/completions", {**body, "echo": True})
    assert status == 200, echoed
    continued = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == PARTIAL[1]["content"] + continued
    req = urllib.request.Request(f"http://127.0.0.1:{mesh.http_port}/v1/chat/completions",
                                 data=json.dumps({**body, "echo": True, "stream": True}).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert streamed == echoed["choices"][0]["message"]["content"]
    status, user_last, _ = post(mesh, "/v1/chat/completions", {"messages": PARTIAL[:1], "max_tokens": 4,
                                                                "temperature": 0, "echo": True})
    assert status == 200 and not user_last["choices"][0]["message"]["content"].startswith("Name a fruit.")


def test_the_grpc_sdk_returns_them(mesh):
    from kvmesh.client import KvmeshClient

    _, ids, _ = post(mesh, "/tokenize", {"prompt": PROMPT})
    with KvmeshClient(f"127.0.0.1:{mesh.grpc_port}") as client:
        streamed = client.complete(PROMPT, max_tokens=2, temperature=0, prompt_logprobs=1)
        assert [lp.token_id for lp in streamed.prompt_logprobs] == ids["tokens"][1:]
        assert all(lp.rank >= 1 and len(lp.top) == 1 for lp in streamed.prompt_logprobs)
        chat = client.chat([{"role": "user", "content": "Hi"}], max_tokens=2, prompt_logprobs=0)
        assert chat.prompt_logprobs and all(lp.top == () for lp in chat.prompt_logprobs)
        plain = client.complete(PROMPT, max_tokens=2, temperature=0)
        assert plain.prompt_logprobs == [] and plain.text == streamed.text
        with pytest.raises(ValueError, match="prompt_logprobs must be in"):
            client.complete(PROMPT, prompt_logprobs=30)


@pytest.mark.parametrize(("path", "body", "says"), [
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "not a stream"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": -1}, "the whole vocabulary"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens must be >= 1"),
])
def test_bad_input_is_a_400_naming_it(mesh, path, body, says):
    status, out, _ = post(mesh, path, body)
    assert status == 400 and says in out["error"]["message"], out
