"""DiskTier: append-only segment files that survive a restart (clean or not), a torn tail ignored, corrupt
blocks never served, whole-segment eviction that spares leased blocks, runs read with one pread."""

from __future__ import annotations

import os
from pathlib import Path

import xxhash
from kvmesh.contracts.layout import KVLayout
from kvmesh.engine.eviction import make_policy

from services.cachesvc import disk as disk_module
from services.cachesvc.disk import DiskTier, encode_record
from services.cachesvc.store import Leases, Retention, StoredBlock

LAYOUT = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype="fp32")
FP16 = KVLayout("m", num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype="fp16")
RECORD = len(encode_record(LAYOUT.to_json(), StoredBlock(0, 0, bytes(LAYOUT.block_nbytes))))


def block(key: int, layout: KVLayout = LAYOUT) -> StoredBlock:
    data = os.urandom(layout.block_nbytes)
    return StoredBlock(key, xxhash.xxh3_64_intdigest(data), data)


def tier(path: Path, capacity_records: int = 100, segment_records: int = 100,
         leases: Leases | None = None) -> DiskTier:
    leases = Leases(lambda: 0.0) if leases is None else leases
    return DiskTier(path, capacity_records * RECORD, segment_records * RECORD, make_policy("lru"), leases.pinned,
                    lambda: 0.0)


def put(t: DiskTier, *blocks: StoredBlock, layout: KVLayout = LAYOUT) -> None:
    t.put(layout, list(blocks), Retention())


def read(t: DiskTier, keys: list[int], layout: KVLayout = LAYOUT) -> list[StoredBlock]:
    return [StoredBlock(b.key, b.checksum, bytes(b.data)) for b in t.read(layout, keys)]


def test_blocks_survive_a_clean_restart_with_their_layouts(tmp_path):
    t = tier(tmp_path)
    fp32, fp16 = [block(k) for k in (1, 2, 3)], block(1, FP16)
    put(t, *fp32)
    put(t, fp16, layout=FP16)
    t.close()
    again = tier(tmp_path)
    assert read(again, [1, 2, 3]) == fp32
    assert read(again, [1], FP16) == [fp16]
    assert (len(again), again.used_bytes) == (4, t.used_bytes)


def test_blocks_survive_a_crash_without_close(tmp_path):
    t = tier(tmp_path)
    blocks = [block(k) for k in range(5)]
    put(t, *blocks)                     # no close(): the process dies here
    assert read(tier(tmp_path), list(range(5))) == blocks


def test_a_torn_last_record_is_ignored_and_cut_off(tmp_path):
    t = tier(tmp_path)
    blocks = [block(k) for k in range(3)]
    put(t, *blocks)
    t.close()
    (segment,) = tmp_path.glob("seg-*.kvb")
    good_size = segment.stat().st_size
    with open(segment, "ab") as f:      # a crash halfway through the next record
        f.write(encode_record(LAYOUT.to_json(), block(9))[:RECORD // 2])
    again = tier(tmp_path)
    assert read(again, [0, 1, 2, 9]) == blocks
    assert segment.stat().st_size == good_size
    put(again, block(9))
    assert [b.key for b in tier(tmp_path).read(LAYOUT, [0, 1, 2, 9])] == [0, 1, 2, 9]


def test_a_last_record_with_bad_data_is_dropped_at_start(tmp_path):
    t = tier(tmp_path)
    put(t, block(1), block(2))
    t.close()
    (segment,) = tmp_path.glob("seg-*.kvb")
    with open(segment, "r+b") as f:     # the size was written, the data was not
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 0xFF]))
    again = tier(tmp_path)
    assert [b.key for b in again.read(LAYOUT, [1, 2])] == [1]
    assert segment.stat().st_size == RECORD


def test_a_corrupt_block_is_never_served(tmp_path):
    t = tier(tmp_path)
    put(t, block(1), block(2), block(3))
    (segment,) = tmp_path.glob("seg-*.kvb")
    with open(segment, "r+b") as f:     # flip a byte inside block 2's data
        f.seek(2 * RECORD - 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert [b.key for b in t.read(LAYOUT, [1, 2, 3])] == [1]
    assert not t.holds(2, LAYOUT) and t.dropped_corrupt == 1


def test_a_run_written_together_is_read_with_one_pread(tmp_path, monkeypatch):
    t = tier(tmp_path)
    put(t, *[block(k) for k in range(8)])
    calls = []
    real = os.pread
    monkeypatch.setattr(disk_module.os, "pread", lambda fd, n, off: calls.append(n) or real(fd, n, off))
    assert len(t.read(LAYOUT, list(range(8)))) == 8
    assert calls == [8 * RECORD - (RECORD - LAYOUT.block_nbytes)]


def test_eviction_drops_whole_segments_oldest_first(tmp_path):
    t = tier(tmp_path, capacity_records=4, segment_records=2)
    put(t, block(1), block(2))
    put(t, block(3), block(4))
    put(t, block(5))
    assert [k for k in range(1, 6) if t.has(k)] == [3, 4, 5]
    assert len(list(tmp_path.glob("seg-*.kvb"))) == 2
    assert t.used_bytes == 3 * RECORD == sum(p.stat().st_size for p in tmp_path.glob("seg-*.kvb"))


def test_a_segment_holding_a_leased_block_is_spared(tmp_path):
    leases = Leases(lambda: 0.0)
    t = tier(tmp_path, capacity_records=4, segment_records=2, leases=leases)
    put(t, block(1), block(2))
    put(t, block(3), block(4))
    leases.grant([1], ttl_s=100)
    put(t, block(5))
    assert [k for k in range(1, 6) if t.has(k)] == [1, 2, 5]


def test_a_restart_keeps_the_capacity_accounting(tmp_path):
    t = tier(tmp_path, capacity_records=4, segment_records=2)
    put(t, block(1), block(2))
    put(t, block(3))
    t.close()
    again = tier(tmp_path, capacity_records=4, segment_records=2)
    put(again, block(4), block(5))
    assert [k for k in range(1, 6) if again.has(k)] == [3, 4, 5]
