"""kvmesh instances that run vLLM (``[engine] backend = "vllm"``), through the whole stack: the same greedy tokens
as standalone ``vllm serve``, prefix hits that the index sees from vLLM's own events, the pool between two vLLM
instances, an index that stays true across a restart, and the rest of the API (tenants, structured output,
adapters, bad input) through vLLM."""

from __future__ import annotations

import json
import random
import signal
import time
import urllib.error
import urllib.request

import pytest
from kvmesh import tls
from kvmesh.client import KvmeshClient
from kvmesh.contracts.keys import Namespace, block_keys
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc

from tests.vllm.conftest import StandaloneVLLM, vllm_stack

pytestmark = pytest.mark.vllm
# the standalone server's reference prompts: "The capital of France is", "def fibonacci(n):", a chat turn
PROMPTS = [[504, 3575, 282, 4649, 314], [1604, 3987, 46477, 24, 94, 727],
           [1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198]]


KEYS = {"sk-test": "t0", "sk-alice": "alice", "sk-bob": "bob"}
AUTH = {"authorization": "Bearer sk-test"}


def long_prompt(seed: int, n: int = 400) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Two vLLM instances (role both) with the pool."""
    s = vllm_stack(tmp_path_factory, "vllm2", both=2, router={"api_keys": KEYS})
    yield s
    s.stop()


def post(stack, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"{stack.router_http}{path}", json.dumps(body).encode(),
                                 {"content-type": "application/json", **AUTH, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def matches(stack, prompt: list[int], tenant: str = "t0") -> list:
    """cachesvc's MatchPrefix of ``prompt`` as ``tenant`` sends it (its salt, ``tenant\0``, in the keys)."""
    from kvmesh.engine.loader import resolve_model
    from kvmesh.model_source.tokenizer import Tokenizer

    source = resolve_model(None)
    seed = Namespace(source.fingerprint, Tokenizer.from_dir(source.hf_dir).fingerprint, "", f"{tenant}\x00").seed
    with tls.channel(stack.service("cachesvc").grpc_address, cfg=stack.mesh_settings()) as ch:  # as the operator
        return list(cache_pb2_grpc.CacheServiceStub(ch).MatchPrefix(
            cache_pb2.MatchPrefixRequest(block_keys=block_keys(seed, prompt, 16)), timeout=10).matches)


def held(stack, prompt: list[int]) -> dict[str, int]:
    """Leading blocks of ``prompt`` each instance holds, in cachesvc's index."""
    return {m.instance_id: m.num_blocks for m in matches(stack, prompt) if m.instance_id != "pool"}


def holding(stack, prompt: list[int], blocks: int) -> set[str]:
    """The instances whose leading blocks of ``prompt`` in cachesvc's index number at least ``blocks``."""
    return {i for i, n in held(stack, prompt).items() if n >= blocks}


def eventually(check, within_s: float = 30.0):
    deadline = time.monotonic() + within_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_greedy_token_ids_equal_standalone_vllm_serve(stack, model_dir, tmp_path_factory):
    ref = StandaloneVLLM(tmp_path_factory.mktemp("vllm-serve"), model_dir)
    try:
        prompts = [*PROMPTS, long_prompt(1, 300)]
        want = [ref.post("/v1/completions", {"model": ref.model, "prompt": p, "max_tokens": 16, "temperature": 0,
                                             "return_token_ids": True})["choices"][0]["token_ids"] for p in prompts]
    finally:
        ref.stop()
    with KvmeshClient(stack.router_grpc, api_key="sk-test") as c:
        got = [c.complete(p, max_tokens=16, temperature=0).token_ids for p in prompts]
    assert got == want


def test_a_repeated_prompt_is_served_from_vllms_cache_and_the_index_sees_it(stack):
    prompt = long_prompt(2)
    with KvmeshClient(stack.router_grpc, api_key="sk-test") as c:
        first = c.complete(prompt, max_tokens=4, temperature=0)
        again = c.complete(prompt, max_tokens=4, temperature=0)
    assert first.usage.cached_tokens == 0 and again.usage.cached_tokens >= 256  # vLLM's blocks of 128
    assert again.token_ids == first.token_ids
    holders = eventually(lambda: {i: n for i, n in held(stack, prompt).items() if n >= 16})
    assert len(holders) == 1 and max(holders.values()) == 384 // 16  # whole vLLM blocks, as kvmesh's keys


def test_the_pool_serves_a_prompt_to_the_other_vllm_instance(stack):
    """The first instance writes the conversation's blocks back as it finishes; round robin sends the repeat to
    the other, which finds nothing in its own cache, fetches the pool's blocks and has vLLM load them."""
    prompt = long_prompt(3)
    rr = {"x-kvmesh-policy": "round_robin"}
    status, first = post(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0}, rr)
    assert status == 200 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert eventually(lambda: held_in_pool(stack, prompt) >= 24), "the write-back never reached the pool"
    status, second = post(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0}, rr)
    assert status == 200 and second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    # the second instance's vLLM reports the loaded blocks as it takes them; the index may hear it after the reply
    assert eventually(lambda: len(holding(stack, prompt, 16)) == 2), held(stack, prompt)


def held_in_pool(stack, prompt: list[int]) -> int:
    return max((m.num_blocks for m in matches(stack, prompt) if m.instance_id == "pool"), default=0)


