"""An eviction queue: the cached items ranked by a strategy's sort key, in a binary heap with lazy invalidation.

``push`` (re)ranks an item after it changed (O(log n)); ``discard`` forgets it (O(1): its heap entries go stale
and are dropped when they surface); ``pop`` takes the lowest-ranked item that ``eligible`` accepts (O(log n)
amortised). Items ``eligible`` turns down leave the queue, so the caller pushes them again once they can go
(the engine: when a block's last reader or last child leaves). A ``dynamic`` strategy's keys drift between
pushes; ``pop`` re-ranks the top item before taking it, so what goes is ranked by the strategy as it is now. One
whose keys all move at once (``duel`` changing its mind) bumps its ``epoch``; every item is then ranked afresh,
``RERANK_PER_POP`` of them per ``pop`` (a change costs O(n) in all, but no single call more than O(log n) × that).
A key that falls by itself (``priority``'s retention ending: the strategy's ``key_drops_at``) would stay buried
where it was pushed: for a ``falling`` strategy a second heap of those times ranks such an item again when its
time comes.

Not thread-safe: one owner (the engine thread, the pool's storage thread, the simulator).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Generic, TypeVar, cast

if TYPE_CHECKING:  # eviction.py uses this queue (``duel``'s shadow caches): no import at run time
    from kvmesh.engine.eviction import Evictable, EvictionPolicy

T = TypeVar("T", bound=Hashable)

RERANK_PER_POP = 16


class EvictionQueue(Generic[T]):
    def __init__(self, policy: EvictionPolicy, state: Callable[[T], Evictable] | None = None) -> None:
        """``state`` maps an item to what the strategy ranks (default: the item itself)."""
        self.policy = policy
        # without ``state`` the items are what is ranked
        self.state: Callable[[T], Evictable] = state or (lambda item: cast("Evictable", item))
        self.dynamic = getattr(policy, "dynamic", False)
        self._heap: list[tuple[tuple, int, T]] = []
        self._live: dict[T, int] = {}   # item -> the sequence number of its current heap entry
        self._seq = itertools.count()
        self._epoch = getattr(policy, "epoch", 0)
        self._stale: list[T] = []       # items still ranked by the strategy's previous epoch
        self._drops: list[tuple[float, int, T]] = []  # (when an item's key falls, its heap entry's seq, item)
        # only a strategy whose keys fall by itself pays for the second heap: none of the others' pushes do
        self._key_drops_at = policy.key_drops_at if getattr(policy, "falling", False) else None

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, item: T) -> bool:
        return item in self._live

    def push(self, item: T, now: float) -> None:
        # Later pushes go first on equal keys (-seq): a chain's blocks are pushed head to tail, so its tail goes
        # before its head.
        seq = -next(self._seq)
        self._live[item] = seq
        state = self.state(item)
        heapq.heappush(self._heap, (self.policy.sort_key(state, now), seq, item))
        if self._key_drops_at is not None and (when := self._key_drops_at(state, now)) < math.inf:
            heapq.heappush(self._drops, (when, seq, item))
        if len(self._heap) > 2 * len(self._live) + 1024:
            self._compact()

    def discard(self, item: T) -> None:
        self._live.pop(item, None)

    def pop(self, now: float, eligible: Callable[[T], bool] | None = None) -> T | None:
        epoch = getattr(self.policy, "epoch", 0)
        if epoch != self._epoch:
            self._epoch, self._stale = epoch, list(self._live)
        if self._stale:
            self._rerank(now, RERANK_PER_POP)
        heap, live, drops = self._heap, self._live, self._drops
        while drops and drops[0][0] <= now:  # keys that fell since they were pushed: ranked again, lower
            _, seq, item = heapq.heappop(drops)
            if live.get(item) == seq:
                self.push(item, now)
        while heap:
            key, seq, item = heap[0]
            if live.get(item) != seq:
                heapq.heappop(heap)
                continue
            if self.dynamic:
                fresh = self.policy.sort_key(self.state(item), now)
                if fresh > key:  # ranks higher now: put it back where it belongs and look again
                    heapq.heapreplace(heap, (fresh, seq, item))
                    continue
            heapq.heappop(heap)
            del live[item]
            if eligible is None or eligible(item):
                return item
        return None

    def _rerank(self, now: float, n: int) -> None:
        """Rank ``n`` of the items left from the strategy's previous epoch afresh (a new heap entry each; the
        old ones go stale)."""
        stale, live = self._stale, self._live
        for _ in range(min(n, len(stale))):
            item = stale.pop()
            if item in live:
                self.push(item, now)

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
        heapq.heapify(self._heap)
        self._drops = [e for e in self._drops if self._live.get(e[2]) == e[1]]
        heapq.heapify(self._drops)
