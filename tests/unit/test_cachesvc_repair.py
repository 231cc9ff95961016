"""Re-replication's decisions: which shard a restarted shard fetches each of its slots from, what a shard lists
for it, what it lacks, and that a copy read for it is no use of the block."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.sessions import SessionEvent
from kvmesh.contracts.shards import SLOTS, ShardMap
from kvmesh.proto.v1 import cache_pb2
from kvmesh.settings import CacheServiceSettings, SharedSettings

from services.cachesvc import repair as repair_mod
from services.cachesvc.repair import mask_slots, slot_mask
from tests.unit.test_cachesvc_pool import LAYOUT, blocks, make_pool

OTHER = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype="fp16")


def test_each_slot_of_a_restarted_shard_comes_from_exactly_one_other_copy():
    smap = ShardMap(3, pool_copies=2)
    plan = smap.repair_sources(1, {0, 2}, range(SLOTS))
    planned = [slot for slots in plan.values() for slot in slots]
    assert sorted(planned) == smap.pool_slots(1)  # every slot of its own, once; none of the others'
    for source, slots in plan.items():
        assert all(set(smap.pool_owners(slot)) == {1, source} for slot in slots)


def test_the_first_live_copy_in_rank_order_is_the_source():
    smap = ShardMap(4, pool_copies=3)
    mine = smap.pool_slots(3)
    plan = smap.repair_sources(3, {0, 1, 2}, mine)
    for source, slots in plan.items():
        assert all(next(s for s in smap.pool_owners(slot) if s != 3) == source for slot in slots)
    down = Counter(smap.pool_owners(slot)[0] for slot in mine if smap.pool_owners(slot)[0] != 3)
    first_down = max(down, key=lambda s: down[s])  # a shard that is the first other copy of some slots
    without = smap.repair_sources(3, {0, 1, 2} - {first_down}, mine)
    assert first_down not in without
    assert sorted(s for slots in without.values() for s in slots) == sorted(mine)  # the next copy has them


def test_a_slot_with_no_live_other_copy_waits():
    smap = ShardMap(3, pool_copies=2)
    plan = smap.repair_sources(1, {2}, smap.pool_slots(1))
    assert set(plan) == {2}
    assert all(set(smap.pool_owners(slot)) == {1, 2} for slot in plan[2])
    assert smap.repair_sources(1, set(), smap.pool_slots(1)) == {}


def test_one_copy_or_one_shard_has_nothing_to_repair():
    assert ShardMap(3, pool_copies=1).repair_sources(0, {1, 2}, range(SLOTS)) == {}
    assert ShardMap(1, pool_copies=2).repair_sources(0, set(), range(SLOTS)) == {}


def test_a_shard_lists_its_blocks_of_the_slots_asked_by_layout_without_the_quarantined():
    pool = make_pool()
    keys = [s + (i << 12) for s in (5, 6, 7) for i in range(1, 3)]  # two keys in each of slots 5, 6, 7
    pool.put(LAYOUT, *blocks(*keys))
    pool.put(OTHER, *blocks(keys[0], layout=OTHER))
    pool.quarantine([keys[1]])
    assert pool.listing({5, 7}) == {LAYOUT: [keys[0], keys[4], keys[5]], OTHER: [keys[0]]}
    assert pool.listing({9}) == {}


def test_a_block_held_only_under_another_layout_is_lacking(tmp_path):
    pool = make_pool(dram_blocks=1, disk_blocks=4, disk=tmp_path)
    pool.put(LAYOUT, *blocks(1, 2))  # wherever they went, both are held
    pool.put(OTHER, *blocks(3, layout=OTHER))
    pool.quarantine([4])
    assert pool.lacking(LAYOUT, [1, 2, 3, 4, 5]) == [3, 5]


def test_a_copy_read_for_another_shard_counts_no_hit_and_promotes_nothing(tmp_path):
    pool = make_pool(dram_blocks=1, disk_blocks=4, disk=tmp_path)
    pool.put(LAYOUT, *blocks(1))
    pool.put(LAYOUT, *blocks(2))  # 1 goes to disk
    got = pool.get(LAYOUT, [1], touch=False)
    assert [b.key for b in got.blocks] == [1] and got.tiers == ["disk"]
    assert not pool.tiers[0].has(1)  # not promoted: 2 stays in DRAM
    assert [u.hit_count for u in pool.tiers[1].usages(1)] == [0]
    pool.get(LAYOUT, [1])  # a reader's get: a use
    assert pool.tiers[0].has(1)


def test_slot_masks_round_trip_and_an_overlong_one_says_how_long_it_may_be():
    assert mask_slots(slot_mask([0, 7, 4095])) == {0, 7, 4095}
    assert len(slot_mask([1])) == SLOTS // 8
    with pytest.raises(ValueError, match="at most 512"):
        mask_slots(bytes(SLOTS // 8 + 1))


def test_repair_mb_s_zero_turns_repair_off_and_a_negative_rate_is_refused():
    from kvmesh import settings
    from kvmesh.settings import SettingsError

    assert settings.load(env={"KVMESH_CACHESVC_REPAIR_MB_S": "0"}).cachesvc.repair_mb_s == 0
    with pytest.raises(SettingsError, match="repair_mb_s"):
        settings.load(env={"KVMESH_CACHESVC_REPAIR_MB_S": "-1"})


def test_a_copys_retention_and_sessions_are_the_blocks_and_go_in_runs_of_one_of_each(tmp_path):
    """A repair copy keeps each block's priority and what is left of its time (the source's ``retention``, sent
    with the copy) and the sessions that hold it there, in as few puts as there are runs of one of each."""
    from kvmesh.proto.v1 import cache_pb2

    from services.cachesvc.repair import _copy_runs

    pool = make_pool(dram_blocks=8)
    pool.put(LAYOUT, *blocks(1), priority=90, priority_s=3600)
    pool.put(LAYOUT, *blocks(2), priority=50)  # for good
    pool.put(LAYOUT, *blocks(3))
    pool.put(LAYOUT, *blocks(4), priority=70, priority_s=1e-6)  # over by now
    left = pool.retention(1)
    assert left[0] == 90 and 3590 < left[1] <= 3600
    assert pool.retention(2) == (50, 0.0) and pool.retention(3) == (0, 0.0) and pool.retention(4) == (0, 0.0)

    a, ab = cache_pb2.BlockSessions(keys=["t/a"]), cache_pb2.BlockSessions(keys=["t/a", "t/b"])
    none = cache_pb2.BlockSessions()
    got = cache_pb2.GetBlocksResponse(block_keys=[1, 5, 2, 6, 7, 8, 9], priorities=[90, 90, 50, 0, 0, 0, 30],
                                      priority_s=[3599.6, 3600.2, 0.0, 0.0, 0.0, 0.0, 0.2],
                                      sessions=[a, a, a, none, ab, ab, none])
    assert _copy_runs(got, 7) == [(0, 2, 90, 3600.0, ("t/a",)), (2, 3, 50, 0.0, ("t/a",)), (3, 4, 0, 0.0, ()),
                                  (4, 6, 0, 0.0, ("t/a", "t/b")), (6, 7, 30, 1.0, ())]
    # an older shard sends neither, or the retention alone
    assert _copy_runs(cache_pb2.GetBlocksResponse(block_keys=[1, 2]), 2) == [(0, 2, 0, 0.0, ())]
    assert _copy_runs(cache_pb2.GetBlocksResponse(block_keys=[1, 2], priorities=[5, 5], priority_s=[0, 0]), 2) \
        == [(0, 2, 5, 0.0, ())]


def test_a_repaired_block_ranks_as_the_sessions_that_held_it_there():
    """Without the sessions a repaired block would be no session's (the first to go) until its session's next
    write-back named it: with them it is held as it was, one session's or several's, a paused session's too."""
    from kvmesh.engine.sessions import SHARED, Mark

    pool = make_pool(policy="session")
    assert pool.sessions is not None
    pool.session_signal("t/a", SessionEvent.PAUSE, expected_s=60.0)  # heard on the bus before the copy came
    pool.put(LAYOUT, *blocks(1, 2, 3))
    pool.hold_too(("t/a",), [1, 2])
    pool.hold_too(("t/a", "t/b"), [3])
    pool.hold_too((), [4])  # no session: nothing to say
    now = pool.leases.clock()
    assert [pool.sessions.holders(k) for k in (1, 2, 3)] == [1, 1, 2]
    assert [u.session_owner for k in (1, 2, 3) for u in pool.tiers[0].usages(k)] == ["t/a", "t/a", SHARED]
    assert pool.sessions.mark(1, "t/a", now) is Mark.PAUSED
    assert pool.holding([1, 3, 9]) == [("t/a",), ("t/a", "t/b"), ()]
    pool.hold_too(("t/a",), [1])  # said again: held once
    assert pool.sessions.holders(1) == 1 and pool.sessions.get("t/a").blocks == (1, 2, 3)


