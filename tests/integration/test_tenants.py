"""Tenants at a real router in front of real prefill and decode instances and the cache service (tiny model,
real nats-server): an API key names the tenant, the tenant's salt enters the block keys, and one tenant never
gets a prefix hit on another's blocks, whichever API or cache_salt it uses."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import grpc
import pytest
from kvmesh.client import AsyncKvmeshClient, KvmeshClient, KvmeshError, Overloaded, Unauthenticated
from kvmesh.proto.v1 import api_pb2, common_pb2

from .test_router_bad_input import CHAT, TinyMesh, model_dir  # noqa: F401 - model_dir is a fixture

KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
LEGACY = "sk-legacy"


@pytest.fixture(scope="module")
def mesh(nats_server, model_dir) -> Iterator[TinyMesh]:  # noqa: F811
    with TinyMesh(nats_server.url, model_dir, cachesvc=True, api_keys=KEYS, api_key=LEGACY) as m:
        yield m


def fresh_prompt() -> str:
    """~120 tokens of the byte tokenizer (7 full blocks and more) that no earlier request shares more than a
    few leading tokens with; a raw completion prompt, so no chat template puts a shared head in front of
    it."""
    return f"{uuid.uuid4().hex} " + "the quick brown fox jumps over the lazy dog " * 2


# The prefix cache reuses KV at any token boundary, so a namespace's own earlier prompts may share the first
# character or two of the uuid (1/16 per byte); a hit on a foreign prefix would be >= 96 tokens.
NO_HIT = 8  # "no hit": fewer cached tokens than this


def chat(mesh: TinyMesh, key: str | None, content: str, **extra) -> tuple[int, dict]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    status, body, _ = mesh.post(CHAT, {"messages": [{"role": "user", "content": content}], "max_tokens": 2,
                                       "temperature": 0, **extra}, headers)
    return status, body


def complete(mesh: TinyMesh, key: str | None, prompt: str, **extra) -> tuple[int, dict]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    status, body, _ = mesh.post("/v1/completions", body, headers)
    return status, body


def cached(mesh: TinyMesh, key: str | None, prompt: str, **extra) -> int:
    """The prompt tokens a completion of ``prompt`` under ``key`` reused from cache."""
    status, body = complete(mesh, key, prompt, **extra)
    assert status == 200, body
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer sk-mallory"}, {"x-api-key": "sk-alic"}])
def test_http_without_a_valid_key_is_401(mesh, headers):
    status, body, _ = mesh.post(CHAT, {"messages": [{"role": "user", "content": "Hi"}]}, headers)
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert "Bearer <key>" in body["error"]["message"]
    assert mesh.http("GET", "/v1/models", headers=headers)[0] == 401
    assert mesh.post("/tokenize", {"prompt": "Hi"}, headers)[0] == 401
    assert mesh.post("/detokenize", {"tokens": [1]}, headers)[0] == 401
    assert mesh.http("GET", "/health")[0] == 200  # probes need no key


def test_http_accepts_bearer_and_x_api_key(mesh):
    assert chat(mesh, "sk-alice", "Hi")[0] == 200
    assert mesh.post(CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
                     {"x-api-key": "sk-bob"})[0] == 200
    assert mesh.http("GET", "/v1/models", headers={"authorization": f"Bearer {LEGACY}"})[0] == 200


def test_grpc_without_a_valid_key_is_unauthenticated(mesh):
    with KvmeshClient(mesh.grpc_target, retries=0) as anonymous, \
            KvmeshClient(mesh.grpc_target, api_key="sk-mallory", retries=0) as wrong:
        for client in (anonymous, wrong):
            with pytest.raises(Unauthenticated, match="Bearer <key>"):
                client.complete("Hi", max_tokens=1)
            with pytest.raises(Unauthenticated):
                client.list_models()
            assert client.health().ok


def test_the_same_tenant_hits_its_own_prefix(mesh):
    prompt = fresh_prompt()
    assert cached(mesh, "sk-alice", prompt) < NO_HIT
    assert cached(mesh, "sk-alice", prompt) >= 96


def test_another_tenant_never_hits_a_foreign_prefix(mesh):
    prompt = fresh_prompt()
    cached(mesh, "sk-alice", prompt)
    assert cached(mesh, "sk-alice", prompt) > 0
    assert cached(mesh, "sk-bob", prompt) < NO_HIT
    assert cached(mesh, LEGACY, prompt) < NO_HIT  # the tenant-less key is its own namespace too
    assert cached(mesh, "sk-bob", prompt) > 0  # bob now has his own copy


def test_a_request_cannot_choose_another_tenants_salt(mesh):
    prompt = fresh_prompt()
    cached(mesh, "sk-alice", prompt)
    for salt in ("alice", "sk-alice", ""):
        assert cached(mesh, "sk-bob", prompt, cache_salt=salt) < NO_HIT
        assert cached(mesh, LEGACY, prompt, cache_salt=salt) < NO_HIT
    status, body = complete(mesh, LEGACY, prompt, cache_salt="alice\x00")
    assert status == 400 and "NUL" in body["error"]["message"]


def test_cache_salt_still_isolates_within_a_tenant(mesh):
    prompt = fresh_prompt()
    assert cached(mesh, "sk-alice", prompt, cache_salt="conv-1") < NO_HIT
    assert cached(mesh, "sk-alice", prompt, cache_salt="conv-2") < NO_HIT
    assert cached(mesh, "sk-alice", prompt, user="conv-1") > 0  # `user` is the salt when no cache_salt


def test_grpc_and_http_share_a_tenants_namespace(mesh):
    prompt = fresh_prompt()
    with KvmeshClient(mesh.grpc_target, api_key="sk-alice") as alice, \
            KvmeshClient(mesh.grpc_target, api_key="sk-bob") as bob:
        assert alice.complete(prompt, max_tokens=2).usage.cached_tokens < NO_HIT
        assert alice.complete(prompt, max_tokens=2).usage.cached_tokens >= 96
        assert bob.complete(prompt, max_tokens=2, cache_salt="alice").usage.cached_tokens < NO_HIT
    assert cached(mesh, "sk-alice", prompt) > 0


def test_a_tenant_over_its_cap_is_refused_while_others_are_served(mesh):
    async def hold_and_probe() -> tuple[KvmeshError | None, int]:
        async with AsyncKvmeshClient(mesh.grpc_target, api_key="sk-alice", retries=0) as alice, \
                alice.generate("Hi", max_tokens=400, ignore_eos=True) as held:
            await held.__anext__()  # alice's one request is in flight
            refused = None
            try:
                await alice.complete("Hi", max_tokens=1)
            except KvmeshError as e:
                refused = e
            bob_status, _ = await asyncio.to_thread(chat, mesh, "sk-bob", "Hi")
        return refused, bob_status

    old = mesh.admission.max_per_tenant
    mesh.admission.max_per_tenant = 1
    try:
        refused, bob_status = asyncio.run(hold_and_probe())
    finally:
        mesh.admission.max_per_tenant = old
    assert isinstance(refused, Overloaded) and "tenant alice is at its quota of 1" in refused.message
    assert bob_status == 200


def test_raw_grpc_metadata_key_works_too(mesh):
    with grpc.insecure_channel(mesh.grpc_target) as channel:
        stub = mesh.stub(channel)
        request = api_pb2.GenerateRequest(text="Hi", sampling=common_pb2.SamplingParams(max_tokens=1))
        chunks = list(stub.Generate(request, metadata=(("x-api-key", "sk-bob"),), timeout=30))
        assert chunks[-1].finished
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, metadata=(("x-api-key", "sk-nobody"),), timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_tenant_key_is_no_admin_key(mesh, tmp_path):
    """Keys on, no admin key configured: a tenant's key loads nothing, and gets the answer a caller without
    any key gets, whichever path it names."""
    answers = set()
    for key in ("sk-alice", LEGACY, None):
        for path in (str(tmp_path), str(tmp_path / "none")):
            headers = {"authorization": f"Bearer {key}"} if key else {}
            status, body, _ = mesh.post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": path}, headers)
            answers.add((status, body["error"]["message"]))
    assert len(answers) == 1 and answers.pop()[0] == 403