def test_tenants_never_share_a_vllm_prefix(stack):
    """Each API key's tenant salts its block keys, and vLLM gets the salt: the other tenant's repeat hits nothing."""
    prompt = long_prompt(4)
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    for key in ("sk-alice", "sk-alice"):
        status, alice = post(stack, "/v1/completions", body, {"authorization": f"Bearer {key}"})
    status, bob = post(stack, "/v1/completions", body, {"authorization": "Bearer sk-bob"})
    assert status == 200 and alice["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    assert bob["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert bob["choices"][0]["text"] == alice["choices"][0]["text"]


def test_structured_output_goes_to_vllms_guided_decoding(stack):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    status, body = post(stack, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Name a city in France as JSON."}], "max_tokens": 40,
        "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}})
    assert status == 200, body
    assert set(json.loads(body["choices"][0]["message"]["content"])) == {"city"}


def test_logit_adjustments_reach_vllm(stack):
    """The penalties, min_p, min_tokens and logit_bias go to vLLM's own sampling parameters (its heartbeat says
    it applies them, so the router sends them)."""
    status, plain = post(stack, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
                                                     "return_token_ids": True})
    assert status == 200, plain
    status, forced = post(stack, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
                                                      "return_token_ids": True, "logit_bias": {"1000": 100},
                                                      "presence_penalty": 0.5, "min_p": 0.05, "min_tokens": 2})
    assert status == 200, forced
    assert forced["choices"][0]["token_ids"][0] == 1000 != plain["choices"][0]["token_ids"][0]


def test_special_tokens_kept_on_vllm_when_asked(stack):
    """``skip_special_tokens: false`` goes to vLLM's own field: the same tokens, their text kept; the EOS that
    stops the answer never shows (vLLM's rule, the native engines' too)."""
    texts = []
    for keep in (False, True):
        status, out = post(stack, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0,
                                                       "return_token_ids": True, "logit_bias": {"1": 100},
                                                       "skip_special_tokens": not keep})
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == [1, 1, 1]  # <|im_start|>
        texts.append(out["choices"][0]["text"])
    assert texts == ["", "<|im_start|>" * 3]
    status, eos = post(stack, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0,
                                                   "return_token_ids": True, "logit_bias": {"2": 100},
                                                   "skip_special_tokens": False})
    assert status == 200 and eos["choices"][0]["token_ids"] == [2] and eos["choices"][0]["text"] == "", eos


def test_tool_calls_on_vllm_instances(stack):
    """The router renders the tools and reads the calls; a vLLM instance enforces ``required``'s constraint."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
    status, body = post(stack, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 40,
        "temperature": 0, "tools": [tool], "tool_choice": "required"})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    calls = choice["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] == "get_weather" for c in calls)
    assert all(set(json.loads(c["function"]["arguments"])) == {"city"} for c in calls)


def test_an_echoed_prompts_logprobs_come_from_vllm_computing_it_whole(stack):
    """vLLM's own prompt logprobs (its prefix cache and kvmesh's connector skip a scored prompt): each equals what
    vLLM gave the token when it generated it, the second time too, when the prompt is cached there."""
    prompt = long_prompt(8, 40)
    status, first = post(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0,
                                                     "ignore_eos": True, "logprobs": 2, "return_token_ids": True})
    assert status == 200, first
    gen = first["choices"][0]
    continued = prompt + gen["token_ids"]
    for _ in range(2):
        status, out = post(stack, "/v1/completions", {"prompt": continued, "max_tokens": 1, "temperature": 0,
                                                       "echo": True, "logprobs": 2, "prompt_logprobs": 2})
        assert status == 200, out
        choice = out["choices"][0]
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(continued) + 1
        assert lp["token_logprobs"][len(prompt):len(continued)] == pytest.approx(gen["logprobs"]["token_logprobs"],
                                                                                   abs=2e-3)
        field = choice["prompt_logprobs"]
        assert len(field) == len(continued) and field[0] is None
        assert all(entry[str(t)]["rank"] >= 1 for t, entry in zip(continued[1:], field[1:], strict=True))
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("body,field", [
    ({"prompt": [1, 2, 3], "max_tokens": 4, "temperature": -1}, "temperature"),
    ({"prompt": [1, 2, 999999], "max_tokens": 4}, "[0, 49152)"),
    ({"prompt": list(range(100, 2100)), "max_tokens": 100}, "context"),
])
def test_a_client_mistake_is_a_4xx_and_the_instance_keeps_serving(stack, body, field):
    status, answer = post(stack, "/v1/completions", body)
    assert 400 <= status < 500 and field in answer["error"]["message"], answer
    status, ok = post(stack, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0})
    assert status == 200 and ok["usage"]["completion_tokens"] == 2


def test_after_a_restart_no_route_goes_to_blocks_the_instance_no_longer_holds(stack):
    prompt = long_prompt(5)
    with KvmeshClient(stack.router_grpc, api_key="sk-test") as c:
        c.complete(prompt, max_tokens=2, temperature=0)
    holder = next(iter(eventually(lambda: holding(stack, prompt, 16))))
    svc = stack.service(holder)
    svc.proc.send_signal(signal.SIGKILL)
    svc.proc.wait()
    stack.services.remove(svc)
    module = "app.both"
    restarted = stack._spawn(holder, module, {k: v for k, v in svc.env.items() if k != "KVMESH_READY_FILE"})
    stack._wait_ready([restarted], time.monotonic() + 300)
    assert eventually(lambda: held(stack, prompt).get(holder, 0) == 0, 60), "the index still credits the old blocks"
