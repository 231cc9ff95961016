"""The pool's own DRAM tier (L3): whole KV blocks by block key, each with its layout and xxh3_64 checksum.

A key may be stored under several layouts (block keys do not cover dtype or TP rank, so two TP ranks write the
same key with different bytes); ``get`` only ever returns blocks whose layout equals the requested one.
Bounded by bytes; over capacity, the eviction strategy's smallest sort key goes first (ties: the block stored
last, so the tail of a chain goes before its head). Not thread-safe: the owner calls it from its event loop.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import xxhash

from kvmesh.engine.eviction import make_policy
from kvmesh.engine.eviction import now as monotonic
from kvmesh.engine.kv_cache import KVLayout


class LayoutMismatch(ValueError):
    """The requested layout differs from the stored one (a precondition, not a malformed request)."""


class PoolFull(ValueError):
    """A put larger than the whole pool."""


class StoredBlock(NamedTuple):
    key: int
    checksum: int
    data: bytes


class PutResult(NamedTuple):
    stored: int
    skipped: int


@dataclass(slots=True)
class _Entry:
    """One stored block; the attribute names are what the eviction strategies read."""

    data: bytes
    checksum: int
    order: int               # insertion counter: tie-break, later first
    last_access: float
    hit_count: int = 0
    priority: int = 0
    priority_until: float = 0.0


def check_layout(layout: KVLayout) -> int:
    """The block size in bytes of a well-formed ``layout``, else a ValueError naming the bad field."""
    for name in ("model_fingerprint", "dtype", "layout"):
        if not getattr(layout, name):
            raise ValueError(f"layout.{name} is required")
    for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
        if getattr(layout, name) < 1:
            raise ValueError(f"layout.{name} must be >= 1, got {getattr(layout, name)}")
    if not 0 <= layout.tp_rank < layout.tp_size:
        raise ValueError(f"layout.tp_rank must be in [0, tp_size={layout.tp_size}), got {layout.tp_rank}")
    return layout.block_nbytes  # ValueError on an unknown dtype


def layout_diff(stored: KVLayout, requested: KVLayout) -> str:
    """``"dtype: stored 'fp16', requested 'fp32'; ..."`` for every field that differs."""
    pairs = [(f.name, getattr(stored, f.name), getattr(requested, f.name))
             for f in dataclasses.fields(stored)]
    return "; ".join(f"{name}: stored {a!r}, requested {b!r}" for name, a, b in pairs if a != b)


class BlockPool:
    def __init__(self, capacity_bytes: int, policy: str = "lru",
                 clock: Callable[[], float] = monotonic) -> None:
        self.capacity_bytes = capacity_bytes
        self.policy = make_policy(policy)
        self.clock = clock
        self.used_bytes = 0
        self.evicted = 0
        self._blocks: dict[int, dict[KVLayout, _Entry]] = {}  # key -> layout -> block
        self._count = 0
        self._order = 0

    def __len__(self) -> int:
        """Stored blocks (a key stored under two layouts counts twice)."""
        return self._count

    def __contains__(self, key: int) -> bool:
        return key in self._blocks

    def leading(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` are stored, under any layout."""
        n = 0
        for key in keys:
            if key not in self._blocks:
                break
            n += 1
        return n

    def put(self, layout: KVLayout, keys: Sequence[int], checksums: Sequence[int],
            data: bytes | memoryview) -> PutResult:
        """Store the blocks of ``data`` (back to back, in ``keys`` order) after verifying every checksum; keys
        already stored under ``layout`` are skipped. All or nothing: any bad block rejects the whole put."""
        nbytes = check_layout(layout)
        if len(checksums) != len(keys):
            raise ValueError(f"checksums has {len(checksums)} entries for {len(keys)} block_keys")
        view = memoryview(data).cast("B")
        if len(view) != len(keys) * nbytes:
            raise ValueError(f"data has {len(view)} bytes, but {len(keys)} blocks of this layout take "
                             f"{len(keys)} x {nbytes} = {len(keys) * nbytes} bytes")
        blocks = [view[i * nbytes:(i + 1) * nbytes] for i in range(len(keys))]
        for i, (key, checksum, block) in enumerate(zip(keys, checksums, blocks)):
            actual = xxhash.xxh3_64_intdigest(block)
            if actual != checksum:
                raise ValueError(f"block {i} (key {key:#018x}) fails its checksum: sent {checksum:#018x}, "
                                 f"its bytes hash to {actual:#018x}; nothing was stored")
        new: dict[int, tuple[int, memoryview]] = {}
        for key, checksum, block in zip(keys, checksums, blocks):
            if key not in new and layout not in self._blocks.get(key, {}):
                new[key] = (checksum, block)
        need = len(new) * nbytes
        if need > self.capacity_bytes:
            raise PoolFull(f"the new blocks take {need} bytes but the pool holds at most "
                           f"{self.capacity_bytes}; put fewer blocks per call")
        self._evict(self.used_bytes + need - self.capacity_bytes)
        t = self.clock()
        for key, (checksum, block) in new.items():
            self._order += 1
            self._blocks.setdefault(key, {})[layout] = _Entry(bytes(block), checksum, self._order, t)
        self._count += len(new)
        self.used_bytes += need
        return PutResult(stored=len(new), skipped=len(keys) - len(new))

    def get(self, layout: KVLayout, keys: Sequence[int], max_bytes: int | None = None) -> list[StoredBlock]:
        """The leading run of ``keys`` stored under ``layout``, cut to ``max_bytes`` (each block returned is a
        hit for the eviction strategy). When the first key is stored only under other layouts, LayoutMismatch
        names the fields that differ."""
        nbytes = check_layout(layout)
        limit = len(keys) if max_bytes is None else min(len(keys), max_bytes // nbytes)
        entries: list[tuple[int, _Entry]] = []
        for key in keys[:limit]:
            by_layout = self._blocks.get(key)
            if by_layout is None:
                break
            entry = by_layout.get(layout)
            if entry is None:
                if not entries:
                    stored = next(iter(by_layout))
                    raise LayoutMismatch(f"block {key:#018x} is stored with another layout "
                                         f"({layout_diff(stored, layout)}); a reader must match it")
                break
            entries.append((key, entry))
        t = self.clock()
        for _, entry in entries:
            entry.last_access = t
            entry.hit_count += 1
        return [StoredBlock(key, e.checksum, e.data) for key, e in entries]

    def _evict(self, nbytes: int) -> None:
        """Free at least ``nbytes`` by evicting in the strategy's order."""
        if nbytes <= 0:
            return
        t = self.clock()
        heap = [(self.policy.sort_key(e, t), -e.order, key, layout)
                for key, by_layout in self._blocks.items() for layout, e in by_layout.items()]
        heapq.heapify(heap)
        freed = 0
        while freed < nbytes and heap:
            _, _, key, layout = heapq.heappop(heap)
            by_layout = self._blocks[key]
            freed += len(by_layout.pop(layout).data)
            if not by_layout:
                del self._blocks[key]
            self._count -= 1
            self.evicted += 1
        self.used_bytes -= freed
