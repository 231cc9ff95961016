"""Pool: checksums verified, layouts refused, eviction by strategy in every tier, leases, spill and promotion
between DRAM and disk, leading-run get."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import xxhash
from kvmesh.contracts.layout import KVLayout
from kvmesh.engine.eviction import make_policy

from services.cachesvc.disk import DiskTier, encode_record
from services.cachesvc.dram import DramTier
from services.cachesvc.pool import Pool
from services.cachesvc.store import LayoutMismatch, Leases, PoolFull, StoredBlock, Tier

LAYOUT = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype="fp32")  # 64 bytes
NB = LAYOUT.block_nbytes
RECORD = len(encode_record(LAYOUT.to_json(), StoredBlock(0, 0, bytes(NB))))  # one block on disk


def blocks(*keys: int, layout: KVLayout = LAYOUT) -> tuple[list[int], list[int], bytes]:
    nbytes = layout.block_nbytes
    chunks = [bytes([k % 256]) * nbytes for k in keys]
    return list(keys), [xxhash.xxh3_64_intdigest(c) for c in chunks], b"".join(chunks)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0
        self.ticks = itertools.count(1)

    def __call__(self) -> float:
        self.t = float(next(self.ticks))
        return self.t


def make_pool(dram_blocks: int = 100, disk_blocks: int = 0, disk: Path | None = None, policy: str = "lru",
              segment_blocks: int = 1, clock: Clock | None = None) -> Pool:
    clock = clock or Clock()
    leases = Leases(clock)
    tiers: list[Tier] = []
    strategy = make_policy(policy)  # one object for every tier, as Pool.from_config makes it
    if dram_blocks:
        tiers.append(DramTier(dram_blocks * NB, strategy, leases.pinned, clock))
    if disk_blocks:
        assert disk is not None
        tiers.append(DiskTier(disk, disk_blocks * RECORD, segment_blocks * RECORD, strategy, leases.pinned, clock))
    return Pool(tiers, leases, getattr(strategy, "sessions", None))


def held(pool: Pool, *keys: int, tier: str | None = None) -> list[int]:
    tiers = [t for t in pool.tiers if tier in (None, t.name)]
    return [k for k in keys if any(t.has(k) for t in tiers)]


def got(pool: Pool, *keys: int) -> list[int]:
    return [b.key for b in pool.get(LAYOUT, list(keys)).blocks]


# -- put / get -----------------------------------------------------------------------------------------------

def test_put_then_get_round_trips_bytes_and_checksums():
    p = make_pool()
    keys, sums, data = blocks(1, 2, 3)
    assert p.put(LAYOUT, keys, sums, memoryview(data)) == (3, 0)
    result = p.get(LAYOUT, keys)
    assert [b.key for b in result.blocks] == keys and [b.checksum for b in result.blocks] == sums
    assert b"".join(b.data for b in result.blocks) == data
    assert result.tiers == ["dram"] * 3
    assert (len(p.tiers[0]), p.tiers[0].used_bytes) == (3, 3 * NB)


def test_a_bad_checksum_rejects_the_whole_put():
    p = make_pool()
    keys, sums, data = blocks(1, 2, 3)
    sums[1] ^= 1
    with pytest.raises(ValueError, match=r"block 1 \(key 0x0000000000000002\) fails its checksum"):
        p.put(LAYOUT, keys, sums, data)
    assert len(p.tiers[0]) == 0 and p.tiers[0].used_bytes == 0


def test_put_checks_counts_and_lengths():
    p = make_pool()
    keys, sums, data = blocks(1, 2, 3, 4)
    with pytest.raises(ValueError, match="checksums has 3 entries for 4 block_keys"):
        p.put(LAYOUT, keys, sums[:3], data)
    with pytest.raises(ValueError, match=f"data has {4 * NB - 1} bytes, but 4 blocks of this layout take"):
        p.put(LAYOUT, keys, sums, data[:-1])
    with pytest.raises(ValueError, match="layout.num_layers must be >= 1"):
        p.put(KVLayout("m", 0, 1, 4, 2), keys, sums, data)
    with pytest.raises(ValueError, match="unknown KV dtype 'int3'"):
        p.put(KVLayout("m", 1, 1, 4, 2, dtype="int3"), keys, sums, data)


def test_keys_already_present_are_skipped():
    p = make_pool()
    p.put(LAYOUT, *blocks(1, 2))
    assert p.put(LAYOUT, *blocks(1, 2, 3)) == (1, 2)
    assert len(p.tiers[0]) == 3


def test_get_returns_the_leading_run_only():
    p = make_pool()
    p.put(LAYOUT, *blocks(1, 2, 4))
    assert got(p, 1, 2, 3, 4) == [1, 2]
    assert got(p, 9, 1) == []
    assert p.leading([1, 2, 3, 4]) == [("dram", 2)]


def test_get_is_cut_to_max_bytes():
    p = make_pool()
    p.put(LAYOUT, *blocks(1, 2, 3))
    assert [b.key for b in p.get(LAYOUT, [1, 2, 3], max_bytes=2 * NB + 1).blocks] == [1, 2]


def test_a_put_larger_than_every_tier_is_refused():
    p = make_pool(dram_blocks=2)
    with pytest.raises(PoolFull, match=f"the new blocks take {3 * NB} bytes but the DRAM tier holds at most "
                                       f"{2 * NB}"):
        p.put(LAYOUT, *blocks(1, 2, 3))


# -- layouts -------------------------------------------------------------------------------------------------

def test_get_with_another_layout_is_refused_naming_the_field():
    p = make_pool()
    p.put(LAYOUT, *blocks(1, 2))
    other = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype="fp32", tp_rank=1,
                     tp_size=2)
    with pytest.raises(LayoutMismatch, match="tp_rank: stored 0, requested 1; tp_size: stored 1, "
                                             "requested 2"):
        p.get(other, [1, 2])


def test_equal_byte_counts_are_not_equal_layouts():
    p = make_pool()
    p.put(LAYOUT, *blocks(1))
    same_bytes = KVLayout("m", num_layers=1, num_kv_heads=2, head_dim=2, block_size=2, dtype="fp32")
    assert same_bytes.block_nbytes == NB
    with pytest.raises(LayoutMismatch, match="num_kv_heads: stored 1, requested 2"):
        p.get(same_bytes, [1])


def test_a_layout_mismatch_on_disk_is_refused_too(tmp_path):
    p = make_pool(dram_blocks=0, disk_blocks=10, disk=tmp_path)
    p.put(LAYOUT, *blocks(1))
    fp16 = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype="fp16")
    with pytest.raises(LayoutMismatch, match="dtype: stored 'fp32', requested 'fp16'"):
        p.get(fp16, [1])


def test_one_key_can_be_stored_under_two_layouts():
    p = make_pool()
    fp16 = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype="fp16")
    p.put(LAYOUT, *blocks(1, 2))
    assert p.put(fp16, *blocks(1, layout=fp16)) == (1, 0)
    result = p.get(fp16, [1, 2])
    assert [b.key for b in result.blocks] == [1]  # key 2 exists only in fp32: the run ends there
    assert len(result.blocks[0].data) == fp16.block_nbytes
    assert p.tiers[0].used_bytes == 2 * NB + fp16.block_nbytes


# -- eviction order per policy, in DRAM and on disk ----------------------------------------------------------

@pytest.mark.parametrize("tier", ["dram", "disk"])
@pytest.mark.parametrize("policy, victim", [("lru", 3), ("lfu", 2), ("slru", 1)])
def test_eviction_order_follows_the_policy(tmp_path, tier, policy, victim):
    # 3: hit twice, least recent; 1: hit once; 2: never hit, most recent
    p = (make_pool(dram_blocks=3, policy=policy) if tier == "dram"
         else make_pool(dram_blocks=0, disk_blocks=3, disk=tmp_path, policy=policy))
    p.put(LAYOUT, *blocks(3))
    got(p, 3)
    got(p, 3)
    p.put(LAYOUT, *blocks(1))
    got(p, 1)
    p.put(LAYOUT, *blocks(2))
    p.put(LAYOUT, *blocks(4))
    assert held(p, 1, 2, 3, 4) == sorted({1, 2, 3, 4} - {victim})
    assert p.tiers[0].evicted == 1


def test_within_one_put_the_tail_of_a_chain_goes_first():
    p = make_pool(dram_blocks=3)
    p.put(LAYOUT, *blocks(1, 2, 3))
    p.put(LAYOUT, *blocks(4))
    assert held(p, 1, 2, 3, 4) == [1, 2, 4]


def test_priority_outlives_recency_until_it_expires():
    clock = Clock()
    p = make_pool(dram_blocks=2, policy="priority", clock=clock)
    p.put(LAYOUT, *blocks(1), priority=5, priority_s=10)  # the system prompt
    p.put(LAYOUT, *blocks(2))
    p.put(LAYOUT, *blocks(3))
    assert held(p, 1, 2, 3) == [1, 3]
    for _ in range(20):
        clock()
    p.put(LAYOUT, *blocks(4))
    assert held(p, 1, 3, 4) == [3, 4]


# -- leases --------------------------------------------------------------------------------------------------

def test_a_leased_block_survives_eviction_pressure():
    p = make_pool(dram_blocks=3)
    p.put(LAYOUT, *blocks(1, 2))
    result = p.get(LAYOUT, [1, 2], lease_s=1000)
    assert (result.lease_id > 0, result.leased) == (True, 2)
    for key in range(10, 30):
        p.put(LAYOUT, *blocks(key))
    assert held(p, 1, 2) == [1, 2]
    assert p.tiers[0].evicted == 19


def test_a_released_lease_lets_eviction_take_the_block():
    p = make_pool(dram_blocks=2)
    p.put(LAYOUT, *blocks(1))
    lease_id, n = p.lease([1, 2], lease_s=1000)
    assert n == 1
    p.put(LAYOUT, *blocks(2))
    p.put(LAYOUT, *blocks(3))
    assert held(p, 1) == [1]
    assert p.leases.release(lease_id) and not p.leases.release(lease_id)
    p.put(LAYOUT, *blocks(4))
    p.put(LAYOUT, *blocks(5))
    assert held(p, 1) == []


def test_an_expired_lease_is_reclaimed():
    clock = Clock()
    p = make_pool(dram_blocks=1, clock=clock)
    p.put(LAYOUT, *blocks(1))
    p.lease([1], lease_s=5)
    with pytest.raises(PoolFull, match="only 0 are not leased"):
        p.put(LAYOUT, *blocks(2))
    for _ in range(5):
        clock()
    assert p.put(LAYOUT, *blocks(2)) == (1, 0)
    assert held(p, 1, 2) == [2] and len(p.leases) == 0


def test_a_lease_on_get_covers_the_whole_run_not_only_the_reply():
    p = make_pool()
    p.put(LAYOUT, *blocks(1, 2, 3))
    result = p.get(LAYOUT, [1, 2, 3], max_bytes=NB, lease_s=10)
    assert ([b.key for b in result.blocks], result.leased) == ([1], 3)
    assert all(p.leases.pinned(k) for k in (1, 2, 3))


# -- DRAM -> disk ---------------------------------------------------------------------------------------------

def test_dram_evictions_spill_to_disk_and_disk_hits_are_promoted(tmp_path):
    p = make_pool(dram_blocks=2, disk_blocks=10, disk=tmp_path)
    p.put(LAYOUT, *blocks(1, 2, 3, 4))  # larger than DRAM: goes to disk directly
    assert held(p, 1, 2, 3, 4, tier="disk") == [1, 2, 3, 4]
    p.put(LAYOUT, *blocks(5))
    p.put(LAYOUT, *blocks(6))
    p.put(LAYOUT, *blocks(7))  # evicts 5 from DRAM: spilled
    assert held(p, 5, 6, 7, tier="dram") == [6, 7] and held(p, 5, tier="disk") == [5]
    result = p.get(LAYOUT, [5, 6])
    assert result.tiers == ["disk", "dram"]
    assert held(p, 5, tier="dram") == [5] and held(p, 5, tier="disk") == [5]  # promoted, disk copy kept


def test_pool_counts_are_cumulative_over_faster_tiers(tmp_path):
    p = make_pool(dram_blocks=2, disk_blocks=10, disk=tmp_path)
    p.put(LAYOUT, *blocks(3, 4, 5))  # disk
    p.put(LAYOUT, *blocks(1, 2))     # DRAM
    assert p.leading([1, 2, 3, 4, 5, 6]) == [("dram", 2), ("disk", 5)]
    assert got(p, 1, 2, 3, 4, 5, 6) == [1, 2, 3, 4, 5]


def test_drain_spills_dram_to_disk(tmp_path):
    p = make_pool(dram_blocks=5, disk_blocks=10, disk=tmp_path)
    p.put(LAYOUT, *blocks(1, 2, 3))
    assert p.drain() == 3
    assert held(p, 1, 2, 3, tier="disk") == [1, 2, 3] and len(p.tiers[0]) == 0


def test_quarantined_blocks_are_never_matched_nor_served():
    p = make_pool()
    p.put(LAYOUT, *blocks(1, 2, 3))
    p.quarantine([2])  # an instance's KV canary caught block 2 diverging
    assert got(p, 1, 2, 3) == [1] and p.leading([1, 2, 3]) == [("dram", 1)]
    p.put(LAYOUT, *blocks(2))
    assert got(p, 1, 2, 3) == [1]


def test_the_pool_tells_what_each_tier_stored_and_removed(tmp_path):
    """``Pool.on_events`` (published on pool.events for the routers' hit attribution): a store per tier, an
    eviction as a removal from the tier it left (and a store in the one it spilled to), a quarantine as a
    removal from every tier that held the keys."""
    from kvmesh.contracts.events import BlockRemoved, BlockStored

    p = make_pool(dram_blocks=2, disk_blocks=10, disk=tmp_path)
    events: list = []
    p.on_events = events.extend
    p.put(LAYOUT, *blocks(1, 2))
    assert events == [BlockStored((1, 2), None, LAYOUT.block_size, "dram")]
    events.clear()
    p.put(LAYOUT, *blocks(3))  # 2 (the chain's tail goes first) leaves DRAM for the disk
    assert events == [BlockStored((3,), None, LAYOUT.block_size, "dram"), BlockRemoved((2,), "dram", "lru"),
                      BlockStored((2,), None, LAYOUT.block_size, "disk")]
    events.clear()
    p.quarantine([2, 3, 99])
    assert events == [BlockRemoved((3,), "dram", "quarantine"), BlockRemoved((2,), "disk", "quarantine")]


def test_a_quarantine_outlives_a_restart_beside_the_disk_tier(tmp_path):
    """The disk tier's copies survive a restart, so its quarantine does: kept in ``quarantined.keys``."""
    from services.cachesvc.pool import QUARANTINE_FILE

    def pool() -> Pool:
        base = make_pool(dram_blocks=0, disk_blocks=10, disk=tmp_path / "disk")
        return Pool(base.tiers, base.leases, quarantine_file=tmp_path / "disk" / QUARANTINE_FILE)

    p = pool()
    p.put(LAYOUT, *blocks(1, 2, 3))
    p.quarantine([2])
    p.quarantine([2, 3])  # a key already quarantined is not written again
    assert got(p, 1, 2, 3) == [1]
    p.close()
    again = pool()
    assert held(again, 1, 2, 3) == [1, 2, 3] and got(again, 1, 2, 3) == [1]
    assert again.quarantined == {2, 3} and (tmp_path / "disk" / QUARANTINE_FILE).stat().st_size == 16
