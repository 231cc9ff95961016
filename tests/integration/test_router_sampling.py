"""Extreme but legal sampling values at the router's two APIs: each answers 200 (or a 4xx with a message),
never a 5xx, and the ones that mean "the argmax" give the greedy tokens. An internal fault in one request (its
logits forced to nan through the engines' test hook) is a 500 / INTERNAL naming its request id, while a
request running beside it is served. A real router in front of a real prefill and decode instance (tiny random
model), real nats-server, real ports (``TinyMesh``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from kvmesh.proto.v1 import api_pb2, api_pb2_grpc, common_pb2

from tests.unit.helpers import NanLogits

from .test_router_bad_input import CHAT, COMPLETIONS, TinyMesh, model_dir  # noqa: F401 - model_dir: a fixture

TINY = 1.401298464324817e-45  # the smallest positive float32: Hypothesis's temperature
F32_MAX = 3.4028234663852886e38
MAX_SEED = 2**64 - 1


@pytest.fixture(scope="module")
def mesh(nats_server, model_dir) -> Iterator[TinyMesh]:  # noqa: F811
    with TinyMesh(nats_server.url, model_dir) as m:
        yield m


@pytest.fixture
def stub(mesh) -> Iterator[api_pb2_grpc.KvmeshStub]:
    with grpc.insecure_channel(mesh.grpc_target) as channel:
        yield mesh.stub(channel)


def complete(mesh: TinyMesh, headers: dict[str, str] | None = None, **extra) -> tuple[int, dict, dict]:
    return mesh.post(COMPLETIONS, {"prompt": "Hello there", "max_tokens": 6, "ignore_eos": True, **extra},
                     headers)


def text_of(resp: tuple[int, dict, dict]) -> str:
    status, body, _ = resp
    assert status == 200, body
    return body["choices"][0]["text"]


ARGMAX = [{"temperature": TINY}, {"temperature": 1e-300}, {"temperature": 1e-7, "seed": 3},
          {"temperature": 1.0, "top_p": 1e-9}, {"temperature": 1.0, "top_p": 1e-300},
          {"temperature": 1e308, "top_p": TINY}, {"temperature": 1e308, "top_k": 1},
          {"temperature": F32_MAX, "top_k": 1, "seed": MAX_SEED}]
SAMPLED = [{"temperature": 1e308}, {"temperature": F32_MAX}, {"temperature": 1e30, "top_k": 2},
           {"temperature": 1.0, "seed": MAX_SEED}, {"temperature": 1e308, "seed": MAX_SEED, "top_p": 0.5},
           {"temperature": 1e-5, "seed": 0}, {"temperature": 0.7, "top_k": 255, "top_p": 1.0, "seed": 2**63}]


@pytest.mark.parametrize("extra", ARGMAX, ids=repr)
def test_http_values_that_leave_only_the_argmax_are_served_greedily(mesh, extra):
    assert text_of(complete(mesh, **extra)) == text_of(complete(mesh, temperature=0))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra", SAMPLED, ids=repr)
def test_http_extreme_sampling_values_are_served(mesh, extra, stream):
    status, body, _ = complete(mesh, stream=stream, **extra)
    assert status == 200, body
    if stream:
        assert "[DONE]" in body["raw"] and '"error"' not in body["raw"], body
    else:
        assert body["usage"]["completion_tokens"] == 6


def test_http_a_seeded_request_repeats_itself_even_with_the_largest_seed(mesh):
    first = text_of(complete(mesh, temperature=1.0, seed=MAX_SEED))
    assert text_of(complete(mesh, temperature=1.0, seed=MAX_SEED)) == first


def generate(stub, request_id: str = "", **sampling) -> list[api_pb2.GenerateChunk]:
    params = common_pb2.SamplingParams(max_tokens=6, ignore_eos=True, **sampling)
    return list(stub.Generate(api_pb2.GenerateRequest(text="Hello there", sampling=params,
                                                      request_id=request_id), timeout=60))


def ids_of(chunks: list[api_pb2.GenerateChunk]) -> list[int]:
    assert chunks[-1].finished
    return [t for c in chunks for t in c.token_ids]


GRPC_ARGMAX = [{"temperature": TINY}, {"temperature": 1.0, "top_p": TINY}, {"temperature": 1.0, "top_p": 1e-9},
               {"temperature": F32_MAX, "top_k": 1}, {"temperature": F32_MAX, "top_p": TINY, "seed": MAX_SEED}]
GRPC_SAMPLED = [{"temperature": F32_MAX}, {"temperature": F32_MAX, "seed": MAX_SEED},
                {"temperature": 1.0, "seed": MAX_SEED}, {"temperature": 1e30, "top_k": 2, "seed": 0}]


@pytest.mark.parametrize("sampling", GRPC_ARGMAX, ids=repr)
def test_grpc_values_that_leave_only_the_argmax_are_served_greedily(stub, sampling):
    assert ids_of(generate(stub, **sampling)) == ids_of(generate(stub))


@pytest.mark.parametrize("sampling", GRPC_SAMPLED, ids=repr)
def test_grpc_extreme_sampling_values_are_served(stub, sampling):
    assert len(ids_of(generate(stub, **sampling))) == 6
    if "seed" in sampling:
        assert ids_of(generate(stub, **sampling)) == ids_of(generate(stub, **sampling))


def test_grpc_chat_with_hypothesis_values_is_served(stub):
    resp = stub.Chat(api_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="system", content="0")],
                                         sampling=common_pb2.SamplingParams(max_tokens=3, temperature=TINY)),
                     timeout=60)
    assert resp.usage.completion_tokens >= 1


def test_http_the_hypothesis_request_is_served(mesh):
    status, body, _ = mesh.post(CHAT, {"messages": [{"role": "system", "content": "0"}], "temperature": TINY,
                                       "max_tokens": 3})
    assert status == 200, body


# ---- an internal fault in one request -------------------------------------------------------------------------

def poison(mesh: TinyMesh, rid: str) -> None:
    """Every engine's logits for ``rid`` go nan (the unit tier's logits hook, set in process)."""
    for w in mesh.workers:
        engine = w.engine.engine
        if not isinstance(engine.logits_hook, NanLogits):
            engine.logits_hook = NanLogits()
        engine.logits_hook.ids.add(rid)


def test_http_an_internal_fault_is_a_500_naming_the_request_while_its_neighbour_is_served(mesh):
    reference = text_of(complete(mesh, temperature=0, max_tokens=24))
    rid = f"poison-{uuid.uuid4().hex[:8]}"
    poison(mesh, rid)
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(complete, mesh, temperature=0, max_tokens=24)
        bad = pool.submit(complete, mesh, {"x-request-id": rid}, temperature=0.8, seed=1)
        status, body, headers = bad.result()
        assert text_of(good.result()) == reference
    assert status == 500, body
    assert body["error"]["type"] == "internal_error" and rid in body["error"]["message"], body
    assert "not finite" in body["error"]["message"] and headers["x-request-id"] == rid
    assert text_of(complete(mesh, temperature=0, max_tokens=24)) == reference


def test_http_an_internal_fault_mid_stream_is_an_error_event(mesh):
    rid = f"poison-{uuid.uuid4().hex[:8]}"
    poison(mesh, rid)
    status, body, _ = complete(mesh, {"x-request-id": rid}, stream=True)
    assert status == 500 and rid in body["error"]["message"], body  # it failed before its first chunk


def test_grpc_an_internal_fault_is_internal_naming_the_request_while_its_neighbour_is_served(mesh, stub):
    reference = ids_of(generate(stub))
    rid = f"poison-{uuid.uuid4().hex[:8]}"
    poison(mesh, rid)
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(generate, stub)
        bad = pool.submit(generate, stub, rid, temperature=0.8)
        with pytest.raises(grpc.RpcError) as e:
            bad.result()
        assert ids_of(good.result()) == reference
    assert e.value.code() == grpc.StatusCode.INTERNAL, e.value.details()
    assert rid in e.value.details() and "not finite" in e.value.details()
    assert ids_of(generate(stub)) == reference
