"""Re-replication on a real stack (``kvmesh up --cachesvc 3``, two copies of each pooled block, mutual TLS): a
shard killed with SIGKILL loses its DRAM tier; restarted, it fetches what it lost from the other copies' shards,
so once it is done the OTHER copy of its blocks can die too and every block is still fetched whole. Without
the repair the blocks of the two shards' common slots would have no copy left. The shard-to-shard RPC refuses
bad input and every role but cachesvc's, saying what to fix."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request

import grpc
import pytest
from kvmesh import tls
from kvmesh.contracts.ids import BlockKey
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.shards import ShardMap
from kvmesh.instance.pool_client import PoolClient
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc

from .conftest import start_stack

SHARDS, COPIES = 3, 2
LAYOUT = KVLayout("repair-test", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="fp16")
NUM_BLOCKS = 600
VICTIM, OTHER = 1, 0  # restarted first; then the other copy of the slots they share dies


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # no engines: the test writes and fetches blocks as an engine does (PoolClient, an engine's certificate)
    stack = start_stack(tmp_path_factory, "repair", prefill=0, decode=0, both=0, cachesvc=SHARDS,
                        env={"KVMESH_CACHESVC_POOL_COPIES": str(COPIES)})
    yield stack
    stack.stop()


def stats(stack, shard: int) -> cache_pb2.StatsResponse:
    with tls.channel(stack.service(f"cachesvc-{shard}").grpc_address, cfg=stack.mesh_settings()) as ch:
        return cache_pb2_grpc.CacheServiceStub(ch).Stats(cache_pb2.StatsRequest(), timeout=10)


def list_blocks(stack, role: str, request: cache_pb2.ListBlocksRequest) -> grpc.RpcError:
    with tls.channel(stack.service("cachesvc-0").grpc_address, cfg=stack.mesh_settings(role, "t")) as ch, \
            pytest.raises(grpc.RpcError) as e:
        cache_pb2_grpc.CacheServiceStub(ch).ListBlocks(request, timeout=10)
    return e.value


def as_engine(stack, monkeypatch) -> None:
    """This process's channels (PoolClient's) present an engine's certificate."""
    monkeypatch.setattr(tls, "_configured", stack.mesh_settings("both", "both-test"))


async def write(address: str, keys: list[BlockKey], data: bytes) -> int:
    client = PoolClient(address, LAYOUT)
    try:
        return await client.write_back(keys, memoryview(data))
    finally:
        await client.close()


async def fetch(address: str, keys: list[BlockKey]) -> bytes:
    client = PoolClient(address, LAYOUT, timeout_s=10)
    try:
        got = await client.fetch(keys)
        return bytes(got.data) if got is not None else b""
    finally:
        await client.close()


def test_the_shard_to_shard_listing_says_what_to_fix_and_is_for_shards_alone(stack):
    view = cache_pb2.ShardView(shard=0, shards=SHARDS)
    err = list_blocks(stack, "cachesvc", cache_pb2.ListBlocksRequest(slots=bytes(513), view=view))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 512" in err.details()
    err = list_blocks(stack, "cachesvc", cache_pb2.ListBlocksRequest(slots=bytes(512)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "shard 0 of 3" in err.details()
    for role in ("both", "router", "admin"):
        err = list_blocks(stack, role, cache_pb2.ListBlocksRequest(view=view))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "cachesvc" in err.details(), role


def test_a_restarted_shard_refills_from_the_other_copies_so_a_second_death_loses_no_block(stack, monkeypatch):
    as_engine(stack, monkeypatch)
    keys = [BlockKey(int.from_bytes(os.urandom(8), "little")) for _ in range(NUM_BLOCKS)]
    data = os.urandom(NUM_BLOCKS * LAYOUT.block_nbytes)
    assert asyncio.run(write(stack.cachesvc_address, keys, data)) == NUM_BLOCKS
    smap = ShardMap(SHARDS, pool_copies=COPIES)
    ours = [k for k in keys if VICTIM in smap.pool_owners(k)]
    shared = [k for k in ours if OTHER in smap.pool_owners(k)]
    assert shared and stats(stack, VICTIM).pool_blocks == len(ours)

    # killed: its DRAM tier is gone. Restarted (with the others' addresses), it fetches what it lost
    victim = f"cachesvc-{VICTIM}"
    stack.kill(victim)
    stack.restart(victim)
    deadline = time.monotonic() + 30
    while (s := stats(stack, VICTIM)).repair_pending_slots or s.repaired_blocks < len(ours):
        assert time.monotonic() < deadline, f"not repaired: {s}"
        time.sleep(0.2)
    assert s.repaired_blocks == len(ours) and s.repaired_bytes == len(ours) * LAYOUT.block_nbytes
    assert s.pool_blocks == len(ours)
    with urllib.request.urlopen(stack.service(victim).endpoints["metrics"], timeout=10) as r:
        lines = [x for x in r.read().decode().splitlines() if x.startswith("kvmesh_cachesvc_repaired_blocks_total")]
    assert sum(float(x.rsplit(" ", 1)[1]) for x in lines) == len(ours)

    # the other copy of their common slots dies: the restarted shard's copies are the last ones, and whole
    stack.kill(f"cachesvc-{OTHER}")
    assert asyncio.run(fetch(stack.cachesvc_address, keys)) == data
