"""Property: whatever a client sends, the router answers it with success or a 4xx (HTTP) / a client-error
status (gRPC) carrying a message, within a deadline, and goes on serving. Arbitrary JSON, arbitrary values for
every field of the OpenAI schema, arbitrary bytes, and arbitrary proto field values, against a real router
in front of real prefill and decode instances and the cache service (tiny model, real nats-server, real
ports).

The examples stay random (a fixed seed would only ever test the same 40). A failure is reproducible from its
log: Hypothesis prints the falsifying example and an ``@reproduce_failure(...)`` line (print_blob); add that
decorator to the test to replay exactly that example."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from kvmesh.proto.v1 import api_pb2, common_pb2

from .test_router_bad_input import CHAT, COMPLETIONS, TinyMesh, model_dir, still_serves  # noqa: F401

PROPS = settings(max_examples=40, deadline=None, database=None, print_blob=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CLIENT_ERRORS = {"INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "OUT_OF_RANGE", "FAILED_PRECONDITION",
                 "UNAUTHENTICATED"}
TIMEOUT_S = 20  # a request that takes longer counts as a hang


@pytest.fixture(scope="module")
def mesh(nats_server, model_dir) -> Iterator[TinyMesh]:  # noqa: F811
    with TinyMesh(nats_server.url, model_dir, cachesvc=True, max_body_bytes=16 * 1024) as m:
        yield m


@pytest.fixture(scope="module")
def stub(mesh) -> Iterator:
    with grpc.insecure_channel(mesh.grpc_target) as channel:
        yield mesh.stub(channel)
    still_serves(mesh)


# ---- strategies --------------------------------------------------------------------------------------------

lone_surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)
texts = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "\n\t", "Hi", "tiny"]), lone_surrogates)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), texts)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner,
                                                                                                 max_size=4),
                           max_leaves=12)
# never a large valid max_tokens: every example must stay fast
max_tokens = st.one_of(st.integers(-3, 6), st.integers().filter(lambda v: abs(v) > 600), json_values)
roles = st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), json_values)
text_parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2)
contents = st.one_of(texts, text_parts, json_values)
messages = st.one_of(st.lists(st.fixed_dictionaries({"role": roles, "content": contents}), max_size=3),
                     json_values)
prompts = st.one_of(texts, st.lists(st.integers(-2, 300), max_size=8), st.lists(texts, max_size=2),
                    json_values)
numbers = st.one_of(st.floats(), st.integers(), json_values)
FIELDS = {
    "model": st.one_of(st.just("tiny"), texts, json_values), "max_tokens": max_tokens,
    "max_completion_tokens": max_tokens, "temperature": numbers, "top_p": numbers,
    "top_k": st.one_of(st.integers(), json_values), "seed": st.one_of(st.integers(), json_values),
    "n": st.one_of(st.integers(0, 2), json_values),
    "stop": st.one_of(texts, st.lists(texts, max_size=3), json_values),
    "stop_token_ids": st.one_of(st.lists(st.integers(-2, 300), max_size=3), json_values),
    "stream": st.one_of(st.booleans(), json_values), "stream_options": st.one_of(
        st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "ignore_eos": st.one_of(st.booleans(), json_values), "cache_salt": st.one_of(texts, json_values),
    "user": st.one_of(texts, json_values),
    "kvmesh_policy": st.one_of(st.sampled_from(["round_robin", "x"]), texts),
}


# values the router should accept, so that examples get past validation into routing, the engines and back
unicode = st.text(max_size=20)  # any code point but surrogates: emoji, NUL-free controls, RTL, ...
VALID = {
    "model": st.just("tiny"), "max_tokens": st.integers(1, 6), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 300), "seed": st.integers(0, 2**64 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 255), max_size=3), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "ignore_eos": st.booleans(),
    "cache_salt": unicode.filter(lambda t: "\x00" not in t),
    "user": unicode.filter(lambda t: "\x00" not in t),
    "kvmesh_policy": st.sampled_from(["round_robin", "least_loaded", "cache_aware", "random"]),
}
valid_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": unicode}), min_size=1, max_size=3)
valid_prompts = st.one_of(unicode, st.lists(st.integers(0, 255), min_size=1, max_size=20))


def openai_bodies(prompt_field: str, prompt_values) -> st.SearchStrategy[dict]:
    """Bodies shaped like the schema (the prompt field always there, each other maybe) with any values."""
    return st.fixed_dictionaries({prompt_field: prompt_values}, optional=FIELDS)


@st.composite
def nearly_valid_bodies(draw, prompt_field: str, prompt_values) -> dict:
    """A body of values the router should accept, then at most one field (maybe the prompt) set to any
    value."""
    body = draw(st.fixed_dictionaries({prompt_field: prompt_values}, optional=VALID))
    if draw(st.booleans()):
        field = draw(st.sampled_from([prompt_field, *FIELDS]))
        body[field] = draw(FIELDS.get(field, json_values))
    return body


def assert_answered_properly(resp: tuple[int, dict, dict]) -> None:
    status, body, _ = resp
    event(f"HTTP {status}")  # the mix: pytest --hypothesis-show-statistics
    assert status == 200 or 400 <= status < 500, (status, body)
    if status != 200:
        assert isinstance(body.get("error", {}).get("message"), str) and body["error"]["message"], body
        assert body["error"]["code"] == status


def post_json(mesh: TinyMesh, path: str, body) -> tuple[int, dict, dict]:
    return mesh.post(path, json.dumps(body).encode(), timeout=TIMEOUT_S)


# ---- HTTP --------------------------------------------------------------------------------------------------

@PROPS
@given(body=openai_bodies("messages", messages))
def test_http_chat_with_any_field_values_gets_success_or_a_4xx(mesh, body):
    assert_answered_properly(post_json(mesh, CHAT, body))


@PROPS
@given(body=openai_bodies("prompt", prompts))
def test_http_completions_with_any_field_values_gets_success_or_a_4xx(mesh, body):
    assert_answered_properly(post_json(mesh, COMPLETIONS, body))


@PROPS
@given(body=nearly_valid_bodies("messages", valid_messages))
def test_http_chat_with_nearly_valid_bodies_gets_success_or_a_4xx(mesh, body):
    assert_answered_properly(post_json(mesh, CHAT, body))


@PROPS
@given(body=nearly_valid_bodies("prompt", valid_prompts))
def test_http_completions_with_nearly_valid_bodies_gets_success_or_a_4xx(mesh, body):
    assert_answered_properly(post_json(mesh, COMPLETIONS, body))


@PROPS
@given(path=st.sampled_from([CHAT, COMPLETIONS]), body=json_values)
def test_http_any_json_gets_success_or_a_4xx(mesh, path, body):
    assert_answered_properly(post_json(mesh, path, body))


@PROPS
@given(path=st.sampled_from([CHAT, COMPLETIONS]), raw=st.binary(max_size=64))
def test_http_any_bytes_get_a_4xx(mesh, path, raw):
    assert_answered_properly(mesh.post(path, raw, timeout=TIMEOUT_S))


def test_http_still_serves_after_the_properties(mesh):
    still_serves(mesh)
    assert mesh.admission.total == 0


# ---- gRPC --------------------------------------------------------------------------------------------------

uint32 = st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1))
float32 = st.one_of(st.floats(width=32), st.sampled_from([0.0, 1.0, -1.0, math.nan, math.inf]))
proto_text = st.text(max_size=30)
samplings = st.builds(
    common_pb2.SamplingParams, max_tokens=st.one_of(st.integers(0, 6), st.integers(600, 2**32 - 1)),
    temperature=float32, top_k=uint32, top_p=float32, seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    stop_token_ids=st.lists(uint32, max_size=3), stop=st.lists(proto_text, max_size=2),
    ignore_eos=st.booleans())
chat_messages = st.lists(st.builds(common_pb2.ChatMessage, role=st.one_of(st.sampled_from(["user", "system"]),
                                                                          proto_text), content=proto_text),
                         max_size=3)
common = {"request_id": st.one_of(st.just(""), proto_text), "model": st.one_of(st.sampled_from(["", "tiny"]),
                                                                                proto_text),
          "sampling": samplings, "cache_salt": proto_text}
generate_requests = st.one_of(
    st.builds(api_pb2.GenerateRequest, text=proto_text, **common),
    st.builds(api_pb2.GenerateRequest,
              token_ids=st.builds(api_pb2.TokenIds, ids=st.lists(uint32, max_size=8)), **common),
    st.builds(api_pb2.GenerateRequest, messages=st.builds(api_pb2.ChatMessages, messages=chat_messages),
              **common),
    st.builds(api_pb2.GenerateRequest, **common))
chat_requests = st.builds(api_pb2.ChatRequest, messages=chat_messages, **common)
valid_samplings = st.builds(
    common_pb2.SamplingParams, max_tokens=st.integers(0, 6), temperature=st.floats(0, 2, width=32),
    top_k=st.integers(0, 300), top_p=st.one_of(st.just(0.0), st.floats(0.25, 1, width=32)),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    stop_token_ids=st.lists(st.integers(0, 255), max_size=3),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=2), ignore_eos=st.booleans())
valid_chat_messages = st.lists(st.builds(common_pb2.ChatMessage, role=st.sampled_from(["system", "user"]),
                                         content=st.text(max_size=20)), min_size=1, max_size=3)
valid_common = {"model": st.sampled_from(["", "tiny"]), "sampling": valid_samplings,
                "cache_salt": st.text(max_size=20).filter(lambda t: "\x00" not in t)}
nearly_valid_generate_requests = st.one_of(
    st.builds(api_pb2.GenerateRequest, text=st.text(min_size=1, max_size=30), **valid_common),
    st.builds(api_pb2.GenerateRequest,
              token_ids=st.builds(api_pb2.TokenIds,
                                  ids=st.lists(st.integers(0, 255), min_size=1, max_size=20)),
              **valid_common),
    st.builds(api_pb2.GenerateRequest, messages=st.builds(api_pb2.ChatMessages, messages=valid_chat_messages),
              **valid_common))


def grpc_outcome(call) -> str:
    """OK, or the status name of a failed call (whose details must say something)."""
    try:
        result = call()
        if not isinstance(result, api_pb2.ChatResponse):
            chunks = list(result)
            assert chunks and chunks[-1].finished
        outcome = "OK"
    except grpc.RpcError as e:
        assert e.details(), e.code()
        outcome = e.code().name
    event(outcome)
    return outcome


@PROPS
@given(request=generate_requests)
def test_grpc_generate_with_any_field_values_gets_ok_or_a_client_error(stub, request):
    assert grpc_outcome(lambda: stub.Generate(request, timeout=TIMEOUT_S)) in CLIENT_ERRORS | {"OK"}


@PROPS
@given(request=nearly_valid_generate_requests)
def test_grpc_generate_with_nearly_valid_requests_gets_ok_or_a_client_error(stub, request):
    assert grpc_outcome(lambda: stub.Generate(request, timeout=TIMEOUT_S)) in CLIENT_ERRORS | {"OK"}


@PROPS
@given(request=st.builds(api_pb2.ChatRequest, messages=valid_chat_messages, **valid_common))
def test_grpc_chat_with_nearly_valid_requests_gets_ok_or_a_client_error(stub, request):
    assert grpc_outcome(lambda: stub.Chat(request, timeout=TIMEOUT_S)) in CLIENT_ERRORS | {"OK"}


@PROPS
@given(request=chat_requests)
def test_grpc_chat_with_any_field_values_gets_ok_or_a_client_error(stub, request):
    assert grpc_outcome(lambda: stub.Chat(request, timeout=TIMEOUT_S)) in CLIENT_ERRORS | {"OK"}


@PROPS
@given(method=st.sampled_from(["Generate", "Chat"]), raw=st.binary(max_size=64))
def test_grpc_any_bytes_get_ok_or_a_client_error(mesh, method, raw):
    with grpc.insecure_channel(mesh.grpc_target) as channel:
        rpc = (channel.unary_stream if method == "Generate" else channel.unary_unary)(
            f"/kvmesh.v1.Kvmesh/{method}", request_serializer=lambda b: b,
            response_deserializer=api_pb2.ChatResponse.FromString if method == "Chat"
            else api_pb2.GenerateChunk.FromString)
        assert grpc_outcome(lambda: rpc(raw, timeout=TIMEOUT_S)) in CLIENT_ERRORS | {"OK"}


def test_grpc_still_serves_after_the_properties(mesh, stub):
    chunks = list(stub.Generate(api_pb2.GenerateRequest(text="Hello", sampling=common_pb2.SamplingParams(
        max_tokens=2)), timeout=TIMEOUT_S))
    assert chunks[-1].finished
    assert mesh.admission.total == 0
