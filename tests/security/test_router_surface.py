"""The router's public surface against a default stack (tests/security/conftest.py: two tenant keys and an admin
key, every other setting the default): a gRPC message over the body limit is refused before its key is read,
``Health`` tells a caller without the admin key nothing about the instances, two tenants reusing one request id
at once both hand off cleanly, and a tenant over its quota of requests in flight gets 429 saying so."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.error
import urllib.request

import aiohttp
import grpc
import pytest
from kvmesh.proto.v1 import api_pb2, api_pb2_grpc
from kvmesh.settings import RouterSettings

from tests.security.conftest import ADMIN_KEY, auth

DEFAULTS = RouterSettings()


def router_metric(stack, name: str) -> float:
    with urllib.request.urlopen(stack.router_metrics, timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith(name))


def chat(stack, key: str, content: str, request_id: str) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{stack.router_http}/v1/chat/completions", data=body, headers={
        "content-type": "application/json", "x-request-id": request_id, "x-kvmesh-disaggregate": "always",
        **auth(key)})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["x-request-id"] == request_id  # the client sees its own id back
        return json.load(r)


def test_an_oversized_grpc_message_without_a_key_is_refused_before_authentication(stack):
    big = api_pb2.GenerateRequest(text="x" * (DEFAULTS.max_body_bytes + 1))  # no key in the metadata
    with grpc.insecure_channel(stack.router_grpc) as ch, pytest.raises(grpc.RpcError) as e:
        next(iter(api_pb2_grpc.KvmeshStub(ch).Generate(big, timeout=30)))
    # gRPC's receive limit answered, not the key check (that would be UNAUTHENTICATED)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    assert str(DEFAULTS.max_body_bytes) in e.value.details()


def test_health_without_the_admin_key_reveals_no_internal_address(stack):
    addresses = [s.grpc_address for s in stack.services if s.name != "router" and s.grpc_address]
    assert addresses
    with grpc.insecure_channel(stack.router_grpc) as ch:
        health = api_pb2_grpc.KvmeshStub(ch).Health
        for md in ((), tuple(auth("sk-alice").items())):  # no key, and a tenant's key
            reply = health(api_pb2.HealthRequest(), metadata=md, timeout=10)
            assert reply.ok and not reply.instances
            assert not any(a.encode() in reply.SerializeToString() for a in addresses)
        admin = health(api_pb2.HealthRequest(), metadata=tuple(auth(ADMIN_KEY).items()), timeout=10)
        engines = {s.grpc_address for s in stack.services if s.name.startswith(("prefill", "decode"))}
        assert {i.grpc_address for i in admin.instances} == engines  # the admin still sees them
    with urllib.request.urlopen(f"{stack.router_http}/health", timeout=10) as r:
        text = r.read().decode()
    assert not any(a in text for a in addresses)
    with pytest.raises(urllib.error.HTTPError) as e:  # Prometheus is on the internal port, not the clients'
        urllib.request.urlopen(f"{stack.router_http}/metrics", timeout=10)
    assert e.value.code == 404
    assert router_metric(stack, "kvmesh_router_instances") >= 2  # ... where it is


def test_two_tenants_reusing_one_request_id_at_once_both_hand_off_cleanly(stack):
    prompts = {"sk-alice": "alice asks about the lighthouse keeper " * 4,
               "sk-bob": "bob asks about the river boat captain " * 4}
    alone = {key: chat(stack, key, p, f"sec-alone-{key}")["choices"][0]["message"]["content"]
             for key, p in prompts.items()}
    fallbacks = router_metric(stack, "kvmesh_router_kv_fallbacks_total")

    async def both() -> list[dict]:
        return await asyncio.gather(*(asyncio.to_thread(chat, stack, key, p, "sec-same-id")
                                      for key, p in prompts.items()))

    for _ in range(3):  # at once, a few times: one decode, the same client id
        got = asyncio.run(both())
        assert [r["choices"][0]["message"]["content"] for r in got] == list(alone.values())
    assert router_metric(stack, "kvmesh_router_kv_fallbacks_total") == fallbacks  # every push was used


def test_a_tenant_over_its_quota_gets_429_saying_so(stack):
    """alice's default quota of requests in flight is held by streams waiting on a frozen decode; one more is
    refused at once, naming the setting; they end when their clients go."""
    quota = DEFAULTS.max_requests_per_tenant
    decode = stack.service("decode-0")
    url = f"{stack.router_http}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hold a slot"}], "max_tokens": 8, "stream": True}

    async def run() -> tuple[int, dict]:
        async with aiohttp.ClientSession(headers=auth("sk-alice")) as session:
            holders = [asyncio.create_task(session.post(url, json=body, timeout=aiohttp.ClientTimeout(300)))
                       for _ in range(quota)]
            try:
                deadline = time.monotonic() + 30
                while router_metric(stack, "kvmesh_router_in_flight") < quota:
                    assert time.monotonic() < deadline, "alice's requests never all got in"
                    await asyncio.sleep(0.1)
                async with session.post(url, json=body) as r:
                    return r.status, await r.json()
            finally:
                for h in holders:
                    h.cancel()
                await asyncio.gather(*holders, return_exceptions=True)

    decode.proc.send_signal(signal.SIGSTOP)
    try:
        status, reply = asyncio.run(run())
    finally:
        decode.proc.send_signal(signal.SIGCONT)
    assert status == 429
    assert f"tenant alice is at its quota of {quota} requests in flight (max_requests_per_tenant)" \
        in reply["error"]["message"]
    deadline = time.monotonic() + 60  # the slots come back, and the stack serves again
    while router_metric(stack, "kvmesh_router_in_flight") > 0:
        assert time.monotonic() < deadline, "alice's slots were never given back"
        time.sleep(0.2)
    assert chat(stack, "sk-bob", "after the freeze " * 4, "sec-after-freeze")["usage"]["completion_tokens"] == 8
