"""cachesvc shards found through the bus: two real ``python -m services.cachesvc`` shards beat on a real nats-server;
a pool client configured with no address (an instance whose ``cachesvc_address`` is ``"nats"``) learns both from
their beats, writes back and fetches through them, and follows a shard that restarts at another port."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import torch
import xxhash
from kvmesh.bus import Bus, Subjects
from kvmesh.bus.shard_directory import ShardDirectory
from kvmesh.contracts.layout import KVLayout
from kvmesh.engine.kv_cache import block_bytes, blocks_from_bytes
from kvmesh.instance.pool_client import PoolClient

from tests.integration.test_cachesvc import Subprocess

LAYOUT = KVLayout("tiny-model", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
KEYS = [(7 << 40) + i * 977 for i in range(16)]  # spread over both shards' slots


def make_blocks(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim),
                       generator=g)


@contextlib.asynccontextmanager
async def finder(nats_url: str, cluster: str) -> AsyncIterator[tuple[ShardDirectory, PoolClient]]:
    """An instance's view of the pool with ``cachesvc_address = "nats"``: a pool client given no address, fed
    the shard lists the beats make."""
    bus = await Bus.connect(nats_url, "finder")
    directory = ShardDirectory()
    await directory.start(bus, Subjects(cluster))
    pool = PoolClient("", LAYOUT)
    directory.on_change = pool.use
    try:
        yield directory, pool
    finally:
        await pool.close()
        await bus.close()


def run_with(shards: list[Subprocess], body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    try:
        asyncio.run(asyncio.wait_for(body(), 120))
    finally:
        for s in shards:
            if s.proc is not None and s.proc.poll() is None:
                s.stop()


def test_a_pool_client_finds_the_shards_by_their_beats_and_follows_a_restart(nats_server, tmp_path):
    cluster = f"disc{uuid.uuid4().hex[:8]}"
    shards = [Subprocess(nats_server.url, cluster, tmp_path / f"shard-{i}.log", shard=str(i), shards="2",
                         durable_name=f"cachesvc-{i}", pool_copies="1") for i in range(2)]

    async def body() -> None:
        async with finder(nats_server.url, cluster) as (directory, pool):
            blocks = make_blocks(len(KEYS), 1)
            assert await pool.write_back(KEYS, block_bytes(blocks)) == 0  # no shard known yet: nothing sent
            assert await pool.fetch(KEYS) is None
            for s in shards:
                await asyncio.to_thread(s.start)
            view = await directory.wait(30)
            assert view == (shards[0].address, shards[1].address)
            assert await pool.write_back(KEYS, block_bytes(blocks)) == len(KEYS)
            got = await pool.fetch(KEYS)
            assert got is not None and got.num_blocks == len(KEYS)
            assert torch.equal(blocks_from_bytes(LAYOUT, got.data), blocks)

            # shard 1 restarts on another free port: the callers follow its beat there
            old = shards[1].address
            await asyncio.to_thread(shards[1].stop)
            await asyncio.to_thread(shards[1].start)
            assert shards[1].address != old
            deadline = asyncio.get_running_loop().time() + 30
            while directory.view != (shards[0].address, shards[1].address):
                assert asyncio.get_running_loop().time() < deadline, directory.view
                await asyncio.sleep(0.2)
            again = make_blocks(len(KEYS), 2)
            keys = [k + 1 for k in KEYS]
            assert await pool.write_back(keys, block_bytes(again)) == len(keys)
            got = await pool.fetch(keys)
            assert got is not None and torch.equal(blocks_from_bytes(LAYOUT, got.data), again)

    run_with(shards, body)


def test_a_restarted_shard_finds_its_peers_by_their_beats_and_repairs_from_them(nats_server, tmp_path):
    """``peers = "nats"``: two shards keeping two copies of every block; shard 1 is killed (its DRAM tier goes)
    and started again on another port, learns the other shard's address from its beat, and fetches back every
    block it lost, the blocks a tenant pinned with their priority and what is left of its time."""
    import signal

    import grpc
    from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc

    cluster = f"rep{uuid.uuid4().hex[:8]}"
    shards = [Subprocess(nats_server.url, cluster, tmp_path / f"shard-{i}.log", shard=str(i), shards="2",
                         durable_name=f"cachesvc-{i}", pool_copies="2", peers="nats") for i in range(2)]

    def stats(s: Subprocess) -> cache_pb2.StatsResponse:
        with grpc.insecure_channel(s.address) as channel:
            return cache_pb2_grpc.CacheServiceStub(channel).Stats(cache_pb2.StatsRequest(), timeout=10)

    pinned = [k + 3 for k in KEYS[:4]]
    view = [cache_pb2.ShardView(shard=i, shards=2) for i in range(2)]

    def pin(s: Subprocess, i: int) -> None:  # a tenant's retention: priority 80 for 10 minutes
        data = block_bytes(make_blocks(len(pinned), 4))
        nb = LAYOUT.block_nbytes
        sums = [xxhash.xxh3_64_intdigest(data[j * nb:(j + 1) * nb]) for j in range(len(pinned))]
        with grpc.insecure_channel(s.address) as channel:
            cache_pb2_grpc.CacheServiceStub(channel).PutBlocks(cache_pb2.PutBlocksRequest(
                layout=LAYOUT.to_proto(), block_keys=pinned, checksums=sums, data=bytes(data), priority=80,
                priority_duration_s=600, view=view[i]), timeout=10)

    def retention(s: Subprocess) -> list[tuple[int, float]]:
        with grpc.insecure_channel(s.address) as channel:
            got = cache_pb2_grpc.CacheServiceStub(channel).GetBlocks(cache_pb2.GetBlocksRequest(
                layout=LAYOUT.to_proto(), block_keys=pinned, copy=True, view=view[1]), timeout=10)
        return list(zip(got.priorities, got.priority_s))

    async def body() -> None:
        async with finder(nats_server.url, cluster) as (directory, pool):
            for s in shards:
                await asyncio.to_thread(s.start)
            await directory.wait(30, shards=2)
            assert await pool.write_back(KEYS, block_bytes(make_blocks(len(KEYS), 3))) == len(KEYS)
            for i, s in enumerate(shards):
                await asyncio.to_thread(pin, s, i)
            total = len(KEYS) + len(pinned)
            assert [stats(s).pool_blocks for s in shards] == [total] * 2
            await asyncio.to_thread(shards[1].stop, signal.SIGKILL)
            await asyncio.to_thread(shards[1].start)
            deadline = asyncio.get_running_loop().time() + 60
            while (st := await asyncio.to_thread(stats, shards[1])).repaired_blocks < total:
                assert asyncio.get_running_loop().time() < deadline, st
                await asyncio.sleep(0.2)
            assert st.pool_blocks == total and st.repair_pending_slots == 0
            kept = await asyncio.to_thread(retention, shards[1])  # the copies kept the tenant's retention
            assert len(kept) == len(pinned) and all(p == 80 and 500 < left <= 600 for p, left in kept), kept
            assert "repair: the shards' beats name" in shards[1].log_path.read_text()

    run_with(shards, body)
