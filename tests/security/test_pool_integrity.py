"""The pool of a default stack binds each block to its writer: another engine cannot shadow a block with other
bytes (readers still get the genuine one), leases are capped per caller, and GetBlocks pushes only to the
caller's own transfer endpoint."""

from __future__ import annotations

import grpc
import pytest
import xxhash
from kvmesh.contracts.layout import KVLayout
from kvmesh.identity import MeshRole
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc
from kvmesh.settings import CacheServiceSettings

from tests.security.conftest import channel

LAYOUT = KVLayout("security-test", num_layers=1, num_kv_heads=1, head_dim=8, block_size=4)
KEY = 0x5EC0_0001


def put(stack, role: MeshRole, instance: str, key: int, data: bytes) -> cache_pb2.PutBlocksResponse:
    with channel(stack, stack.service("cachesvc").grpc_address, role, instance) as ch:
        return cache_pb2_grpc.CacheServiceStub(ch).PutBlocks(cache_pb2.PutBlocksRequest(
            layout=LAYOUT.to_proto(), block_keys=[key], checksums=[xxhash.xxh3_64_intdigest(data)], data=data),
            timeout=10)


def get(stack, role: MeshRole, instance: str, key: int) -> bytes:
    with channel(stack, stack.service("cachesvc").grpc_address, role, instance) as ch:
        reply = cache_pb2_grpc.CacheServiceStub(ch).GetBlocks(cache_pb2.GetBlocksRequest(
            layout=LAYOUT.to_proto(), block_keys=[key]), timeout=10)
    return reply.data


def test_a_second_writer_cannot_shadow_a_block_and_readers_get_the_genuine_one(stack):
    genuine, poison = b"\x01" * LAYOUT.block_nbytes, b"\xee" * LAYOUT.block_nbytes
    assert put(stack, MeshRole.DECODE, "genuine-writer", KEY, genuine).stored == 1
    with pytest.raises(grpc.RpcError) as e:
        put(stack, MeshRole.PREFILL, "poisoner", KEY, poison)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "decode/genuine-writer" in e.value.details() and "cannot replace" in e.value.details()
    assert get(stack, MeshRole.BOTH, "reader", KEY) == genuine
    # the same bytes again (another engine writing back the same prefix) are skipped, not refused
    assert put(stack, MeshRole.PREFILL, "same-prefix", KEY, genuine).skipped == 1


def test_leases_are_capped_per_caller(stack):
    key = KEY + 1
    put(stack, MeshRole.DECODE, "lessee", key, b"\x02" * LAYOUT.block_nbytes)
    cap = CacheServiceSettings().max_leases_per_caller
    with channel(stack, stack.service("cachesvc").grpc_address, MeshRole.DECODE, "hoarder") as ch:
        lease = cache_pb2_grpc.CacheServiceStub(ch).LeaseBlocks
        for _ in range(cap):
            assert lease(cache_pb2.LeaseBlocksRequest(block_keys=[key], lease_s=60), timeout=10).lease_id
        with pytest.raises(grpc.RpcError) as e:
            lease(cache_pb2.LeaseBlocksRequest(block_keys=[key], lease_s=60), timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_leases_per_caller" in e.value.details()
    with channel(stack, stack.service("cachesvc").grpc_address, MeshRole.DECODE, "other") as ch:
        assert cache_pb2_grpc.CacheServiceStub(ch).LeaseBlocks(
            cache_pb2.LeaseBlocksRequest(block_keys=[key], lease_s=60), timeout=10).lease_id  # others unaffected


def test_get_blocks_pushes_only_to_the_callers_own_transfer_endpoint(stack):
    with channel(stack, stack.service("cachesvc").grpc_address, MeshRole.DECODE, "decode-0") as ch, \
            pytest.raises(grpc.RpcError) as e:
        cache_pb2_grpc.CacheServiceStub(ch).GetBlocks(cache_pb2.GetBlocksRequest(
            layout=LAYOUT.to_proto(), block_keys=[KEY], transfer_address="127.0.0.1:9", transfer_id="x",
            transfer_token="t"), timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert stack.service("decode-0").endpoints["transfer"] in e.value.details()


def test_a_repairs_copy_with_the_sessions_of_each_block_is_for_cachesvc_shards_alone(stack):
    """A copy names the sessions that hold each block (other tenants' too): an engine that asks for one is refused;
    the shard-to-shard call it is made for goes on."""
    key = KEY + 2
    put(stack, MeshRole.DECODE, "writer", key, b"\x03" * LAYOUT.block_nbytes)
    ask = cache_pb2.GetBlocksRequest(layout=LAYOUT.to_proto(), block_keys=[key], copy=True)
    with channel(stack, stack.service("cachesvc").grpc_address, MeshRole.PREFILL, "curious") as ch, \
            pytest.raises(grpc.RpcError) as e:
        cache_pb2_grpc.CacheServiceStub(ch).GetBlocks(ask, timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "cachesvc shards" in e.value.details()
    with channel(stack, stack.service("cachesvc").grpc_address, MeshRole.CACHESVC, "cachesvc-1") as ch:
        reply = cache_pb2_grpc.CacheServiceStub(ch).GetBlocks(ask, timeout=10)
    assert list(reply.block_keys) == [key] and len(reply.sessions) == 1
