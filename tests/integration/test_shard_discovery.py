"""cachesvc shards found through the bus: two real ``python -m services.cachesvc`` shards beat on a real nats-server;
a pool client configured with no address (an instance whose ``cachesvc_address`` is ``"nats"``) learns both from
their beats, writes back and fetches through them, and follows a shard that restarts at another port."""

from __future__ import annotations

import asyncio
import uuid

import torch
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


def test_a_pool_client_finds_the_shards_by_their_beats_and_follows_a_restart(nats_server, tmp_path):
    cluster = f"disc{uuid.uuid4().hex[:8]}"
    shards = [Subprocess(nats_server.url, cluster, tmp_path / f"shard-{i}.log", shard=str(i), shards="2",
                         durable_name=f"cachesvc-{i}", pool_copies="1") for i in range(2)]

    async def body() -> None:
        bus = await Bus.connect(nats_server.url, "finder")
        directory = ShardDirectory()
        await directory.start(bus, Subjects(cluster))
        pool = PoolClient("", LAYOUT)
        directory.on_change = pool.use
        try:
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
        finally:
            await pool.close()
            await bus.close()

    try:
        asyncio.run(asyncio.wait_for(body(), 120))
    finally:
        for s in shards:
            if s.proc is not None and s.proc.poll() is None:
                s.stop()
