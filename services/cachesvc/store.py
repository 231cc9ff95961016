"""The storage interface every pool tier implements (DRAM, disk, an external store), the types they share, and
leases.

A tier stores whole blocks by ``(block key, layout)``: block keys do not cover dtype or TP rank, so two TP ranks
write the same key with different bytes, and a reader only ever gets blocks whose layout equals its own. Every
block keeps its xxh3_64 checksum; a tier verifies it before handing bytes out.

Threading: tiers and leases are owned by the pool's storage thread. ``Tier.has`` is the exception: it is one
dict membership test (atomic under the GIL), so ``MatchPrefix`` calls it from the event loop without waiting
behind disk or network I/O; the answer may be a moment stale, which an advisory prefix count tolerates.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, Protocol

from kvmesh.contracts.layout import KVLayout
from kvmesh.engine.eviction import EvictionPolicy
from kvmesh.engine.eviction_queue import EvictionQueue


class LayoutMismatch(ValueError):
    """The requested layout differs from the stored one (a precondition, not a malformed request)."""


class Shadowing(ValueError):
    """A put of a key the pool holds, with other bytes than its writer's: the first writer's block stands."""


class TooManyLeases(ValueError):
    """A caller holds ``max_leases_per_caller`` leases already."""


class PoolFull(ValueError):
    """No room: the blocks are larger than the tier, or what would have to go is leased."""


class StoreUnavailable(RuntimeError):
    """An external store failed (not the caller's fault; retry later)."""


class StoredBlock(NamedTuple):
    key: int
    checksum: int
    data: bytes | memoryview


class Evicted(NamedTuple):
    """A block a tier let go of, with what the next tier needs to keep it."""

    layout: KVLayout
    block: StoredBlock


class PutResult(NamedTuple):
    stored: int
    skipped: int


class Retention(NamedTuple):
    """What a put says about keeping its blocks: retention priority (the ``priority`` and session-aware
    eviction strategies) that outlives lower ones until ``until`` (monotonic seconds; ``inf`` = forever), and the
    session whose request wrote them (``owner``; "" = none)."""

    priority: int = 0
    until: float = 0.0
    owner: str = ""

    def usage(self, order: int, now: float, key: int) -> Usage:
        """A new block's :class:`Usage` under this retention."""
        return Usage(order, now, priority=self.priority, priority_until=self.until, key=key,
                     session_owner=self.owner)


@dataclasses.dataclass(slots=True)
class Usage:
    """Per stored block: what the eviction strategies read (see ``kvmesh.engine.eviction.Evictable``)."""

    order: int               # insertion counter: tie-break, later first (so a chain's tail goes first)
    last_access: float
    hit_count: int = 0
    priority: int = 0
    priority_until: float = 0.0
    key: int | None = None   # the block key (what sessions hold)
    session_owner: str = ""  # the session that wrote or holds it ("" none, ``sessions.SHARED`` several)
    replicated: bool = False  # an engine instance holds a copy too (cachesvc's index)

    def hit(self, now: float) -> None:
        self.last_access = now
        self.hit_count += 1


class Tier(Protocol):
    """One storage tier of the pool. ``put`` receives blocks already verified and not yet held under
    ``layout``; ``read`` returns the leading run of ``keys`` it holds under ``layout``, verified, and counts a use
    of each (a hit; ``touch=False``: a copy for another shard, no use)."""

    name: str                # "dram" | "disk" | "external": the tier MatchPrefix and Stats report
    capacity_bytes: int      # 0 when the tier does not know (an external store manages its own)
    used_bytes: int
    evicted: int

    def __len__(self) -> int: ...
    def has(self, key: int) -> bool: ...                        # under any layout; safe from any thread
    def held_keys(self) -> Iterable[int]: ...                   # every key held (storage thread)
    def layouts(self, key: int) -> Iterable[KVLayout]: ...
    def holds(self, key: int, layout: KVLayout) -> bool: ...
    def put(self, layout: KVLayout, blocks: Sequence[StoredBlock], retention: Retention) -> list[Evicted]: ...
    def read(self, layout: KVLayout, keys: Sequence[int], touch: bool = True) -> list[StoredBlock]: ...
    def usages(self, key: int) -> Iterable[Usage]: ...          # what the strategy ranks, per layout held
    def rerank(self, key: int) -> None: ...                     # its usages changed: rank them again
    def close(self) -> None: ...


def check_layout(layout: KVLayout) -> int:
    """The block size in bytes of a well-formed ``layout``, else a ValueError naming the bad field."""
    return layout.check().block_nbytes


def layout_diff(stored: KVLayout, requested: KVLayout) -> str:
    """``"dtype: stored 'fp16', requested 'fp32'; ..."`` for every field that differs."""
    pairs = [(f.name, getattr(stored, f.name), getattr(requested, f.name))
             for f in dataclasses.fields(stored)]
    return "; ".join(f"{name}: stored {a!r}, requested {b!r}" for name, a, b in pairs if a != b)


def pick_victims(entries: Iterable[tuple[int, KVLayout, Usage, int]], policy: EvictionPolicy,
                 pinned: Callable[[int], bool], nbytes: int, now: float, tier: str) -> list[tuple[int, KVLayout]]:
    """Which ``(key, layout)`` of ``entries`` (key, layout, usage, size) to evict, in the strategy's order
    (smallest sort key first; ties: the one stored last), to free at least ``nbytes`` without touching a leased
    key. PoolFull when even every unleased block would not be enough."""
    if nbytes <= 0:
        return []
    heap = [(policy.sort_key(usage, now), -usage.order, key, layout, size)
            for key, layout, usage, size in entries if not pinned(key)]
    free = sum(item[-1] for item in heap)
    if free < nbytes:
        raise PoolFull(f"the {tier} tier needs {nbytes} more bytes but only {free} are not leased; "
                       "retry when leases end")
    heapq.heapify(heap)
    victims = []
    while nbytes > 0:
        *_, key, layout, size = heapq.heappop(heap)
        victims.append((key, layout))
        nbytes -= size
    return victims


class VictimQueue:
    """The ``(key, layout)`` entries of one tier in the strategy's order, on the shared eviction queue
    (kvmesh.engine.eviction_queue): O(log n) per store, hit and eviction instead of ranking every entry per
    pass. ``usage`` maps an entry to its :class:`Usage`; the tier calls ``touch`` after it stored or read one and
    ``forget`` when it dropped one by other means."""

    def __init__(self, policy: EvictionPolicy, usage: Callable[[tuple[int, KVLayout]], Usage]) -> None:
        self._queue: EvictionQueue[tuple[int, KVLayout]] = EvictionQueue(policy, usage)

    def __len__(self) -> int:
        return len(self._queue)

    def touch(self, key: int, layout: KVLayout, now: float) -> None:
        self._queue.push((key, layout), now)

    def forget(self, key: int, layout: KVLayout) -> None:
        self._queue.discard((key, layout))

    def pick(self, nbytes: int, pinned: Callable[[int], bool], size: Callable[[tuple[int, KVLayout]], int],
             now: float, tier: str) -> list[tuple[int, KVLayout]]:
        """Take entries in the strategy's order (ties: the one stored or used last), skipping leased keys,
        until they free at least ``nbytes``; the caller drops them. PoolFull, with the queue as it was, when
        every unleased entry would not be enough."""
        victims: list[tuple[int, KVLayout]] = []
        leased: list[tuple[int, KVLayout]] = []
        freed = 0
        while freed < nbytes:
            entry = self._queue.pop(now)
            if entry is None:
                break
            if pinned(entry[0]):
                leased.append(entry)
                continue
            victims.append(entry)
            freed += size(entry)
        for entry in leased + (victims if freed < nbytes else []):
            self._queue.push(entry, now)
        if freed < nbytes:
            raise PoolFull(f"the {tier} tier needs {nbytes} more bytes but only {freed} are not leased; "
                           "retry when leases end")
        return victims


class Leases:
    """Readers pin block keys (every layout, every tier) for a while; eviction skips pinned keys. A lease ends
    when released or when it expires; expired ones are reclaimed by ``reap`` (the pool calls it before every
    eviction pass, the server once a second)."""

    def __init__(self, clock: Callable[[], float], per_holder: int = 0) -> None:
        """``per_holder``: the most leases one named holder (a caller's mesh identity) may hold (0: no cap)."""
        self.clock = clock
        self.per_holder = per_holder
        self._leases: dict[int, tuple[float, tuple[int, ...]]] = {}  # id -> (deadline, keys)
        self._pins: Counter[int] = Counter()                          # key -> leases holding it
        self._holders: dict[int, str] = {}                            # id -> its named holder
        self._held: Counter[str] = Counter()                          # holder -> leases it holds
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def pinned_keys(self) -> int:
        return len(self._pins)

    def pinned(self, key: int) -> bool:
        return key in self._pins

    def grant(self, keys: Sequence[int], ttl_s: float, holder: str = "") -> int:
        if holder and self.per_holder and self._held[holder] >= self.per_holder:
            self.reap()
            if self._held[holder] >= self.per_holder:
                raise TooManyLeases(f"{holder} holds {self._held[holder]} leases, the most one caller may "
                                    f"(max_leases_per_caller): release leases it no longer needs")
        lease_id = next(self._ids)
        if holder:
            self._holders[lease_id] = holder
            self._held[holder] += 1
        self._leases[lease_id] = (self.clock() + ttl_s, tuple(keys))
        self._pins.update(keys)
        return lease_id

    def release(self, lease_id: int) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        holder = self._holders.pop(lease_id, "")
        if holder:
            self._held[holder] -= 1
            if self._held[holder] <= 0:
                del self._held[holder]
        self._pins.subtract(lease[1])
        for key in lease[1]:
            if self._pins[key] <= 0:
                del self._pins[key]
        return True

    def reap(self) -> int:
        """Release every expired lease; returns how many."""
        now = self.clock()
        expired = [lease_id for lease_id, (deadline, _) in self._leases.items() if deadline <= now]
        for lease_id in expired:
            self.release(lease_id)
        return len(expired)
