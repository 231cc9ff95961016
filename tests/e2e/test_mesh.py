"""The mesh end to end: real processes, real nats-server, real gRPC, the real default model."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest
from kvmesh.contracts.sampling import SamplingParams
from kvmesh.engine.llm_engine import LLMEngine
from kvmesh.settings import EngineSettings

from .conftest import start_stack

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Name three fruits.", "What is 2 + 2?", "Say hello in Spanish.",
             "What color is the sky?", "Write one word about cats.", "Who wrote Hamlet?", "What is water made of?"]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineSettings(threads=1))


def expected_tokens(engine, question: str, n: int) -> list[int]:
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return engine.generate([prompt], SamplingParams(max_tokens=n))[0].token_ids


def post(stack, path: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e), dict(e.headers)


def openai_client(stack, **kw):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="unused", **kw)


def test_greedy_output_through_the_mesh_equals_the_engine_alone(mesh, engine):
    status, body, headers = post(mesh, "/v1/completions", {
        "prompt": engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}]),
        "max_tokens": 16, "temperature": 0})
    assert status == 200 and headers.get("x-request-id")
    ids = engine.tokenizer.encode(body["choices"][0]["text"])
    assert engine.tokenizer.decode(ids) == engine.tokenizer.decode(expected_tokens(engine, QUESTIONS[0], 16))


def test_openai_client_chat_non_streaming_and_streaming(mesh, engine):
    client = openai_client(mesh)
    msgs = [{"role": "user", "content": QUESTIONS[6]}]
    whole = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=12,
                                           temperature=0)
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed
    assert streamed == engine.tokenizer.decode(expected_tokens(engine, QUESTIONS[6], 12))
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]


def test_eight_concurrent_streams_all_finish_correctly(mesh, engine):
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{mesh.http_port}/v1", api_key="unused")

    async def one(q: str) -> str:
        stream = await client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=10, temperature=0,
                                                      messages=[{"role": "user", "content": q}], stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_of_them():
        return await asyncio.gather(*(one(q) for q in QUESTIONS))

    texts = asyncio.run(all_of_them())
    assert texts == [engine.tokenizer.decode(expected_tokens(engine, q, 10)) for q in QUESTIONS]


def pool_bytes_written(stack) -> float:
    """What decode has written back to the pool so far (its Prometheus counter)."""
    with urllib.request.urlopen(stack.service("decode-0").endpoints["metrics"], timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('kvmesh_worker_kv_transfer_bytes_total{direction="pool_write"}'):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_for_write_back(stack, before: float, within_s: float = 60.0) -> None:
    """Decode writes a finished conversation's blocks back after the answer went out: a next turn that arrives
    first finds only what prefill computed itself. Wait for the write-back instead of racing it."""
    deadline = time.monotonic() + within_s
    while pool_bytes_written(stack) <= before:
        assert time.monotonic() < deadline, "decode did not write the first turn back to the pool in time"
        time.sleep(0.1)


def test_second_turn_reuses_the_first_turns_prompt_and_answer(mesh):
    client = openai_client(mesh)
    history = [{"role": "user", "content": "Tell me a fact about the moon."}]
    written = pool_bytes_written(mesh)
    first = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=history, max_tokens=20,
                                           temperature=0)
    wait_for_write_back(mesh, written)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And one about the sun?"}]
    second = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=history, max_tokens=8,
                                            temperature=0)
    covered = (first.usage.prompt_tokens + first.usage.completion_tokens) // 16 * 16
    assert second.usage.prompt_tokens_details.cached_tokens >= covered


def test_bad_input_gets_a_clear_400_and_the_service_keeps_serving(mesh):
    status, body, headers = post(mesh, "/v1/chat/completions", {"messages": "hello", "max_tokens": 4})
    assert status == 400 and "messages" in body["error"]["message"] and headers.get("x-request-id")
    status, body, _ = post(mesh, "/v1/completions", {"prompt": [1, 10**9], "max_tokens": 4})
    assert status == 400 and "token ids" in body["error"]["message"]
    status, body, _ = post(mesh, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": -1})
    assert status == 400 and "temperature" in body["error"]["message"]
    status, body, _ = post(mesh, "/v1/chat/completions", {"model": "gpt-9", "messages": [], "max_tokens": 4})
    assert status in (400, 404)
    status, body, _ = post(mesh, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 3


def test_decode_without_kv_ready_recomputes_and_still_answers_correctly(tmp_path_factory, engine):
    stack = start_stack(tmp_path_factory, "nokvready",
                        env={"KVMESH_INSTANCE_FAULT_DROP_KV_READY": "1", "KVMESH_INSTANCE_KV_TIMEOUT_S": "2"})
    try:
        status, body, _ = post(stack, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": QUESTIONS[2]}], "max_tokens": 10, "temperature": 0})
        assert status == 200
        assert body["choices"][0]["message"]["content"] == engine.tokenizer.decode(
            expected_tokens(engine, QUESTIONS[2], 10))
        assert "recomputing the prompt locally: kv.ready not received" in (stack.log_dir / "decode-0.log").read_text()
    finally:
        stack.stop()


def test_grpc_sdk_streams_chats_and_reports_usage(mesh, engine):
    from kvmesh.client import InvalidRequest, KvmeshClient

    messages = [{"role": "user", "content": QUESTIONS[3]}]
    want = engine.tokenizer.decode(expected_tokens(engine, QUESTIONS[3], 10))
    with KvmeshClient(f"127.0.0.1:{mesh.grpc_port}") as client:
        streamed = client.complete(messages=messages, max_tokens=10)
        chat = client.chat(messages, max_tokens=10)
        assert streamed.text == chat.text == want
        assert streamed.usage.completion_tokens == len(streamed.token_ids) and streamed.request_id
        assert streamed.metadata.get("x-request-id") == streamed.request_id
        assert client.health().ok and client.list_models()[0].id == "SmolLM2-135M-Instruct"
        with pytest.raises(InvalidRequest, match="token ids"):
            client.complete(prompt=[1, 10**9], max_tokens=2)


def test_role_both_serves_without_disaggregation(tmp_path_factory, engine):
    stack = start_stack(tmp_path_factory, "both", prefill=0, decode=0, both=1)
    try:
        body = {"messages": [{"role": "user", "content": QUESTIONS[4]}], "max_tokens": 10, "temperature": 0}
        status, first, _ = post(stack, "/v1/chat/completions", body)
        status2, again, _ = post(stack, "/v1/chat/completions", body)
        assert status == status2 == 200
        assert first["choices"][0]["message"]["content"] == engine.tokenizer.decode(
            expected_tokens(engine, QUESTIONS[4], 10))
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
    finally:
        stack.stop()


def test_a_request_can_pick_its_routing_policy(mesh):
    body = json.dumps({"prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()
    for policy, status in (("round_robin", 200), ("least_loaded", 200), ("fastest", 400)):
        req = urllib.request.Request(f"http://127.0.0.1:{mesh.http_port}/v1/completions", data=body,
                                     headers={"content-type": "application/json", "x-kvmesh-policy": policy})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                got = r.status
        except urllib.error.HTTPError as e:
            got = e.code
            assert "cache_aware" in json.load(e)["error"]["message"]
        assert got == status


def test_an_unreachable_ttft_slo_is_refused_at_once_with_429(tmp_path_factory):
    stack = start_stack(tmp_path_factory, "slo", env={"KVMESH_ROUTER_SLO_TTFT_S": "0.001"})
    try:
        status, body, _ = post(stack, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 4})
        assert status == 429 and "SLO" in body["error"]["message"]
    finally:
        stack.stop()


def test_an_engine_answers_a_snapshot_request_with_the_blocks_it_holds(mesh):
    from kvmesh import tls
    from kvmesh.bus import Bus, Subjects
    from kvmesh.bus.snapshot import request_snapshot
    from kvmesh.state import StackInfo

    info = StackInfo.read(mesh.state_dir)

    async def ask():  # as cachesvc: only it may ask an instance for its blocks
        creds = tls.bus_tls(mesh.mesh_settings("cachesvc", "cachesvc"))
        bus = await Bus.connect(info.nats_url, name="snapshot-test", tls=creds)
        try:
            return await request_snapshot(bus, Subjects(info.cluster), "decode-0", timeout_s=10)
        finally:
            await bus.close()

    snap = asyncio.run(ask())
    assert snap is not None and snap.seq >= 1 and snap.blocks.get("device")


def spans_of(stack, request_id: str, names: set[str], within_s: float = 10.0) -> dict[str, dict]:
    """The request's spans by name (their attributes), from the stack's JSONL trace file."""
    deadline = time.monotonic() + within_s
    while True:
        found = {}
        for line in (stack.state_dir / "traces.jsonl").read_text().splitlines():
            span = json.loads(line)
            if span["attributes"].get("kvmesh.request_id") == request_id and span["name"] in names:
                found[span["name"]] = span["attributes"]
        if set(found) == names or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_turns_sent_back_to_back_push_only_the_blocks_decode_lacks(mesh, engine):
    """Each turn goes out the moment the last one ended, before the index has heard of its blocks: decode says
    what it holds when it accepts the call, and prefill pushes exactly the rest."""
    block = engine.layout.block_nbytes
    conversation = engine.tokenizer.encode("Here is a long story about a lighthouse keeper. " * 12)
    held_before = 0
    for turn in range(4):
        conversation += engine.tokenizer.encode(f" Question {turn}: what happened next?")
        req = urllib.request.Request(f"http://127.0.0.1:{mesh.http_port}/v1/completions",
                                     data=json.dumps({"prompt": conversation, "max_tokens": 12, "temperature": 0,
                                                      "ignore_eos": True}).encode(),
                                     headers={"content-type": "application/json", "x-kvmesh-disaggregate": "always"})
        with urllib.request.urlopen(req, timeout=120) as r:
            rid, body = r.headers["x-request-id"], json.load(r)
        spans = spans_of(mesh, rid, {"router.dispatch", "kv.push"})
        held = spans["router.dispatch"]["kvmesh.decode_held_blocks"]
        blocks = -(-len(conversation) // 16)
        assert spans["kv.push"]["kvmesh.bytes"] == (blocks - held) * block  # nothing decode held was pushed
        assert held >= held_before  # the conversation so far stayed on decode
        held_before = (len(conversation) + 11) // 16  # the prompt and all but the last output token
        conversation += engine.tokenizer.encode(body["choices"][0]["text"])
    assert held > 0
