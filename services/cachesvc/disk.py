"""The pool's disk tier (L4): append-only segment files in one directory, rebuilt by scanning them at start.

Files are ``seg-<id>.kvb``. Each record is a header, the block's layout as JSON, then the block's bytes::

    "KVB1" | layout_len u16 | data_len u32 | key u64 | checksum u64 | header_sum u64   (little-endian)

``checksum`` is the xxh3_64 of the data (the block's own checksum); ``header_sum`` the xxh3_64 of the header
before it plus the layout bytes. A put appends its blocks back to back, so a chain is read back with one
``pread`` per segment. A process crash loses nothing written: records go out with ``os.write`` (no user-space
buffer). A segment is fsynced when it is sealed and at close, so a power loss can tear only the last records of
open segments; the scan at start stops at the first record whose header, length or (last record) checksum is
wrong, and truncates the file there. Every read verifies each block's checksum again; a bad block is dropped.

A put writes before it indexes: a record is found by reads only once ``os.write`` took all its bytes. A write that
fails (``ENOSPC``, ``EIO``) is cut off where the segment's last indexed record ends and retires the segment (it
stays readable; the next put opens a new one); its blocks are not indexed, the put is refused (``PoolFull``) and
counted (``failed["write_error"]``). Before writing, the filesystem's free space is checked: a put that would leave
less than ``reserve_bytes`` free drops cold segments for it, or is refused (``failed["no_space"]``).

Capacity is the bytes of the segment files. Making room drops whole segments: the one whose hottest block
ranks lowest under the eviction strategy (older segments first on ties), never one holding a leased key.
Small segments make this closer to per-block eviction; large ones make reads and writes more sequential.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import xxhash
from kvmesh.contracts.layout import KVLayout
from kvmesh.engine.eviction import EvictionPolicy

from services.cachesvc.store import Evicted, PoolFull, Retention, StoredBlock, Usage

log = logging.getLogger(__name__)

MAGIC = b"KVB1"
HEADER = struct.Struct("<4sHIQQQ")
_MAX_GAP = 4096  # records this close in one segment are read with one pread (only headers lie between)


@dataclass(slots=True)
class _Record:
    segment: int
    offset: int              # of the data
    length: int
    checksum: int
    usage: Usage


@dataclass
class _Segment:
    path: Path
    size: int = 0
    records: list[tuple[int, KVLayout]] = field(default_factory=list)
    fd: int = -1             # read fd (append fd for the active segment)


def encode_record(layout_bytes: bytes, block: StoredBlock) -> bytes:
    head = HEADER.pack(MAGIC, len(layout_bytes), len(block.data), block.key, block.checksum, 0)[:-8]
    header_sum = xxhash.xxh3_64_intdigest(head + layout_bytes).to_bytes(8, "little")
    return b"".join((head, header_sum, layout_bytes, block.data))


class DiskTier:
    name = "disk"

    def __init__(self, directory: str | Path, capacity_bytes: int, segment_bytes: int, policy: EvictionPolicy,
                 pinned: Callable[[int], bool], clock: Callable[[], float], fsync: bool = True,
                 reserve_bytes: int = 0) -> None:
        if segment_bytes > capacity_bytes:
            raise ValueError(f"disk segment size ({segment_bytes} bytes) must not exceed the disk capacity "
                             f"({capacity_bytes} bytes)")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.segment_bytes = segment_bytes
        self.policy = policy
        self.pinned = pinned
        self.clock = clock
        self.fsync = fsync
        self.reserve_bytes = reserve_bytes  # free space on the filesystem a put must leave
        self.failed: Counter[str] = Counter()  # puts refused: no_space (the reserve), write_error (os.write)
        self.used_bytes = 0
        self.evicted = 0
        self.dropped_corrupt = 0
        self._records: dict[int, dict[KVLayout, _Record]] = {}  # key -> layout -> record
        self._segments: dict[int, _Segment] = {}
        self._active: int | None = None
        self._order = 0
        self._layouts: dict[bytes, KVLayout] = {}
        self._scan()

    def __len__(self) -> int:
        return sum(len(by_layout) for by_layout in self._records.values())

    def has(self, key: int) -> bool:
        return key in self._records

    def held_keys(self) -> Iterable[int]:
        return self._records.keys()

    def layouts(self, key: int) -> Iterable[KVLayout]:
        return self._records.get(key, {}).keys()

    def holds(self, key: int, layout: KVLayout) -> bool:
        return layout in self._records.get(key, {})

    # -- writing ---------------------------------------------------------------------------------------------

    def put(self, layout: KVLayout, blocks: Sequence[StoredBlock], retention: Retention) -> list[Evicted]:
        layout_bytes = layout.to_json()
        records = [encode_record(layout_bytes, b) for b in blocks]
        need = sum(map(len, records))
        if need > self.capacity_bytes:
            raise PoolFull(f"the new blocks take {need} bytes on disk but the disk tier holds at most "
                           f"{self.capacity_bytes}")
        self._make_room(need)
        self._make_free(need)
        t = self.clock()
        i = 0
        while i < len(records):  # one write per segment the records fill
            seg_id, seg = self._writable(len(records[i]))
            j, size = i + 1, len(records[i])
            while j < len(records) and seg.size + size + len(records[j]) <= self.segment_bytes:
                size += len(records[j])
                j += 1
            start = self._append(seg_id, seg, records[i:j])
            for block, record in zip(blocks[i:j], records[i:j]):
                start += len(record)
                self._order += 1
                self._index(block.key, layout, _Record(seg_id, start - len(block.data), len(block.data),
                                                       block.checksum, retention.usage(self._order, t, block.key)))
            i = j
        return []

    def _append(self, seg_id: int, seg: _Segment, records: Sequence[bytes]) -> int:
        """Write ``records`` at the end of segment ``seg_id``; returns where they start. A failed write is cut off
        (the segment keeps only what is indexed) and retires the segment: PoolFull, counted."""
        start = seg.size
        joined = b"".join(records)
        data = memoryview(joined)
        try:
            while data:
                data = data[os.write(seg.fd, data):]
        except OSError as e:
            self.failed["write_error"] += 1
            with contextlib.suppress(OSError):
                os.ftruncate(seg.fd, start)
            self._active = None  # appends go to a new segment; this one stays readable as indexed
            log.error("disk tier: writing %d blocks to %s failed (%s); not stored", len(records), seg.path.name, e)
            raise PoolFull(f"the disk tier could not write {len(records)} blocks: {e}") from None
        seg.size += len(joined)
        self.used_bytes += len(joined)
        return start

    def _writable(self, nbytes: int) -> tuple[int, _Segment]:
        """The active segment, rolled over to a fresh one when ``nbytes`` more would overflow it."""
        seg_id = self._active
        seg = self._segments.get(seg_id) if seg_id is not None else None
        if seg_id is None or seg is None or (seg.size and seg.size + nbytes > self.segment_bytes):
            self._seal()
            seg_id = max(self._segments, default=0) + 1
            seg = _Segment(self.dir / f"seg-{seg_id:08d}.kvb")
            try:
                seg.fd = os.open(seg.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_APPEND, 0o644)
            except OSError as e:
                self.failed["write_error"] += 1
                raise PoolFull(f"the disk tier could not open a new segment: {e}") from None
            self._segments[seg_id] = seg
            self._active = seg_id
        return seg_id, seg

    def _seal(self) -> None:
        if self._active is not None and self._active in self._segments and self.fsync:
            try:
                os.fsync(self._segments[self._active].fd)
            except OSError as e:  # a full disk: what the page cache holds is still read back until a crash
                log.error("disk tier: fsync of %s failed: %s", self._segments[self._active].path.name, e)
        self._active = None

    def free_bytes(self) -> int:
        """What the tier's filesystem has free for an unprivileged writer."""
        st = os.statvfs(self.dir)
        return st.f_bavail * st.f_frsize

    def _make_free(self, nbytes: int) -> None:
        """Leave ``reserve_bytes`` free on the filesystem after writing ``nbytes``: drop cold segments for it, or
        PoolFull (counted as ``no_space``) when even that is not enough."""
        short = nbytes + self.reserve_bytes - self.free_bytes()
        if short <= 0:
            return
        try:
            self._make_room(short, over=short)
        except PoolFull:
            pass
        if (free := self.free_bytes()) < nbytes + self.reserve_bytes:
            self.failed["no_space"] += 1
            raise PoolFull(f"the disk tier's filesystem has {free} bytes free: {nbytes} more would leave less than "
                           f"the {self.reserve_bytes} reserved (disk_reserve_mb)")

    def _make_room(self, nbytes: int, over: int | None = None) -> None:
        """Drop whole segments, coldest first, until ``nbytes`` more fit (``over``: until that many bytes are
        dropped); PoolFull (nothing dropped) when leases keep too much."""
        target = self.used_bytes - over if over is not None else self.capacity_bytes - nbytes
        over = self.used_bytes - target
        if over <= 0:
            return
        t = self.clock()
        ranked = sorted((max((self.policy.sort_key(self._records[k][lay].usage, t) for k, lay in seg.records),
                             default=()), seg_id)
                        for seg_id, seg in self._segments.items()
                        if not any(self.pinned(k) for k, _ in seg.records))
        if sum(self._segments[seg_id].size for _, seg_id in ranked) < over:
            raise PoolFull(f"the disk tier needs {over} more bytes but what it holds is leased; "
                           "retry when leases end")
        for _, seg_id in ranked:
            if self.used_bytes <= target:
                break
            self._drop(seg_id)

    def _drop(self, seg_id: int) -> None:
        seg = self._segments.pop(seg_id)
        for key, layout in seg.records:
            by_layout = self._records[key]
            del by_layout[layout]
            if not by_layout:
                del self._records[key]
        self.evicted += len(seg.records)
        self.used_bytes -= seg.size
        if seg_id == self._active:
            self._active = None
        if seg.fd >= 0:
            os.close(seg.fd)
        seg.path.unlink(missing_ok=True)

    def usages(self, key: int) -> Iterable[Usage]:
        return [r.usage for r in self._records.get(key, {}).values()]

    def rerank(self, key: int) -> None:
        """Nothing to do: segments are ranked afresh at each eviction pass."""

    def _index(self, key: int, layout: KVLayout, record: _Record) -> None:
        old = self._records.setdefault(key, {}).get(layout)
        if old is not None:  # a later copy wins; the earlier one stays as dead bytes in its segment
            self._segments[old.segment].records.remove((key, layout))
        self._records[key][layout] = record
        self._segments[record.segment].records.append((key, layout))

    # -- reading ---------------------------------------------------------------------------------------------

    def read(self, layout: KVLayout, keys: Sequence[int], touch: bool = True) -> list[StoredBlock]:
        """The leading run of ``keys`` held under ``layout``, verified; adjacent records are read at once."""
        run: list[tuple[int, _Record]] = []
        for key in keys:
            record = self._records.get(key, {}).get(layout)
            if record is None:
                break
            run.append((key, record))
        out: list[StoredBlock] = []
        t = self.clock()
        for group in self._contiguous(run):
            first, last = group[0][1], group[-1][1]
            start = first.offset
            buf = memoryview(os.pread(self._fd(first.segment), last.offset + last.length - start, start))
            for key, record in group:
                data = buf[record.offset - start:record.offset - start + record.length]
                if len(data) != record.length or xxhash.xxh3_64_intdigest(data) != record.checksum:
                    log.error("disk block %#018x in %s fails its checksum; dropped",
                              key, self._segments[record.segment].path.name)
                    self._forget(key, layout)
                    return out
                if touch:
                    record.usage.hit(t)
                out.append(StoredBlock(key, record.checksum, data))
        return out

    @staticmethod
    def _contiguous(run: list[tuple[int, _Record]]) -> list[list[tuple[int, _Record]]]:
        """Split ``run`` into groups that one pread each can serve: same segment, ascending, small gaps."""
        groups: list[list[tuple[int, _Record]]] = []
        for key, record in run:
            prev = groups[-1][-1][1] if groups else None
            if (prev is not None and record.segment == prev.segment
                    and 0 <= record.offset - (prev.offset + prev.length) <= _MAX_GAP):
                groups[-1].append((key, record))
            else:
                groups.append([(key, record)])
        return groups

    def _fd(self, seg_id: int) -> int:
        seg = self._segments[seg_id]
        if seg.fd < 0:
            seg.fd = os.open(seg.path, os.O_RDONLY)
        return seg.fd

    def _forget(self, key: int, layout: KVLayout) -> None:
        record = self._records[key].pop(layout)
        if not self._records[key]:
            del self._records[key]
        self._segments[record.segment].records.remove((key, layout))
        self.dropped_corrupt += 1

    def close(self) -> None:
        self._seal()
        for seg in self._segments.values():
            if seg.fd >= 0:
                os.close(seg.fd)
                seg.fd = -1

    # -- start: rebuild the index from the files ---------------------------------------------------------------

    def _scan(self) -> None:
        for path in sorted(self.dir.glob("seg-*.kvb")):
            try:
                seg_id = int(path.stem.split("-")[1])
            except ValueError:
                log.warning("ignoring %s: not a segment name", path)
                continue
            self._segments[seg_id] = _Segment(path)
            self._scan_segment(seg_id)
            self.used_bytes += self._segments[seg_id].size
        if self._segments:
            log.info("disk tier %s: %d blocks in %d segments, %d bytes", self.dir, len(self),
                     len(self._segments), self.used_bytes)

    def _scan_segment(self, seg_id: int) -> None:
        seg = self._segments[seg_id]
        size = seg.path.stat().st_size
        last: tuple[int, KVLayout, _Record] | None = None
        with open(seg.path, "rb") as f:
            offset = 0
            while offset + HEADER.size <= size:
                head = os.pread(f.fileno(), HEADER.size, offset)
                magic, layout_len, length, key, checksum, header_sum = HEADER.unpack(head)
                layout_bytes = os.pread(f.fileno(), layout_len, offset + HEADER.size)
                data_offset = offset + HEADER.size + layout_len
                if (magic != MAGIC or len(layout_bytes) != layout_len or data_offset + length > size
                        or xxhash.xxh3_64_intdigest(head[:-8] + layout_bytes) != header_sum):
                    break
                layout = self._layout(layout_bytes)
                if layout is None:
                    break
                self._order += 1
                last = (key, layout, _Record(seg_id, data_offset, length, checksum, Usage(self._order, 0.0, key=key)))
                self._index(*last)
                offset = data_offset + length
            if last is not None:  # only the last record of a segment can be torn mid-data
                key, layout, record = last
                if xxhash.xxh3_64_intdigest(os.pread(f.fileno(), record.length, record.offset)) != record.checksum:
                    self._forget(key, layout)
                    offset = record.offset - HEADER.size - len(layout.to_json())
        if offset < size:
            log.warning("disk tier: %s has a torn or corrupt tail at byte %d of %d; truncated",
                        seg.path.name, offset, size)
            os.truncate(seg.path, offset)
        seg.size = offset

    def _layout(self, layout_bytes: bytes) -> KVLayout | None:
        layout = self._layouts.get(layout_bytes)
        if layout is None:
            try:
                layout = KVLayout.from_json(layout_bytes)
            except (ValueError, TypeError):
                return None
            self._layouts[layout_bytes] = layout
        return layout
