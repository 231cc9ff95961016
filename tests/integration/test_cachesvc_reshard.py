"""A resharding keeps the pool: two real cachesvc shards (one copy of each block, a disk tier each) are restarted
one at a time as three (the new count, the same disk tiers, a new empty shard started beside the first), and the
blocks of the slots the new map gives the new shard come to it from the shards that held them (``repair.py``,
hand-over), so a pool client that finds the three shards by their beats fetches every block whole."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
import torch
from kvmesh.contracts.shards import ShardMap
from kvmesh.engine.kv_cache import block_bytes, blocks_from_bytes
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc

from tests.integration.test_cachesvc import Subprocess
from tests.integration.test_shard_discovery import finder, make_blocks, run_with

KEYS = [(11 << 40) + i * 1237 for i in range(48)]  # spread over the slots


def stats(s: Subprocess) -> cache_pb2.StatsResponse:
    with grpc.insecure_channel(s.address) as channel:
        return cache_pb2_grpc.CacheServiceStub(channel).Stats(cache_pb2.StatsRequest(), timeout=10)


@pytest.mark.parametrize("copies", [1, 2])
def test_adding_a_shard_hands_its_slots_blocks_over_instead_of_losing_them(nats_server, tmp_path, copies):
    """One copy: the new shard's blocks come from the hand-over; two: from the copies (every block was on both
    old shards)."""
    cluster = f"resh{uuid.uuid4().hex[:8]}"

    def shard(i: int, count: int) -> Subprocess:
        return Subprocess(nats_server.url, cluster, tmp_path / f"shard-{i}-of-{count}.log", shard=str(i),
                          shards=str(count), durable_name=f"cachesvc-{i}", pool_copies=str(copies), peers="nats",
                          disk_dir=str(tmp_path / f"disk-{i}"), disk_capacity_mb="64", disk_segment_mb="8",
                          disk_reserve_mb="0")

    two = [shard(i, 2) for i in range(2)]
    three = [shard(i, 3) for i in range(3)]
    moved = [k for k in KEYS if 2 in ShardMap(3, pool_copies=copies).pool_owners(k)]
    assert moved and len(moved) < len(KEYS)  # the new shard takes some slots, the rest stay where they were
    blocks = make_blocks(len(KEYS), 5)

    async def body() -> None:
        async with finder(nats_server.url, cluster) as (directory, pool):
            for s in two:
                await asyncio.to_thread(s.start)
            await directory.wait(30, shards=2)
            assert await pool.write_back(KEYS, block_bytes(blocks)) == len(KEYS)
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
            deadline = asyncio.get_running_loop().time() + 60
            while True:
                got = [await asyncio.to_thread(stats, s) for s in three]
                if not any(st.handover_pending_shards for st in got):
                    break
                assert asyncio.get_running_loop().time() < deadline, got
                await asyncio.sleep(0.2)
            assert [st.repaired_blocks for st in got] == [0, 0, len(moved)]  # only the new shard's slots moved
            fetched = await pool.fetch(KEYS)
            assert fetched is not None and fetched.num_blocks == len(KEYS)
            assert torch.equal(blocks_from_bytes(pool.layout, fetched.data), blocks)
            assert "hand-over done" in three[2].log_path.read_text()

    run_with([*two, *three], body)
