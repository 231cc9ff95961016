"""DiskTier: append-only segment files that survive a restart (clean or not), a torn tail ignored, corrupt
blocks never served, whole-segment eviction that spares leased blocks, runs read with one pread."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
from kvmesh.contracts.layout import KVLayout
from kvmesh.engine.eviction import make_policy

from services.cachesvc import disk as disk_module
from services.cachesvc.disk import DiskTier, encode_record
from services.cachesvc.store import Leases, PoolFull, Retention, StoredBlock

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


def failing_writes(monkeypatch, after_bytes: int, errno_: int = 28) -> None:
    """``os.write`` in the disk tier takes ``after_bytes`` more bytes, then fails (28: ENOSPC), as a full disk."""
    left = [after_bytes]
    real = os.write

    def write(fd: int, data) -> int:
        if left[0] <= 0:
            raise OSError(errno_, os.strerror(errno_))
        n = real(fd, bytes(data)[:left[0]])
        left[0] -= n
        return n

    monkeypatch.setattr(disk_module.os, "write", write)


def test_a_write_that_fails_half_way_indexes_nothing_and_keeps_the_segment_readable(tmp_path, monkeypatch):
    t = tier(tmp_path)
    kept = [block(1), block(2)]
    put(t, *kept)
    failing_writes(monkeypatch, RECORD + RECORD // 2)  # one record and a half of the next
    with pytest.raises(PoolFull, match="could not write"):
        put(t, block(3), block(4))
    assert not t.has(3) and not t.has(4) and t.failed["write_error"] == 1
    assert read(t, [1, 2]) == kept
    monkeypatch.undo()
    later = block(5)
    put(t, later)  # a fresh segment: the failed one stays as indexed
    assert read(t, [5]) == [later] and t.used_bytes == 3 * RECORD
    t.close()
    again = tier(tmp_path)
    assert read(again, [1, 2]) == kept and read(again, [5]) == [later] and not again.has(3)


def test_a_put_that_would_eat_the_free_space_reserve_drops_cold_segments_or_is_refused(tmp_path, monkeypatch):
    t = tier(tmp_path, capacity_records=100, segment_records=2)
    t.reserve_bytes = 2 * RECORD
    monkeypatch.setattr(t, "free_bytes", lambda: 8 * RECORD - t.used_bytes)  # a filesystem of 8 records
    put(t, block(1), block(2))
    put(t, block(3), block(4))
    put(t, block(5), block(6))  # 6 written, 2 free: the reserve
    put(t, block(7), block(8))  # the coldest segment goes for it
    assert not t.has(1) and not t.has(2) and all(t.has(k) for k in (3, 4, 5, 6, 7, 8))
    assert t.failed["no_space"] == 0
    with pytest.raises(PoolFull, match="disk_reserve_mb"):
        put(t, *(block(k) for k in range(10, 17)))  # 7 records: more than all it could drop frees
    assert not t.has(10) and t.failed["no_space"] == 1


SHORT_WRITE = """
import os, resource, signal, sys
from pathlib import Path
from services.cachesvc.store import PoolFull
from tests.unit.test_cachesvc_disk import RECORD, block, put, read, tier

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit write() fails with EFBIG instead of a signal
t = tier(Path(sys.argv[1]))
kept = [block(1), block(2)]
put(t, *kept)
resource.setrlimit(resource.RLIMIT_FSIZE, (3 * RECORD + RECORD // 2, resource.RLIM_INFINITY))
try:
    put(t, block(3), block(4))
except PoolFull as e:
    print("refused", t.failed["write_error"], t.has(3), t.has(4), read(t, [1, 2]) == kept,
          os.path.getsize(next(Path(sys.argv[1]).glob("seg-*"))) == 2 * RECORD)
"""


def test_a_real_short_write_leaves_the_segment_as_indexed(tmp_path):
    """The kernel's own short write (a file-size limit in a child process: a write past it takes what fits and the
    next fails): the record that did not fit is not indexed, the segment is cut back to what is."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "libs"), str(root)])}
    out = subprocess.run([sys.executable, "-c", SHORT_WRITE, str(tmp_path)], cwd=root, env=env, capture_output=True,
                         check=False,
                         text=True, timeout=60)
    assert out.stdout.split() == ["refused", "1", "False", "False", "True", "True"], out.stderr
