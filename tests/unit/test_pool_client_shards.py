"""An engine's PoolClient over cachesvc shards (the shards are doubles that keep blocks in a dict, inline data):
each block is written to every copy's shard; a fetch gets the leading run from the first copies' shards and what
they lack from the next ones, whole and in order, with a shard dead; a write-back one shard refuses stores the
rest; only all of them failing is an error."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.shards import ShardMap
from kvmesh.instance.pool_client import PoolClient, PoolError, _Shard
from kvmesh.proto.v1 import cache_pb2
from kvmesh.transfer.header import block_checksums

LAYOUT = KVLayout("fp", num_layers=1, num_kv_heads=1, head_dim=2, block_size=4)
NB = LAYOUT.block_nbytes


def down(shard: int) -> grpc.aio.AioRpcError:
    """What a call to a dead shard raises."""
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                f"failed to connect to shard {shard}")


class Shard:
    """A cachesvc shard: its pool (key -> bytes), the view it reports, and whether it is dead."""

    def __init__(self, index: int, shards: int, pool_copies: int) -> None:
        self.index, self.shards, self.pool_copies = index, shards, pool_copies
        self.blocks: dict[int, bytes] = {}
        self.dead = False
        self.asked: list[list[int]] = []

    def _alive(self) -> None:
        if self.dead:
            raise down(self.index)

    async def Stats(self, request, metadata=(), timeout=None):
        self._alive()
        return cache_pb2.StatsResponse(view=cache_pb2.ShardView(shard=self.index, shards=self.shards,
                                                                index_copies=2, pool_copies=self.pool_copies))

    async def PutBlocks(self, request, metadata=(), timeout=None):
        self._alive()
        assert (request.view.shard, request.view.shards) == (self.index, self.shards)
        for i, key in enumerate(request.block_keys):
            self.blocks[key] = request.data[i * NB:(i + 1) * NB]
        return cache_pb2.PutBlocksResponse(stored=len(request.block_keys))

    async def GetBlocks(self, request, metadata=(), timeout=None):
        self._alive()
        self.asked.append(list(request.block_keys))
        run = []
        for key in request.block_keys:
            if key not in self.blocks:
                break
            run.append(key)
        data = b"".join(self.blocks[k] for k in run)
        return cache_pb2.GetBlocksResponse(block_keys=run, checksums=block_checksums(memoryview(data), NB),
                                           data=data)


def client(shards: int, pool_copies: int) -> tuple[PoolClient, list[Shard]]:
    pool = PoolClient(",".join(f"127.0.0.1:{1 + i}" for i in range(shards)), LAYOUT)
    doubles = [Shard(i, shards, pool_copies) for i in range(shards)]
    pool.shards = [_Shard(d, cache_pb2.ShardView(shard=i, shards=shards)) for i, d in enumerate(doubles)]
    return pool, doubles


def blocks(n: int, seed: int = 0) -> tuple[list[int], memoryview]:
    rng = random.Random(seed)
    keys = [rng.getrandbits(64) for _ in range(n)]
    return keys, memoryview(bytes(rng.getrandbits(8) for _ in range(n * NB)))


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("pool_copies", [1, 2])
def test_a_write_back_puts_each_block_on_every_copy_and_a_fetch_gets_them_back_in_order(pool_copies):
    keys, data = blocks(40)

    async def body():
        pool, shards = client(3, pool_copies)
        assert await pool.write_back(keys, data) == 40
        return shards, await pool.fetch(keys)

    shards, got = run(body())
    smap = ShardMap(3, pool_copies=pool_copies)
    for key in keys:
        assert {s.index for s in shards if key in s.blocks} == set(smap.pool_owners(key))
    assert got.num_blocks == 40 and bytes(got.data) == bytes(data)


def test_with_two_copies_a_dead_shard_costs_no_block_of_a_fetch():
    keys, data = blocks(40, seed=1)

    async def body():
        pool, shards = client(3, 2)
        await pool.write_back(keys, data)
        shards[1].dead = True
        return shards, await pool.fetch(keys)

    shards, got = run(body())
    assert got.num_blocks == 40 and bytes(got.data) == bytes(data)
    # the second round asks only for what the first lacked: the keys whose first copy is the dead shard's
    smap = ShardMap(3, pool_copies=2)
    firsts = {k for k in keys if smap.pool_owners(k)[0] == 1}
    assert all(set(asked) <= firsts for s in shards if not s.dead for asked in s.asked[1:])
    assert any(len(s.asked) == 2 for s in shards)


def test_with_two_copies_a_block_whose_first_copy_was_evicted_comes_from_the_second():
    keys, data = blocks(30, seed=2)
    smap = ShardMap(3, pool_copies=2)

    async def body():
        pool, shards = client(3, 2)
        await pool.write_back(keys, data)
        for key in keys[5:25:3]:
            del shards[smap.pool_owners(key)[0]].blocks[key]  # evicted there, kept on the other copy
        return await pool.fetch(keys)

    got = run(body())
    assert got.num_blocks == 30 and bytes(got.data) == bytes(data)


def test_with_one_copy_a_dead_shard_ends_the_run_at_its_first_key():
    keys, data = blocks(40, seed=3)
    smap = ShardMap(3)
    first = next(p for p, k in enumerate(keys) if smap.pool_owners(k)[0] == 2)

    async def body():
        pool, shards = client(3, 1)
        await pool.write_back(keys, data)
        shards[2].dead = True
        return await pool.fetch(keys)

    got = run(body())
    assert got.num_blocks == first and bytes(got.data) == bytes(data[:first * NB])


def test_a_write_back_one_shard_refuses_stores_the_rest_and_all_refusing_is_an_error():
    keys, data = blocks(40, seed=4)
    smap = ShardMap(3)

    async def body():
        pool, shards = client(3, 1)
        shards[0].dead = True
        return shards, await pool.write_back(keys, data)

    shards, sent = run(body())
    assert sent == sum(smap.pool_owners(k)[0] != 0 for k in keys)
    assert not shards[0].blocks
    assert all(k in shards[smap.pool_owners(k)[0]].blocks for k in keys if smap.pool_owners(k)[0] != 0)

    async def all_dead():
        pool, shards = client(3, 1)
        for s in shards:
            s.dead = True
        await pool.write_back(keys, data)

    with pytest.raises(PoolError, match="UNAVAILABLE: failed to connect"):
        run(all_dead())


def test_a_dead_shard_is_logged_once_per_outage_and_its_return_once(caplog):
    keys, data = blocks(40, seed=5)

    async def body():
        pool, shards = client(3, 2)
        await pool.write_back(keys, data)
        shards[0].dead = True
        for _ in range(3):
            await pool.fetch(keys)
            await pool.write_back(keys, data)
        shards[0].dead = False
        await pool.fetch(keys)

    with caplog.at_level("INFO", logger="kvmesh.instance.pool_client"):
        run(body())
    failed = [r for r in caplog.records if "cachesvc shard 0 failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelname == "WARNING"
    assert [r.getMessage() for r in caplog.records if r.getMessage().endswith("answers again")] == \
        ["cachesvc shard 0 answers again"]
