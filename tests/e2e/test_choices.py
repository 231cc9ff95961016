"""``n`` > 1 through the real stack (1 prefill + 1 decode, the default model): n answers of one request, seeded
ones the same every time, whole and streamed with OpenAI's client; the later choices reuse the first one's prompt
KV (the router's delivered-hit counter grows by their prompts), so the prompt is computed once. A completions
batch (``prompt`` a list): each prompt's answers as its own request would give them, in prompt order, with
their prompt ids and usage; a bad prompt in it refuses the whole request, naming it."""

from __future__ import annotations

import urllib.request

import pytest

from .test_mesh import openai_client, post

pytestmark = pytest.mark.slow
PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle, a storm that "
          "lasts three days, and a ship that arrives too late. Begin:")


def delivered_hits(stack) -> float:
    """The router's count of prompt tokens the engines reported reused, every instance and tenant."""
    with urllib.request.urlopen(stack.router_metrics, timeout=10) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith("kvmesh_router_delivered_hit_tokens_total"))


def test_n_choices_seeded_the_same_every_time_and_the_prompt_computed_once(mesh):
    # long enough (~450 tokens, over a second of prefill here) that choices sent at once would all compute it
    body = {"prompt": " ".join([PROMPT] * 12) + " #choices", "max_tokens": 12, "temperature": 1.0, "seed": 11,
            "n": 3}
    before = delivered_hits(mesh)
    status, out, _ = post(mesh, "/v1/completions", body)
    assert status == 200, out
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2] and all(c["finish_reason"] == "length" for c in choices)
    assert len({c["text"] for c in choices}) > 1  # seed + i: different samples
    usage = out["usage"]
    assert usage["completion_tokens"] == 36 and usage["total_tokens"] == usage["prompt_tokens"] + 36
    # choices 1 and 2 found the prompt's KV (all but its last, partial block) where choice 0 put it
    reused = delivered_hits(mesh) - before
    assert reused >= 2 * (usage["prompt_tokens"] - 16), (reused, usage)
    status, again, _ = post(mesh, "/v1/completions", body)
    assert status == 200 and [c["text"] for c in again["choices"]] == [c["text"] for c in choices]


def test_n_choices_stream_each_under_its_index(mesh):
    client = openai_client(mesh)
    msgs = [{"role": "user", "content": "Name a color."}]
    whole = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=8, n=2,
                                           temperature=0.9, seed=5)
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=8, n=2,
                                                 temperature=0.9, seed=5, stream=True,
                                                 stream_options={"include_usage": True}))
    texts = ["", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    finished = [ch.index for c in chunks for ch in c.choices if ch.finish_reason]
    assert sorted(finished) == [0, 1]


BATCH = ["The capital of France is", "Two plus two equals", "The color of the sky is"]


def test_a_batch_of_prompts_answers_each_as_its_own_request_would(mesh):
    alone = []
    for p in BATCH:
        status, out, _ = post(mesh, "/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0,
                                                        "return_token_ids": True})
        assert status == 200, out
        alone.append(out)
    status, out, _ = post(mesh, "/v1/completions", {"prompt": BATCH, "max_tokens": 6, "temperature": 0, "n": 2,
                                                    "return_token_ids": True})
    assert status == 200, out
    choices = out["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for i, c in enumerate(choices):  # prompt j's choice k is choice 2j + k; greedy: both the same as alone
        one = alone[i // 2]["choices"][0]
        assert (c["text"], c["prompt_token_ids"], c["token_ids"]) == (one["text"], one["prompt_token_ids"],
                                                                      one["token_ids"])
    usage = out["usage"]
    assert usage["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert usage["completion_tokens"] == 2 * sum(a["usage"]["completion_tokens"] for a in alone)

    client = openai_client(mesh)
    texts = {}
    for chunk in client.completions.create(model="SmolLM2-135M-Instruct", prompt=BATCH, max_tokens=6, temperature=0,
                                           stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == [a["choices"][0]["text"] for a in alone]


def test_a_bad_prompt_in_a_batch_refuses_the_request_naming_it(mesh):
    status, out, _ = post(mesh, "/v1/completions", {"prompt": ["fine", "x " * 9000], "max_tokens": 2})
    assert status == 400 and out["error"]["message"].startswith("prompt[1]: "), out
    status, out, _ = post(mesh, "/v1/completions", {"prompt": ["fine", 7], "max_tokens": 2})
    assert status == 400 and "prompt[1]" in out["error"]["message"], out
    status, out, _ = post(mesh, "/v1/completions", {"prompt": ["fine", "also fine"], "max_tokens": 2})
    assert status == 200 and len(out["choices"]) == 2  # the service goes on


def test_continuous_usage_stats_give_each_chunk_its_choices_usage_so_far(mesh):
    client = openai_client(mesh)
    chunks = list(client.completions.create(model="SmolLM2-135M-Instruct", prompt=BATCH[:2], max_tokens=5,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    alone = [post(mesh, "/v1/completions", {"prompt": p, "max_tokens": 5, "temperature": 0})[1]["usage"]
             for p in BATCH[:2]]
    seen: dict[int, list[int]] = {0: [], 1: []}
    for c in chunks[:-1]:
        (choice,) = c.choices
        assert c.usage.prompt_tokens == alone[choice.index]["prompt_tokens"]
        seen[choice.index].append(c.usage.completion_tokens)
    for i in (0, 1):  # counts grow to the choice's whole completion
        assert seen[i] == sorted(seen[i]) and seen[i][-1] == alone[i]["completion_tokens"]
    final = chunks[-1]
    assert not final.choices and final.usage.completion_tokens == sum(u["completion_tokens"] for u in alone)