class _Peer:
    """A shard's gRPC as a repair sees it: refuses ``refusals`` listings (another shard count), then lists and
    serves ``held`` (key -> (checksum, bytes)) under LAYOUT."""

    def __init__(self, held: dict[int, tuple[int, bytes]], own: list[int], refusals: int = 0,
                 sessions: dict[int, tuple[str, ...]] | None = None) -> None:
        self.held, self.own, self.refusals, self.listings = held, set(own), refusals, 0
        self.sessions = sessions or {}

    async def ListBlocks(self, request, timeout=None):
        self.listings += 1
        if self.refusals:
            self.refusals -= 1
            raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "this cachesvc is shard 1 of 2, not shard 1 of 3")
        slots = mask_slots(request.slots) - (self.own if request.foreign_only else set())
        keys = [k for k in self.held if k & (SLOTS - 1) in slots]
        return cache_pb2.ListBlocksResponse(blocks=[cache_pb2.LayoutBlocks(layout=LAYOUT.to_proto(),
                                                                           block_keys=keys)] if keys else [])

    async def GetBlocks(self, request, timeout=None):
        keys = [k for k in request.block_keys if k in self.held]
        return cache_pb2.GetBlocksResponse(block_keys=keys, checksums=[self.held[k][0] for k in keys],
                                           data=b"".join(self.held[k][1] for k in keys),
                                           sessions=[cache_pb2.BlockSessions(keys=self.sessions.get(k, ()))
                                                     for k in keys])


