"""The whole stack as ``kvmesh up`` starts it by default, with mutual TLS on every gRPC hop and every KV transfer
connection (its own mesh CA, a certificate per service): requests are served with their KV pushed (no
fallback), the pool still fills and serves, a plaintext peer cannot talk to any service or transfer endpoint,
and the router's client-facing port is not the mesh's (plaintext unless given a certificate of its own)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvmesh import tls
from kvmesh.contracts.layout import KVLayout
from kvmesh.proto.v1 import api_pb2, api_pb2_grpc
from kvmesh.transfer import TransferClient, TransferRejected

from .conftest import start_stack

pytestmark = pytest.mark.slow


def chat(stack, content: str) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 8,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def test_a_tls_mesh_serves_and_refuses_plaintext_peers(tmp_path_factory):
    stack = start_stack(tmp_path_factory, "tls")
    try:
        first = chat(stack, "Name a planet.")
        second = chat(stack, "Name a planet.")
        assert second["choices"][0]["message"] == first["choices"][0]["message"]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        with grpc.insecure_channel(stack.router_grpc) as ch:  # clients need no mesh certificate
            info = api_pb2_grpc.KvmeshStub(ch).ListModels(api_pb2.ListModelsRequest(), timeout=10)
            assert info.models
        internal = [s for s in stack.services if s.name != "router"]
        for s in internal:  # a mesh member (an operator's certificate) reaches every internal service
            with tls.channel(s.grpc_address, cfg=stack.mesh_settings()) as ch:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        with urllib.request.urlopen(stack.router_metrics, timeout=10) as r:
            metrics = r.read().decode()
        assert "kvmesh_router_kv_fallbacks_total 0.0" in metrics  # the KV went prefill -> decode over TLS
        for s in internal:
            with grpc.insecure_channel(s.grpc_address) as ch, pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
            if "transfer" in s.endpoints:
                with pytest.raises(TransferRejected, match="takes TLS only"):
                    asyncio.run(plain_push(s.endpoints["transfer"]))
    finally:
        stack.stop()


async def plain_push(address: str) -> None:
    layout = KVLayout("any", num_layers=1, num_kv_heads=1, head_dim=4, block_size=4)
    async with TransferClient() as client:
        await client.push(address, "r@p#0", layout, bytes(layout.block_nbytes), [], 4, token="none")
