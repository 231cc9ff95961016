"""Which blocks have another copy in the cluster, for eviction that drops those before a last copy: cachesvc
knows every copy (its index of every instance's tiers, and its own pool), so it tells each instance which of its
blocks gained another copy (``KVCopies.shared``) or lost the last other one (``sole``), and marks the pool's own
blocks that an instance holds too.

Best effort and incremental: it looks only at the keys an events batch or a put touched, and says only what
changed something (a block one instance just stored alone is sole already). Copies the pool drops when it
evicts, and an instance's ``AllBlocksCleared``, are not followed: a block may be taken for replicated a little
longer than it is, which costs a fetch, never a wrong token.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvmesh.contracts.events import BlockRemoved, BlockStored
from kvmesh.contracts.ids import BlockKey, InstanceId
from kvmesh.contracts.messages import KVCopies, KVEventBatch

from services.cachesvc.index import SLOT_MASK, BlockIndex


@dataclass
class CopyChanges:
    """What to tell: per instance its ``KVCopies``; the pool's blocks an instance holds too, or no longer."""

    instances: dict[str, KVCopies] = field(default_factory=dict)
    pool_shared: list[int] = field(default_factory=list)
    pool_sole: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.instances or self.pool_shared or self.pool_sole)


class CopyTracker:
    def __init__(self, index: BlockIndex, in_pool: Callable[[int], bool], slots: Sequence[bool] | None = None) -> None:
        """``in_pool``: whether the pool holds a key (any tier; safe from the event loop). ``slots``: a shard speaks
        only for the keys whose slot ranks it first (their first index copy and first pool copy), so two shards
        indexing a key do not both tell, one of them without seeing the pool's copy."""
        self.index = index
        self.in_pool = in_pool
        self.slots = slots

    def after_batch(self, batch: KVEventBatch) -> CopyChanges:
        """What changed with ``batch`` (already applied to the index)."""
        stored: list[int] = []
        removed: list[int] = []
        for event in batch.events:
            if isinstance(event, BlockStored):
                stored += event.block_keys
            elif isinstance(event, BlockRemoved):
                removed += event.block_keys
        moved = set(stored) & set(removed)  # between an instance's own tiers: its copies did not change
        return self._changes([k for k in stored if k not in moved], [k for k in removed if k not in moved])

    def after_put(self, keys: Iterable[int]) -> CopyChanges:
        """The pool stored ``keys``: the instances that hold them have another copy now."""
        return self._changes(list(keys), [])

    def _changes(self, stored: list[int], removed: list[int]) -> CopyChanges:
        shared: dict[str, list[int]] = defaultdict(list)
        sole: dict[str, list[int]] = defaultdict(list)
        out = CopyChanges()
        slots = self.slots
        for keys, gained in ((stored, True), (removed, False)):
            for key in dict.fromkeys(keys):
                if slots is not None and not slots[key & SLOT_MASK]:
                    continue
                holders = self.index.instances_holding(key)
                pool = self.in_pool(key)
                copies = len(holders) + pool
                if gained and copies >= 2:
                    for h in holders:
                        shared[h].append(key)
                    if pool:
                        out.pool_shared.append(key)
                elif not gained and copies == 1:
                    for h in holders:
                        sole[h].append(key)
                    if pool:
                        out.pool_sole.append(key)
        for inst in shared.keys() | sole.keys():
            out.instances[inst] = KVCopies(InstanceId(inst), tuple(BlockKey(k) for k in shared.get(inst, ())),
                                           tuple(BlockKey(k) for k in sole.get(inst, ())))
        return out
