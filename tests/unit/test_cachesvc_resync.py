"""Resync: a gap or a stale seq holds the instance's batches back, asks for a snapshot, then installs it and
applies only what came after it; without a snapshot the held batches are applied as they are."""

from __future__ import annotations

import asyncio

from kvmesh.bus.snapshot import Snapshot
from kvmesh.contracts.events import AllBlocksCleared, BlockStored, KVEvent
from kvmesh.contracts.ids import BlockKey
from kvmesh.contracts.messages import KVEventBatch

from services.cachesvc.index import BlockIndex, PrefixMatch
from services.cachesvc.resync import Resync

KEYS = [BlockKey(k) for k in (11, 22, 33, 44, 55)]


def stored(keys, tier="device") -> BlockStored:
    return BlockStored(block_keys=tuple(keys), parent_key=None, token_count=16, tier=tier)


def batch(seq: int, *events: KVEvent, instance: str = "p0") -> KVEventBatch:
    return KVEventBatch(instance, seq, 0.0, tuple(events))


class Instance:
    """Answers snapshot requests once ``release`` is set, with ``snapshot`` (None: nobody answers)."""

    def __init__(self, snapshot: Snapshot | None) -> None:
        self.snapshot = snapshot
        self.asked: list[str] = []
        self.release = asyncio.Event()

    async def __call__(self, instance_id: str) -> Snapshot | None:
        self.asked.append(instance_id)
        await self.release.wait()
        return self.snapshot


def run(body) -> None:
    asyncio.run(asyncio.wait_for(body(), 5))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_next_batches_apply_without_a_snapshot():
    async def body() -> None:
        index = BlockIndex()
        instance = Instance(None)
        resync = Resync(index, instance)
        resync.on_batch(batch(1, stored(KEYS[:2])))
        resync.on_batch(batch(2, stored(KEYS[2:3])))
        assert index.match_prefix(KEYS) == [PrefixMatch("p0", "device", 3)]
        assert instance.asked == [] and resync.requested == 0

    run(body)


def test_a_gap_installs_the_snapshot_then_applies_only_later_batches():
    async def body() -> None:
        index = BlockIndex()
        instance = Instance(Snapshot("p0", 5, {"device": KEYS[:4], "host": KEYS[:1]}))
        resync = Resync(index, instance)
        resync.on_batch(batch(1, stored(KEYS[:1])))
        resync.on_batch(batch(4, stored(KEYS[:3])))        # 2 and 3 were lost
        resync.on_batch(batch(5, stored(KEYS[:4])))        # in the snapshot already
        resync.on_batch(batch(6, stored(KEYS, "host")))    # after it
        assert index.match_prefix(KEYS) == [PrefixMatch("p0", "device", 1)]  # held back meanwhile
        instance.release.set()
        await settle()
        assert instance.asked == ["p0"]
        assert index.match_prefix(KEYS) == [PrefixMatch("p0", "host", 5), PrefixMatch("p0", "device", 4)]
        assert (resync.gaps, resync.applied, resync.failed) == (1, 1, 0)
        resync.on_batch(batch(7, AllBlocksCleared()))
        assert index.match_prefix(KEYS) == []

    run(body)


def test_a_restarted_instance_numbering_from_1_is_resynced():
    async def body() -> None:
        index = BlockIndex()
        instance = Instance(Snapshot("p0", 2, {"device": KEYS[:1]}))
        resync = Resync(index, instance)
        for seq in range(1, 6):
            resync.on_batch(batch(seq, stored(KEYS)))
        resync.on_batch(batch(1, AllBlocksCleared()))       # restarted: numbers from 1 again
        resync.on_batch(batch(2, stored(KEYS[:1])))
        instance.release.set()
        await settle()
        resync.on_batch(batch(3, stored(KEYS[:2])))
        assert index.match_prefix(KEYS) == [PrefixMatch("p0", "device", 2)]
        assert (resync.stale, resync.applied) == (1, 1)

    run(body)


def test_without_a_snapshot_a_restart_still_resets_the_numbering():
    async def body() -> None:
        index = BlockIndex()
        instance = Instance(None)
        instance.release.set()
        resync = Resync(index, instance)
        for seq in range(1, 6):
            resync.on_batch(batch(seq, stored(KEYS)))
        resync.on_batch(batch(1, AllBlocksCleared()))
        resync.on_batch(batch(2, stored(KEYS[:1])))
        await settle()
        resync.on_batch(batch(3, stored(KEYS[:2])))
        assert index.match_prefix(KEYS) == [PrefixMatch("p0", "device", 2)]
        assert resync.failed == 1

    run(body)


def test_without_a_snapshot_a_gap_is_applied_as_it_is():
    async def body() -> None:
        index = BlockIndex()
        instance = Instance(None)
        instance.release.set()
        resync = Resync(index, instance)
        resync.on_batch(batch(1, stored(KEYS[:1])))
        resync.on_batch(batch(3, stored(KEYS[:3])))
        await settle()
        assert index.match_prefix(KEYS) == [PrefixMatch("p0", "device", 3)]
        assert (resync.gaps, resync.failed, index.event_gaps) == (1, 1, 1)

    run(body)


def test_other_instances_are_not_held_back():
    async def body() -> None:
        index = BlockIndex()
        resync = Resync(index, Instance(None))
        resync.on_batch(batch(3, stored(KEYS), instance="p0"))  # p0 waits for its snapshot
        resync.on_batch(batch(1, stored(KEYS[:2]), instance="d0"))
        assert index.match_prefix(KEYS) == [PrefixMatch("d0", "device", 2)]
        await resync.close()

    run(body)
