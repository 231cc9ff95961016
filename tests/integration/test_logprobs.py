"""Per-token logprobs end to end, read by the official ``openai`` client and the kvmesh SDK: a real router in
front of a role ``both`` instance, and of a prefill and a decode instance (PD: prefill samples the first token,
its logprobs travel with ``kv.ready``); tiny random model, real nats-server, real ports. The values are Hugging
Face's on the same weights, the same streamed or whole, through either API, and through PD as through role
both; a bad value is a 400 naming its field."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch
from kvmesh.client import KvmeshClient

from .test_router_bad_input import TinyMesh, model_dir  # noqa: F401 - model_dir: a fixture

PROMPT = [(i * 37) % 240 + 3 for i in range(23)]
MAX_TOKENS, TOP = 6, 4
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def both(nats_server, model_dir) -> Iterator[TinyMesh]:  # noqa: F811
    with TinyMesh(nats_server.url, model_dir, roles=("both",)) as m:
        yield m


@pytest.fixture(scope="module")
def pd(nats_server, model_dir) -> Iterator[TinyMesh]:  # noqa: F811
    with TinyMesh(nats_server.url, model_dir, disaggregate="always") as m:  # never computed on decode
        yield m


@pytest.fixture(scope="module")
def hf_reference(model_dir):  # noqa: F811
    """Hugging Face's greedy tokens after ``PROMPT`` and its log-softmax at each of their positions."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = PROMPT[:]
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        logits = hf(torch.tensor([ids])).logits[0, len(PROMPT) - 1:-1]
    return ids[len(PROMPT):], torch.log_softmax(logits.float(), dim=-1)


def client(mesh: TinyMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key="unused", max_retries=0)


def model(mesh: TinyMesh) -> str:
    return mesh.router.model_id


def pd_call(mesh: TinyMesh, call):
    """``call()`` through the PD path, checked to have used the pushed KV: decode computed no prompt token
    (no fallback, no step with prompt tokens) while prefill computed one."""
    prefill, decode = mesh.workers
    decode_prefills = decode.engine.stats().prefill_steps.steps
    prefill_steps, fallbacks = prefill.engine.stats().prefill_steps.steps, decode.metrics_fallbacks
    out = call()
    assert decode.metrics_fallbacks == fallbacks
    assert decode.engine.stats().prefill_steps.steps == decode_prefills
    assert prefill.engine.stats().prefill_steps.steps > prefill_steps
    return out


def complete(mesh: TinyMesh, **extra):
    return client(mesh).completions.create(model=model(mesh), prompt=PROMPT, logprobs=TOP, **{**GREEDY, **extra})


def assert_hf(tokens: list[int], logprobs: list[float], tops: list[list[float]], hf_reference) -> None:
    want_ids, want = hf_reference
    assert tokens == want_ids
    for i, (lp, top) in enumerate(zip(logprobs, tops, strict=True)):
        assert lp == pytest.approx(want[i][tokens[i]].item(), abs=1e-4)
        assert top == pytest.approx(want[i].topk(TOP).values.tolist(), abs=1e-4)


