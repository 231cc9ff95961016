"""A resharding keeps the pool: two real cachesvc shards (one copy of each block, a disk tier each) are restarted
one at a time as three (the new count, the same disk tiers, a new empty shard started beside the first), and the
blocks of the slots the new map gives the new shard come to it from the shards that held them (``repair.py``,
hand-over), so a pool client that finds the three shards by their beats fetches every block whole. Going down the
same way: three restarted as two and a leaving one, whose blocks the two fetch before it stops."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from kvmesh.bus.shard_directory import ShardDirectory
from kvmesh.contracts.shards import ShardMap
from kvmesh.engine.kv_cache import block_bytes, blocks_from_bytes
from kvmesh.instance.pool_client import PoolClient
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc

from tests.integration.test_cachesvc import Subprocess
from tests.integration.test_shard_discovery import finder, make_blocks, run_with

KEYS = [(11 << 40) + i * 1237 for i in range(48)]  # spread over the slots


def shards_of(nats_url: str, cluster: str, tmp_path: Path, copies: int) -> Callable[[int, int], Subprocess]:
    """Shard ``i`` of ``count`` of a cluster whose shards find each other by their beats, each with a disk tier of
    its own (the same across counts: a restart reads what the stop spilled)."""
    def shard(i: int, count: int) -> Subprocess:
        return Subprocess(nats_url, cluster, tmp_path / f"shard-{i}-of-{count}.log", shard=str(i),
                          shards=str(count), durable_name=f"cachesvc-{i}", pool_copies=str(copies), peers="nats",
                          disk_dir=str(tmp_path / f"disk-{i}"), disk_capacity_mb="64", disk_segment_mb="8",
                          disk_reserve_mb="0")
    return shard


def stats(s: Subprocess) -> cache_pb2.StatsResponse:
    with grpc.insecure_channel(s.address) as channel:
        return cache_pb2_grpc.CacheServiceStub(channel).Stats(cache_pb2.StatsRequest(), timeout=10)


async def started(shards: list[Subprocess], directory: ShardDirectory, pool: PoolClient, blocks: torch.Tensor) -> None:
    """Start ``shards``, wait until the callers' list is theirs, write ``blocks`` back under ``KEYS``."""
    for s in shards:
        await asyncio.to_thread(s.start)
    await directory.wait(30, shards=len(shards))
    assert await pool.write_back(KEYS, block_bytes(blocks)) == len(KEYS)


async def handed_over(shards: list[Subprocess]) -> list[cache_pb2.StatsResponse]:
    """The shards' stats once none of them has another shard left to ask (within a minute)."""
    deadline = asyncio.get_running_loop().time() + 60
    while True:
        got = [await asyncio.to_thread(stats, s) for s in shards]
        if not any(st.handover_pending_shards for st in got):
            return got
        assert asyncio.get_running_loop().time() < deadline, got
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("copies", [1, 2])
def test_adding_a_shard_hands_its_slots_blocks_over_instead_of_losing_them(nats_server, tmp_path, copies):
    """One copy: the new shard's blocks come from the hand-over; two: from the copies (every block was on both
    old shards)."""
    cluster = f"resh{uuid.uuid4().hex[:8]}"
    shard = shards_of(nats_server.url, cluster, tmp_path, copies)
    two = [shard(i, 2) for i in range(2)]
    three = [shard(i, 3) for i in range(3)]
    moved = [k for k in KEYS if 2 in ShardMap(3, pool_copies=copies).pool_owners(k)]
    assert moved and len(moved) < len(KEYS)  # the new shard takes some slots, the rest stay where they were
    blocks = make_blocks(len(KEYS), 5)

    async def body() -> None:
        async with finder(nats_server.url, cluster) as (directory, pool):
            await started(two, directory, pool, blocks)
            # a rolling resharding: a graceful stop spills the DRAM tier to the disk tier, which the restart reads
            await asyncio.to_thread(two[0].stop)
            await asyncio.to_thread(three[0].start)
            await asyncio.to_thread(three[2].start)
            await asyncio.sleep(1.5)  # shard 1 still serves the old count: nobody can have asked it yet
            assert [(await asyncio.to_thread(stats, s)).handover_pending_shards for s in (three[0], three[2])] \
                == [2, 2]
            await asyncio.to_thread(two[1].stop)
            await asyncio.to_thread(three[1].start)
            await directory.wait(30, shards=3)
            got = await handed_over(three)
            assert [st.repaired_blocks for st in got] == [0, 0, len(moved)]  # only the new shard's slots moved
            fetched = await pool.fetch(KEYS)
            assert fetched is not None and fetched.num_blocks == len(KEYS)
            assert torch.equal(blocks_from_bytes(pool.layout, fetched.data), blocks)
            assert "hand-over done" in three[2].log_path.read_text()

    run_with([*two, *three], body)


@pytest.mark.parametrize("copies", [1, 2])
def test_taking_a_shard_away_hands_its_blocks_over_before_it_stops(nats_server, tmp_path, copies):
    """Three shards restarted as two, the third first (as a StatefulSet rolls: the highest ordinal first) as a shard
    leaving the cluster (number 2 of 2): it owns nothing, refuses writes, and each of the two fetches from it the
    blocks of its slots; once both say so it is stopped, and every block is still fetched whole through the two."""
    cluster = f"down{uuid.uuid4().hex[:8]}"
    shard = shards_of(nats_server.url, cluster, tmp_path, copies)
    three = [shard(i, 3) for i in range(3)]
    two = [shard(i, 2) for i in range(3)]  # two[2]: the leaving one
    only_on_2 = [k for k in KEYS if ShardMap(3, pool_copies=copies).pool_owners(k) == (2,)] if copies == 1 else []
    assert copies == 2 or only_on_2  # with one copy some blocks live on the leaving shard alone
    blocks = make_blocks(len(KEYS), 9)

    async def body() -> None:
        async with finder(nats_server.url, cluster) as (directory, pool):
            await started(three, directory, pool, blocks)
            for i in (2, 1, 0):  # a graceful stop spills the DRAM tier to the disk tier, which the restart reads
                await asyncio.to_thread(three[i].stop)
                await asyncio.to_thread(two[i].start)
            await directory.wait(30, shards=2)
            assert 2 in directory.leaving(2) and len(directory.view) == 2  # callers never dial a leaving shard
            leaving = await asyncio.to_thread(stats, two[2])
            assert (leaving.view.shard, leaving.view.shards, leaving.indexed_blocks) == (2, 2, 0)
            with grpc.insecure_channel(two[2].address) as channel:  # it takes no writes, whatever view is sent
                with pytest.raises(grpc.RpcError) as e:
                    cache_pb2_grpc.CacheServiceStub(channel).PutBlocks(cache_pb2.PutBlocksRequest(
                        layout=pool.layout.to_proto(), block_keys=KEYS[:1], checksums=[0],
                        view=cache_pb2.ShardView(shard=2, shards=2)), timeout=10)
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            got = await handed_over(two[:2])
            assert sum(st.repaired_blocks for st in got) >= len(only_on_2)
            await asyncio.to_thread(two[2].stop)
            fetched = await pool.fetch(KEYS)
            assert fetched is not None and fetched.num_blocks == len(KEYS)
            assert torch.equal(blocks_from_bytes(pool.layout, fetched.data), blocks)
            assert "leaving the cluster" in two[2].log_path.read_text()

    run_with([*three, *two], body)
