"""BlockPool, the pool's DRAM tier: checksums verified, layouts refused, eviction by strategy, leading-run
get."""

import itertools

import pytest
import xxhash

from kvmesh.engine.kv_cache import KVLayout
from services.cachesvc.pool import BlockPool, LayoutMismatch, PoolFull

LAYOUT = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype="fp32")  # 64 bytes
NB = LAYOUT.block_nbytes


def blocks(*keys: int, layout: KVLayout = LAYOUT) -> tuple[list[int], list[int], bytes]:
    nbytes = layout.block_nbytes
    chunks = [bytes([k % 256]) * nbytes for k in keys]
    return list(keys), [xxhash.xxh3_64_intdigest(c) for c in chunks], b"".join(chunks)


class Clock:
    def __init__(self) -> None:
        self.ticks = itertools.count(1)

    def __call__(self) -> float:
        return float(next(self.ticks))


def pool(capacity_blocks: int = 100, policy: str = "lru") -> BlockPool:
    return BlockPool(capacity_blocks * NB, policy, clock=Clock())


def test_put_then_get_round_trips_bytes_and_checksums():
    p = pool()
    keys, sums, data = blocks(1, 2, 3)
    assert p.put(LAYOUT, keys, sums, memoryview(data)) == (3, 0)
    got = p.get(LAYOUT, keys)
    assert [b.key for b in got] == keys and [b.checksum for b in got] == sums
    assert b"".join(b.data for b in got) == data
    assert (len(p), p.used_bytes) == (3, 3 * NB)


def test_a_bad_checksum_rejects_the_whole_put():
    p = pool()
    keys, sums, data = blocks(1, 2, 3)
    sums[1] ^= 1
    with pytest.raises(ValueError, match=r"block 1 \(key 0x0000000000000002\) fails its checksum"):
        p.put(LAYOUT, keys, sums, data)
    assert len(p) == 0 and p.used_bytes == 0


def test_put_checks_counts_and_lengths():
    p = pool()
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
    p = pool()
    p.put(LAYOUT, *blocks(1, 2))
    assert p.put(LAYOUT, *blocks(1, 2, 3)) == (1, 2)
    assert len(p) == 3


def test_get_returns_the_leading_run_only():
    p = pool()
    p.put(LAYOUT, *blocks(1, 2, 4))
    assert [b.key for b in p.get(LAYOUT, [1, 2, 3, 4])] == [1, 2]
    assert p.get(LAYOUT, [9, 1]) == []
    assert p.leading([1, 2, 3, 4]) == 2


def test_get_with_another_layout_is_refused_naming_the_field():
    p = pool()
    p.put(LAYOUT, *blocks(1, 2))
    other = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype="fp32", tp_rank=1,
                     tp_size=2)
    with pytest.raises(LayoutMismatch, match="tp_rank: stored 0, requested 1; tp_size: stored 1, "
                                             "requested 2"):
        p.get(other, [1, 2])


def test_equal_byte_counts_are_not_equal_layouts():
    p = pool()
    p.put(LAYOUT, *blocks(1))
    same_bytes = KVLayout("m", num_layers=1, num_kv_heads=2, head_dim=2, block_size=2, dtype="fp32")
    assert same_bytes.block_nbytes == NB
    with pytest.raises(LayoutMismatch, match="num_kv_heads: stored 1, requested 2"):
        p.get(same_bytes, [1])


def test_one_key_can_be_stored_under_two_layouts():
    p = pool()
    fp16 = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype="fp16")
    p.put(LAYOUT, *blocks(1, 2))
    assert p.put(fp16, *blocks(1, layout=fp16)) == (1, 0)
    assert [b.key for b in p.get(fp16, [1, 2])] == [1]  # key 2 exists only in fp32: the run ends there
    assert len(p.get(fp16, [1])[0].data) == fp16.block_nbytes
    assert p.used_bytes == 2 * NB + fp16.block_nbytes


def test_lru_evicts_the_least_recently_used_first():
    p = pool(capacity_blocks=3)
    p.put(LAYOUT, *blocks(1))
    p.put(LAYOUT, *blocks(2))
    p.put(LAYOUT, *blocks(3))
    p.get(LAYOUT, [1])
    p.put(LAYOUT, *blocks(4))
    assert [k for k in (1, 2, 3, 4) if k in p] == [1, 3, 4]
    assert p.evicted == 1 and p.used_bytes == 3 * NB


def test_within_one_put_the_tail_of_a_chain_goes_first():
    p = pool(capacity_blocks=3)
    p.put(LAYOUT, *blocks(1, 2, 3))
    p.put(LAYOUT, *blocks(4))
    assert [k for k in (1, 2, 3, 4) if k in p] == [1, 2, 4]


def test_lfu_keeps_the_frequently_hit_blocks():
    p = pool(capacity_blocks=2, policy="lfu")
    p.put(LAYOUT, *blocks(1))
    p.put(LAYOUT, *blocks(2))
    p.get(LAYOUT, [1])
    p.get(LAYOUT, [1])
    p.get(LAYOUT, [2])
    p.get(LAYOUT, [2])
    p.get(LAYOUT, [1])
    p.put(LAYOUT, *blocks(3))
    assert 1 in p and 2 not in p and 3 in p


def test_a_put_larger_than_the_pool_is_refused():
    p = pool(capacity_blocks=2)
    with pytest.raises(PoolFull, match=f"the new blocks take {3 * NB} bytes but the pool holds at most "
                                       f"{2 * NB}"):
        p.put(LAYOUT, *blocks(1, 2, 3))


def test_get_is_cut_to_max_bytes():
    p = pool()
    p.put(LAYOUT, *blocks(1, 2, 3))
    assert [b.key for b in p.get(LAYOUT, [1, 2, 3], max_bytes=2 * NB + 1)] == [1, 2]
