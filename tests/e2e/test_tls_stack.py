"""The whole stack with TLS on every gRPC hop (mutual TLS with a mesh CA): requests are served, the pool still
fills and serves, and a plaintext peer cannot talk to any service."""

from __future__ import annotations

import json
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvmesh import tls
from kvmesh.proto.v1 import api_pb2, api_pb2_grpc
from kvmesh.settings import SharedSettings

from tests.certs import make_certs, tls_env

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
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    stack = start_stack(tmp_path_factory, "tls", env=tls_env(certs))
    try:
        first = chat(stack, "Name a planet.")
        second = chat(stack, "Name a planet.")
        assert second["choices"][0]["message"] == first["choices"][0]["message"]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        member = SharedSettings(tls_cert=certs["cert"], tls_key=certs["key"], tls_ca=certs["ca"])
        with tls.channel(f"127.0.0.1:{stack.grpc_port}", cfg=member) as ch:
            info = api_pb2_grpc.KvmeshStub(ch).ListModels(api_pb2.ListModelsRequest(), timeout=10)
            assert info.models
        for s in stack.services:
            with grpc.insecure_channel(s.grpc_address) as ch, pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
    finally:
        stack.stop()