def test_after_a_resharding_a_shard_takes_its_slots_blocks_from_every_shard_once_it_serves_the_new_count(
        monkeypatch):
    """Shard 0 of 3 (one copy of each block): shard 1 still serves the old count and refuses twice before it
    answers; shard 2 answers at once. Every block of shard 0's slots either holds comes over, none of the others'."""
    monkeypatch.setattr(repair_mod, "RETRY_S", 0.01)
    smap = ShardMap(3, pool_copies=1)
    mine = [k for k in range(1, 400) if smap.pool_owners(k) == (0,)][:6]
    theirs = [k for k in range(1, 400) if smap.pool_owners(k) != (0,)][:4]

    def held(keys: list[int]) -> dict[int, tuple[int, bytes]]:
        ks, sums, data = blocks(*keys)
        nb = LAYOUT.block_nbytes
        return {k: (c, data[i * nb:(i + 1) * nb]) for i, (k, c) in enumerate(zip(ks, sums, strict=True))}

    peers = {1: _Peer(held(mine[:4] + theirs), smap.pool_slots(1), refusals=2),
             2: _Peer(held(mine[3:]), smap.pool_slots(2), sessions={mine[4]: ("t/x",), mine[5]: ("t/x", "t/y")})}
    pool = make_pool(policy="session")
    seen_pending: list[int] = []

    async def storage(fn, *args):
        return fn(*args)

    async def main() -> None:
        cfg = CacheServiceSettings(shard=0, shards=3, pool_copies=1, peers="a:1,b:2,c:3")
        r = repair_mod.Repair(cfg, SharedSettings(), smap, pool, storage, lambda *a: None)
        r.stubs = peers  # type: ignore[assignment]
        assert (r.pending, r.handover_pending) == (0, 2)  # one copy: nothing to repair, two shards to ask
        task = asyncio.create_task(r.run())
        while not task.done():
            seen_pending.append(r.handover_pending)
            await asyncio.sleep(0.001)
        await task
        await r.close()
        assert r.blocks == len(mine)

    asyncio.run(main())
    assert pool.lacking(LAYOUT, mine) == [] and pool.lacking(LAYOUT, theirs) == theirs
    assert pool.holding(mine) == [(), (), (), (), ("t/x",), ("t/x", "t/y")]  # as they were held there
    assert (peers[1].listings, peers[2].listings) == (3, 1)  # one copy: one listing of what is foreign there
    assert 1 in seen_pending  # shard 2 asked, shard 1 still refusing