@pytest.mark.parametrize("kind", ["both", "pd"])
def test_completions_logprobs_are_hugging_faces_through_the_openai_client(kind, request, hf_reference):
    mesh: TinyMesh = request.getfixturevalue(kind)
    got = complete(mesh) if kind == "both" else pd_call(mesh, lambda: complete(mesh))
    lp = got.choices[0].logprobs
    text = mesh.router.tokenizer.token_text
    ids = hf_reference[0]
    assert lp.tokens == [text(t) for t in ids]
    tops = [sorted(step.values(), reverse=True)[:TOP] for step in lp.top_logprobs]
    assert_hf(ids, lp.token_logprobs, tops, hf_reference)
    assert all(step[tok] == lp_ for step, tok, lp_ in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


@pytest.mark.parametrize("kind", ["both", "pd"])
def test_streamed_completions_carry_the_same_logprobs_chunk_by_chunk(kind, request):
    mesh: TinyMesh = request.getfixturevalue(kind)
    whole = complete(mesh).choices[0].logprobs
    tokens, values, tops, offsets = [], [], [], []
    for chunk in complete(mesh, stream=True):
        lp = chunk.choices[0].logprobs
        tokens += lp.tokens
        values += lp.token_logprobs
        tops += lp.top_logprobs
        offsets += lp.text_offset
    assert (tokens, tops, offsets) == (whole.tokens, whole.top_logprobs, whole.text_offset)
    assert values == pytest.approx(whole.token_logprobs, abs=1e-5)


def chat(mesh: TinyMesh, **extra):
    return client(mesh).chat.completions.create(
        model=model(mesh), messages=[{"role": "user", "content": "Hello there"}], logprobs=True,
        top_logprobs=TOP, **{**GREEDY, **extra})


@pytest.mark.parametrize("kind", ["both", "pd"])
def test_chat_logprobs_name_each_token_with_its_bytes_and_the_most_likely_first(kind, request):
    mesh: TinyMesh = request.getfixturevalue(kind)
    whole = chat(mesh) if kind == "both" else pd_call(mesh, lambda: chat(mesh))
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == MAX_TOKENS
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == TOP
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the most likely
        assert entry.top_logprobs[0].logprob == entry.logprob
    streamed = [e for c in chat(mesh, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.top_logprobs[1].token) for e in streamed] == [(e.token, e.top_logprobs[1].token)
                                                                       for e in content]


def test_pd_gives_the_logprobs_role_both_gives_first_token_included(both, pd):
    ref = complete(both).choices[0].logprobs
    got = pd_call(pd, lambda: complete(pd)).choices[0].logprobs
    assert got.tokens == ref.tokens and got.top_logprobs[0].keys() == ref.top_logprobs[0].keys()
    assert got.token_logprobs == pytest.approx(ref.token_logprobs, abs=1e-5)
    chat_ref = chat(both).choices[0].logprobs.content[0]
    chat_pd = pd_call(pd, lambda: chat(pd)).choices[0].logprobs.content[0]
    assert chat_pd.token == chat_ref.token and chat_pd.logprob == pytest.approx(chat_ref.logprob, abs=1e-5)


def test_without_logprobs_asked_the_choices_say_null(both):
    got = client(both).completions.create(model=model(both), prompt=PROMPT, **GREEDY)
    assert got.choices[0].logprobs is None
    got = client(both).chat.completions.create(model=model(both), messages=[{"role": "user", "content": "Hi"}],
                                               **GREEDY)
    assert got.choices[0].logprobs is None


@pytest.mark.parametrize("endpoint,extra,field", [
    ("completions", {"logprobs": 21}, "logprobs must be an integer in [0, 20]"),
    ("completions", {"logprobs": -1}, "logprobs must be an integer in [0, 20]"),
    ("chat", {"logprobs": True, "top_logprobs": 25}, "top_logprobs must be an integer in [0, 20]"),
    ("chat", {"top_logprobs": 3}, 'top_logprobs needs "logprobs": true'),
])
def test_a_bad_value_is_a_400_naming_the_field(both, endpoint, extra, field):
    c = client(both)
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "completions":
            c.completions.create(model=model(both), prompt="Hi", max_tokens=2, **extra)
        else:
            c.chat.completions.create(model=model(both), messages=[{"role": "user", "content": "Hi"}],
                                      max_tokens=2, **extra)
    assert e.value.status_code == 400 and field in e.value.message


@pytest.mark.parametrize("kind", ["both", "pd"])
def test_the_grpc_api_and_sdk_carry_them_too(kind, request, hf_reference):
    mesh: TinyMesh = request.getfixturevalue(kind)
    with KvmeshClient(mesh.grpc_target) as sdk:
        streamed = pd_call(mesh, lambda: sdk.complete(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)) \
            if kind == "pd" else sdk.complete(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
        unary = sdk.chat([{"role": "user", "content": "Hello there"}], max_tokens=3, ignore_eos=True, logprobs=0)
    assert len(streamed.logprobs) == len(streamed.token_ids) == MAX_TOKENS
    assert_hf(streamed.token_ids, [e.logprob for e in streamed.logprobs],
              [[v for _, v in e.top] for e in streamed.logprobs], hf_reference)
    assert [e.token_id for e in unary.logprobs] == unary.token_ids and all(e.top == () for e in unary.logprobs)
