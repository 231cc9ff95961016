"""Client SDK against a fake router on 127.0.0.1: streaming, retries, deadlines, metadata (sync, asyncio)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest
from kvmesh.client import (
    AsyncKvmeshClient,
    DeadlineExceeded,
    GenerateChunk,
    InvalidRequest,
    KvmeshClient,
    KvmeshError,
    Overloaded,
    Unavailable,
)
from kvmesh.proto.v1 import api_pb2

from .test_client_fake import TRACE_ID, FakeKvmesh, serve

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
USER_HI = [{"role": "user", "content": "Hi"}]
REPLY = "Hello there, friend."


@pytest.fixture
def fake() -> FakeKvmesh:
    return FakeKvmesh()


@pytest.fixture
def target(fake: FakeKvmesh) -> Iterator[str]:
    with serve(fake) as address:
        yield address


@pytest.fixture
def client(target: str) -> Iterator[KvmeshClient]:
    with KvmeshClient(target, api_key="sk-test", timeout_s=10, backoff_s=0.01) as c:
        yield c


def wait_for(predicate, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


# --- sync client --------------------------------------------------------------------------------------------

def test_an_answer_larger_than_grpcs_default_4_mib_arrives(client, fake):
    """A long prompt's logprobs (prompt_logprobs 20: ~160 bytes a token) outgrow gRPC's default receive limit."""
    fake.prompt_scores = 40_000
    assert api_pb2.ChatResponse(prompt_logprobs=fake._scores()).ByteSize() > 5 * 2**20
    assert len(client.chat(USER_HI).prompt_logprobs) == 40_000
    assert len(client.complete("Hi").prompt_logprobs) == 40_000


def test_generate_streams_one_chunk_per_token_then_usage(client):
    chunks = list(client.generate("The capital of France is", max_tokens=8))
    assert "".join(c.text for c in chunks) == REPLY
    assert [c.token_ids for c in chunks] == [(100,), (101,), (102,), ()]
    assert chunks[-1].finished and chunks[-1].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_request_reaches_server_as_built(client, fake):
    client.complete(messages=USER_HI, max_tokens=9, cache_salt="tenant-a", request_id="r-1")
    req = fake.requests[-1]
    assert req.messages.messages[0].content == "Hi" and req.sampling.max_tokens == 9
    assert (req.cache_salt, req.request_id) == ("tenant-a", "r-1")


def test_complete_collects_text_usage_and_client_timing(client):
    done = client.complete("Hi there")
    assert (done.text, done.token_ids, done.finish_reason) == (REPLY, [100, 101, 102], "stop")
    assert done.usage is not None and done.usage.prompt_tokens == 2
    assert done.ttft_s is not None and 0 < done.ttft_s <= done.latency_s and len(done.itl_s) == 2


def test_trailing_request_id_and_trace_id_appear_on_completion(client):
    done = client.complete("Hi")
    assert done.request_id == "req-from-trailer" and done.trace_id == TRACE_ID
    assert done.metadata["x-request-id"] == "req-from-trailer"


def test_stream_request_id_wins_over_trailing_one(client):
    assert client.complete("Hi", request_id="mine").request_id == "mine"


def test_retries_unavailable_before_first_chunk_then_succeeds(client, fake):
    fake.fail_before_first = [UNAVAILABLE, UNAVAILABLE]
    assert client.complete("Hi").text == REPLY
    assert len(fake.requests) == 3


def test_gives_up_after_the_retry_budget(target, fake):
    fake.fail_before_first = [UNAVAILABLE] * 5
    with KvmeshClient(target, retries=2, backoff_s=0.01) as c, pytest.raises(Unavailable, match="scripted failure"):
        c.complete("Hi")
    assert len(fake.requests) == 3


def test_a_stream_cut_mid_way_resumes_after_the_tokens_it_delivered(client, fake):
    fake.cut_after_first = 1
    chunks = list(client.generate("Hi", request_id="r-7"))
    assert "".join(c.text for c in chunks) == REPLY and [t for c in chunks for t in c.token_ids] == [100, 101, 102]
    again = fake.requests[-1]
    assert len(fake.requests) == 2 and list(again.resume_token_ids) == [100] and again.request_id == "r-7"
    assert again.text == "Hi"


def test_a_resume_carries_the_id_the_router_gave_the_stream(client, fake):
    fake.cut_after_first, fake.assign_id = 1, "given-by-router"
    list(client.generate("Hi"))
    assert [r.request_id for r in fake.requests] == ["", "given-by-router"]


def test_without_retries_a_cut_stream_raises_and_keeps_what_arrived(target, fake):
    fake.fail_after_first = UNAVAILABLE
    received: list[GenerateChunk] = []
    with KvmeshClient(target, retries=0) as c, pytest.raises(Unavailable):
        received.extend(c.generate("Hi"))  # keeps what arrived before the failure
    assert [ch.text for ch in received] == ["Hello"] and len(fake.requests) == 1


def test_an_error_other_than_unavailable_mid_stream_is_not_resumed(client, fake):
    fake.fail_after_first = grpc.StatusCode.INTERNAL
    with pytest.raises(KvmeshError):
        list(client.generate("Hi"))
    assert len(fake.requests) == 1


def test_with_several_routers_a_call_fails_over_to_one_that_answers(target, fake):
    with KvmeshClient(["127.0.0.1:1", target], backoff_s=0.01) as c:
        assert c.complete("Hi").text == REPLY
        assert c.target == target  # the next calls go to the router that answered


def test_a_stream_cut_by_its_router_resumes_on_the_next_one(fake):
    other = FakeKvmesh()
    fake.cut_after_first = 1
    with serve(fake) as first, serve(other) as second, KvmeshClient([first, second], backoff_s=0.01) as c:
        chunks = list(c.generate("Hi"))
    assert "".join(ch.text for ch in chunks) == REPLY
    assert len(fake.requests) == 1 and list(other.requests[0].resume_token_ids) == [100]


@pytest.mark.parametrize("code,error", [(grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest),
                                        (grpc.StatusCode.RESOURCE_EXHAUSTED, Overloaded)])
def test_other_errors_surface_at_once_with_server_detail(client, fake, code, error):
    fake.fail_before_first, fake.detail = [code], "no instance can meet the TTFT SLO"
    with pytest.raises(error, match="no instance can meet the TTFT SLO"):
        client.complete("Hi")
    assert len(fake.requests) == 1


def test_deadline_surfaces_as_deadline_exceeded(client, fake):
    fake.delay_s = 5
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="0.3s"):
        client.complete("Hi", timeout_s=0.3)
    assert time.monotonic() - start < 2 and len(fake.requests) == 1


def test_client_default_deadline_applies_to_every_call(target, fake):
    fake.delay_s = 5
    with KvmeshClient(target, timeout_s=0.3) as c, pytest.raises(DeadlineExceeded):
        list(c.generate("Hi"))


def test_api_key_arrives_as_bearer_metadata_on_every_call(client, fake):
    client.complete("Hi")
    client.chat(USER_HI)
    client.health()
    assert [m.get("authorization") for m in fake.metadata] == ["Bearer sk-test"] * 3


def test_cancel_ends_the_stream_and_the_server_call(client, fake):
    fake.reply, fake.chunk_delay_s = " ".join(["word"] * 200), 0.01
    stream = client.generate("Hi")
    next(stream)
    stream.cancel()
    assert list(stream) == []
    assert wait_for(lambda: fake.cancelled == 1)


def test_chat_returns_the_whole_answer(client, fake):
    done = client.chat(USER_HI, max_tokens=5)
    assert (done.text, done.request_id, done.trace_id) == (REPLY, "chat-1", TRACE_ID)
    assert done.usage is not None and done.usage.completion_tokens == 3 and done.ttft_s is None
    assert fake.requests[-1].sampling.max_tokens == 5


def test_list_models_and_health(client):
    assert [m.id for m in client.list_models()] == ["tiny"]
    health = client.health()
    assert health.ok and [i.role for i in health.instances] == ["prefill", "decode"]
    assert health.instances[0].load == {"queue": 1.0}


def test_unreachable_router_is_unavailable():
    with KvmeshClient("127.0.0.1:1", retries=1, backoff_s=0.01) as c, pytest.raises(Unavailable):
        c.health()


# --- asyncio client -----------------------------------------------------------------------------------------

def test_async_generate_streams_chunks(target):
    async def main() -> list[GenerateChunk]:
        async with AsyncKvmeshClient(target) as c:
            return [chunk async for chunk in c.generate("Hi")]

    chunks = asyncio.run(main())
    assert "".join(c.text for c in chunks) == REPLY and chunks[-1].finished


def test_async_complete_carries_trailing_metadata_and_api_key(target, fake):
    async def main():
        async with AsyncKvmeshClient(target, api_key="sk-async") as c:
            return await c.complete(messages=USER_HI)

    done = asyncio.run(main())
    assert (done.request_id, done.trace_id, done.text) == ("req-from-trailer", TRACE_ID, REPLY)
    assert fake.metadata[-1]["authorization"] == "Bearer sk-async"


def test_async_retries_unavailable_before_first_chunk(target, fake):
    fake.fail_before_first = [UNAVAILABLE, UNAVAILABLE]

    async def main():
        async with AsyncKvmeshClient(target, backoff_s=0.01) as c:
            return await c.complete("Hi")

    assert asyncio.run(main()).text == REPLY and len(fake.requests) == 3


def test_async_a_cut_stream_resumes_after_the_tokens_it_delivered(target, fake):
    fake.cut_after_first = 1
    received: list[str] = []

    async def main() -> None:
        async with AsyncKvmeshClient(target, backoff_s=0.01) as c:
            async for chunk in c.generate("Hi"):
                received.append(chunk.text)

    asyncio.run(main())
    assert "".join(received) == REPLY and list(fake.requests[-1].resume_token_ids) == [100]


def test_async_without_retries_a_cut_stream_raises(target, fake):
    fake.fail_after_first = UNAVAILABLE
    received: list[str] = []

    async def main() -> None:
        async with AsyncKvmeshClient(target, retries=0) as c:
            async for chunk in c.generate("Hi"):
                received.append(chunk.text)

    with pytest.raises(Unavailable):
        asyncio.run(main())
    assert received == ["Hello"] and len(fake.requests) == 1


def test_async_deadline_surfaces_as_deadline_exceeded(target, fake):
    fake.delay_s = 5

    async def main():
        async with AsyncKvmeshClient(target) as c:
            return await c.complete("Hi", timeout_s=0.3)

    with pytest.raises(DeadlineExceeded):
        asyncio.run(main())


def test_async_chat_models_and_health(target):
    async def main():
        async with AsyncKvmeshClient(target) as c:
            return await c.chat(USER_HI), await c.list_models(), await c.health()

    done, models, health = asyncio.run(main())
    assert done.text == REPLY and models[0].max_model_len == 2048 and health.ok


def test_async_cancel_ends_the_stream(target, fake):
    fake.reply, fake.chunk_delay_s = " ".join(["word"] * 200), 0.01

    async def main() -> list[GenerateChunk]:
        async with AsyncKvmeshClient(target) as c:
            stream = c.generate("Hi")
            await stream.__anext__()
            stream.cancel()
            return [chunk async for chunk in stream]

    assert asyncio.run(main()) == []
    assert wait_for(lambda: fake.cancelled == 1)
