"""The pool's DRAM tier (L3): blocks in process memory, bounded by bytes, evicted by the configured strategy
(smallest sort key first; ties: the block stored last, so a chain's tail goes before its head). Leased keys are
never evicted. What it evicts is returned to the caller, which spills it to the next tier."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvmesh.contracts.layout import KVLayout
from kvmesh.engine.eviction import EvictionPolicy

from services.cachesvc.store import Evicted, PoolFull, Retention, StoredBlock, Usage, VictimQueue


@dataclass(slots=True)
class _Entry:
    block: StoredBlock
    usage: Usage


class DramTier:
    name = "dram"

    def __init__(self, capacity_bytes: int, policy: EvictionPolicy, pinned: Callable[[int], bool],
                 clock: Callable[[], float]) -> None:
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self.pinned = pinned
        self.clock = clock
        self.used_bytes = 0
        self.evicted = 0
        self._blocks: dict[int, dict[KVLayout, _Entry]] = {}  # key -> layout -> block
        self._victims = VictimQueue(policy, self._usage)
        self._count = 0
        self._order = 0

    def __len__(self) -> int:
        """Stored blocks (a key stored under two layouts counts twice)."""
        return self._count

    def has(self, key: int) -> bool:
        return key in self._blocks

    def held_keys(self) -> Iterable[int]:
        return self._blocks.keys()

    def layouts(self, key: int) -> Iterable[KVLayout]:
        return self._blocks.get(key, {}).keys()

    def holds(self, key: int, layout: KVLayout) -> bool:
        return layout in self._blocks.get(key, {})

    def put(self, layout: KVLayout, blocks: Sequence[StoredBlock], retention: Retention) -> list[Evicted]:
        need = sum(len(b.data) for b in blocks)
        if need > self.capacity_bytes:
            raise PoolFull(f"the new blocks take {need} bytes but the DRAM tier holds at most "
                           f"{self.capacity_bytes}; put fewer blocks per call")
        evicted = self._evict(self.used_bytes + need - self.capacity_bytes)
        t = self.clock()
        for b in blocks:
            self._order += 1
            usage = retention.usage(self._order, t, b.key)
            self._blocks.setdefault(b.key, {})[layout] = _Entry(StoredBlock(b.key, b.checksum, bytes(b.data)),
                                                                usage)
            self._victims.touch(b.key, layout, t)
        self._count += len(blocks)
        self.used_bytes += need
        return evicted

    def read(self, layout: KVLayout, keys: Sequence[int], touch: bool = True) -> list[StoredBlock]:
        t = self.clock()
        out = []
        for key in keys:
            entry = self._blocks.get(key, {}).get(layout)
            if entry is None:
                break
            if touch:
                entry.usage.hit(t)
                self._victims.touch(key, layout, t)
            out.append(entry.block)
        return out

    def usages(self, key: int) -> Iterable[Usage]:
        return [e.usage for e in self._blocks.get(key, {}).values()]

    def rerank(self, key: int) -> None:
        t = self.clock()
        for layout in self._blocks.get(key, {}):
            self._victims.touch(key, layout, t)

    def close(self) -> None:
        pass

    def drain(self) -> list[Evicted]:
        """Everything held, hottest first, emptying the tier (a graceful stop spills it to disk)."""
        t = self.clock()
        items = sorted(((self.policy.sort_key(e.usage, t), e.usage.order, layout, e.block)
                        for by_layout in self._blocks.values() for layout, e in by_layout.items()),
                       key=lambda item: item[:2], reverse=True)
        self._blocks.clear()
        self._victims = VictimQueue(self.policy, self._usage)
        self._count = self.used_bytes = 0
        return [Evicted(layout, block) for _, _, layout, block in items]

    def _usage(self, entry: tuple[int, KVLayout]) -> Usage:
        return self._blocks[entry[0]][entry[1]].usage

    def _nbytes(self, entry: tuple[int, KVLayout]) -> int:
        return len(self._blocks[entry[0]][entry[1]].block.data)

    def _evict(self, nbytes: int) -> list[Evicted]:
        if nbytes <= 0:
            return []
        out = []
        for key, layout in self._victims.pick(nbytes, self.pinned, self._nbytes, self.clock(), self.name):
            by_layout = self._blocks[key]
            block = by_layout.pop(layout).block
            if not by_layout:
                del self._blocks[key]
            self.used_bytes -= len(block.data)
            out.append(Evicted(layout, block))
        self._count -= len(out)
        self.evicted += len(out)
        return out
