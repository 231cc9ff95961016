"""Every internal RPC of a default stack refuses callers without a mesh certificate and callers whose certificate
names a role the RPC is not for, says what to fix, and counts the refusal; the roles the design gives each flow
get through."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from kvmesh.authz import allowed
from kvmesh.identity import MeshRole
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc, worker_pb2, worker_pb2_grpc

from tests.security.conftest import auth, channel

# (service in the stack, stub, method, an empty request) for every internal RPC
RPCS = [
    *[("cachesvc", cache_pb2_grpc.CacheServiceStub, m, getattr(cache_pb2, f"{m}Request")())
      for m in ("MatchPrefix", "MatchPrefixBatch", "PutBlocks", "GetBlocks", "LeaseBlocks", "ReleaseLease", "Stats",
                "GrantPut", "ListBlocks")],
    ("prefill-0", worker_pb2_grpc.PrefillStub, "Prefill", worker_pb2.PrefillRequest()),
    ("decode-0", worker_pb2_grpc.DecodeStub, "Decode", worker_pb2.DecodeRequest()),
    *[(s, worker_pb2_grpc.AdaptersStub, m, getattr(worker_pb2, f"{m}Request")())
      for s in ("prefill-0", "decode-0") for m in ("LoadLoRA", "UnloadLoRA", "ListLoRA")],
]
IDS = [f"{s}:{m}" for s, _, m, _ in RPCS]


def call(ch: grpc.Channel, stub, method: str, request) -> None:
    reply = getattr(stub(ch), method)(request, timeout=10)
    if method == "Decode":  # a stream: read it to learn its status
        list(reply)


def refusal(stack, service: str, stub, method: str, request, role: MeshRole | None) -> grpc.RpcError:
    with channel(stack, stack.service(service).grpc_address, role) as ch, pytest.raises(grpc.RpcError) as e:
        call(ch, stub, method, request)
    return e.value


@pytest.mark.parametrize(("service", "stub", "method", "request_"), RPCS, ids=IDS)
def test_a_caller_without_a_mesh_certificate_is_refused(stack, service, stub, method, request_):
    err = refusal(stack, service, stub, method, request_, None)
    assert err.code() == grpc.StatusCode.UNAVAILABLE  # the TLS handshake never completes: nothing is read


@pytest.mark.parametrize(("service", "stub", "method", "request_"), RPCS, ids=IDS)
def test_every_role_the_rpc_is_not_for_is_refused_with_what_to_fix(stack, service, stub, method, request_):
    full = f"/{stub.__name__.removesuffix('Stub').join(('kvmesh.v1.', ''))}/{method}"
    wrong = [r for r in MeshRole if r not in allowed(full)]
    assert wrong and len(wrong) < len(MeshRole)  # the table names this RPC, and not for everyone
    for role in wrong:
        err = refusal(stack, service, stub, method, request_, role)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, (role, err)
        assert f"not for {role}/attacker" in err.details() and "the roles that may call it are" in err.details()


def test_refusals_are_counted_by_rpc(stack):
    refusal(stack, "cachesvc", cache_pb2_grpc.CacheServiceStub, "PutBlocks", cache_pb2.PutBlocksRequest(),
            MeshRole.ROUTER)
    with urllib.request.urlopen(stack.service("cachesvc").endpoints["metrics"], timeout=10) as r:
        metrics = r.read().decode()
    line = next(x for x in metrics.splitlines() if x.startswith('kvmesh_cachesvc_calls_refused_total{rpc="Cache'
                                                                'Service/PutBlocks"}'))
    assert float(line.split()[-1]) >= 1


def test_the_flows_the_design_has_get_through(stack):
    with channel(stack, stack.service("cachesvc").grpc_address, MeshRole.ROUTER, "router") as ch:
        assert cache_pb2_grpc.CacheServiceStub(ch).MatchPrefix(cache_pb2.MatchPrefixRequest(), timeout=10) \
            is not None
        batch = cache_pb2.MatchPrefixBatchRequest(requests=[cache_pb2.MatchPrefixRequest()] * 2)
        assert len(cache_pb2_grpc.CacheServiceStub(ch).MatchPrefixBatch(batch, timeout=10).responses) == 2
    with channel(stack, stack.service("cachesvc").grpc_address, MeshRole.DECODE, "decode-9") as ch:
        grant = cache_pb2_grpc.CacheServiceStub(ch).GrantPut(cache_pb2.GrantPutRequest(num_blocks=1), timeout=10)
        assert grant.token
    with channel(stack, stack.service("decode-0").grpc_address, MeshRole.ROUTER, "router") as ch:
        assert worker_pb2_grpc.AdaptersStub(ch).ListLoRA(worker_pb2.ListLoRARequest(), timeout=10) is not None


def test_the_stack_serves_through_the_mesh(stack):
    import json
    body = json.dumps({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{stack.router_http}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", **auth()})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert json.load(r)["usage"]["completion_tokens"] >= 1
