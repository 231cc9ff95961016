"""``kvmesh.bus.shard_directory``: the shard list callers with ``cachesvc_address = "nats"`` use, from the shards'
beats (the beats of real cachesvc processes: tests/integration/test_shard_discovery.py)."""

from __future__ import annotations

import pytest
from kvmesh.bus.bus import from_its_sender
from kvmesh.bus.shard_directory import ShardDirectory
from kvmesh.bus.subjects import Subjects
from kvmesh.contracts.messages import CacheShardBeat, CodecError, decode


def beat(shard: int, shards: int, address: str | None = None) -> CacheShardBeat:
    return CacheShardBeat(shard, shards, f"10.0.0.{shard}:50060" if address is None else address, 1.0, 2, 2)


def test_a_beat_goes_over_the_wire_and_names_its_own_shard_only():
    b = beat(1, 3)
    assert decode(b.encode()) == b and CacheShardBeat.decode(b.encode()) == b
    subjects = Subjects("u")
    assert from_its_sender(subjects.cachesvc_shard(1), b)
    assert not from_its_sender(subjects.cachesvc_shard(2), b)  # shard 1 beating as shard 2
    for bad in (CacheShardBeat(-1, 3, "a:1", 1.0), CacheShardBeat(0, 0, "a:1", 1.0)):
        with pytest.raises(CodecError, match="not a shard of that many"):
            decode(bad.encode())
    leaving = CacheShardBeat(3, 3, "a:1", 1.0)  # a shard leaving a cluster of 3
    assert decode(leaving.encode()) == leaving


def test_a_leaving_shard_is_never_in_a_view_only_among_those_leaving():
    d = ShardDirectory(fresh_s=5.0)
    for shard in (0, 1, 2, 3):  # 2 and 3 leave a cluster of 2
        d.heard(beat(shard, 2), now=1.0)
    assert d.view == ("10.0.0.0:50060", "10.0.0.1:50060")
    assert d.leaving(2, now=2.0) == {2: "10.0.0.2:50060", 3: "10.0.0.3:50060"}
    assert d.leaving(2, now=7.0) == {}  # stale: stopped
    d.heard(beat(2, 3), now=8.0)  # still beating the old count: not leaving (yet)
    assert d.leaving(2, now=8.0) == {} and d.leaving(3, now=8.0) == {}


def test_the_view_is_a_whole_list_in_shard_order_and_changes_only_to_another_whole_list():
    seen: list[tuple[str, ...]] = []
    d = ShardDirectory(fresh_s=5.0, on_change=seen.append)
    d.heard(beat(1, 2), now=0.0)
    assert d.view == ()  # shard 0 not heard yet
    d.heard(beat(0, 2), now=1.0)
    assert d.view == ("10.0.0.0:50060", "10.0.0.1:50060") and seen == [d.view]
    d.heard(beat(0, 2), now=2.0)
    assert len(seen) == 1  # the same list again is no change
    # shard 1 restarts at another address: the list follows once it beats again
    d.heard(beat(1, 2, "10.0.0.9:50061"), now=3.0)
    assert d.view == ("10.0.0.0:50060", "10.0.0.9:50061")
    # resharding to 3, one shard at a time: the callers keep the list of 2 until all 3 beat with 3
    d.heard(beat(0, 3), now=4.0)
    d.heard(beat(2, 3), now=4.5)
    assert d.view == ("10.0.0.0:50060", "10.0.0.9:50061")
    d.heard(beat(1, 3), now=5.0)
    assert d.view == ("10.0.0.0:50060", "10.0.0.1:50060", "10.0.0.2:50060") and len(seen) == 3


def test_a_stale_beat_or_one_without_an_address_makes_no_list():
    d = ShardDirectory(fresh_s=5.0)
    d.heard(beat(0, 2), now=0.0)
    d.heard(beat(1, 2), now=10.0)  # shard 0's beat is 10 s old: not evidence of a list of 2 now
    assert d.view == ()
    d.heard(beat(0, 2, ""), now=11.0)  # a wildcard-bound shard without advertise_host
    assert d.view == ()
    d.heard(beat(0, 2), now=12.0)
    assert d.view == ("10.0.0.0:50060", "10.0.0.1:50060")


def test_the_router_swaps_its_shard_list_whole_and_closes_only_channels_no_list_has():
    import asyncio

    from kvmesh.settings import RouterSettings

    from services.router.core import Router

    async def body() -> None:
        router = Router(RouterSettings(cachesvc_address="nats"))
        try:
            router._use_shards(("127.0.0.1:1", "127.0.0.1:2"))
            first = router.shards
            first.down.add(1)
            router._use_shards(("127.0.0.1:1", "127.0.0.1:3"))  # shard 1 restarted at another port
            assert router.shards is not first and not router.shards.down and len(router.cache) == 2
            assert router.shards.names is not first.names  # holder ids are per shard list
            await router._retire({"127.0.0.1:2"})
            assert set(router._channels) == {"127.0.0.1:1", "127.0.0.1:3"}
            router._use_shards(("127.0.0.1:1", "127.0.0.1:2"))  # back before the old one's channel was retired
            await router._retire({"127.0.0.1:3", "127.0.0.1:2"})
            assert set(router._channels) == {"127.0.0.1:1", "127.0.0.1:2"}
        finally:
            router.tokenize_pool.shutdown()
            for channel in router._channels.values():
                await channel.close()

    asyncio.run(body())


def test_wait_returns_a_list_of_the_count_asked_for_or_what_there_is_at_its_deadline():
    import asyncio

    async def body() -> None:
        d = ShardDirectory()
        d.heard(beat(0, 1))
        assert await d.wait(0.1, shards=2) == ("10.0.0.0:50060",)  # a list of 1 only, at the deadline
        asyncio.get_running_loop().call_later(0.05, lambda: (d.heard(beat(0, 2)), d.heard(beat(1, 2))))
        assert await d.wait(5, shards=2) == ("10.0.0.0:50060", "10.0.0.1:50060")

    asyncio.run(asyncio.wait_for(body(), 10))
