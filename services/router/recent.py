"""The prompts this router sent each instance in the last few seconds, as the blocks they will leave there.

The index (cachesvc, fed by the instances' KV events) learns of a prompt's blocks once the instance computed and
stored them: seconds after the router sent it, longer behind a queue. Two requests of one tenant that arrive in
that gap would otherwise both be routed blind, and land on different instances, each of which then spends its
cache on the same prefix. So the router counts what it dispatched as what the instance is about to hold, for
``ttl_s`` after the dispatch: the prefix match of a request is, per instance, the longer of the index's and this
table's. A prompt that failed, or whose blocks were evicted soon after, costs what a miss costs today: the table
only ever adds hope, the instance's own answer (``cached_tokens``, decode's exact hold) stays the truth.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat

GENERATIONS = 4  # a generation is a quarter of the TTL (or of ``max_keys``): what the table drops at once


@dataclass
class _Generation:
    """The dispatches of one stretch of time: per instance, block key -> when it stops counting."""
    started: float
    tables: dict[str, dict[int, float]] = field(default_factory=dict)
    size: int = 0
    last_expiry: float = 0.0


class RecentPrefixes:
    """Per instance, block keys of the prompts dispatched to it and when each stops counting. At most
    ``max_keys`` keys in all (the oldest dispatches go first), and one prompt's more.

    Kept in generations, each the dispatches of a quarter of ``ttl_s`` (or of a quarter of ``max_keys``, whichever
    comes first): a dispatch writes its keys into the newest generation in one ``dict.update`` (an LRU table moving
    each of a 4k-token prompt's 256 keys to its end was 4% of the router's CPU), and the oldest generation goes
    whole once its last key expired, or when the table is over ``max_keys``. A key renewed lives on in the newer
    generation, so the newest entry of a key is its expiry."""

    def __init__(self, ttl_s: float, max_keys: int = 200_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._clock = clock
        self._gens: deque[_Generation] = deque()  # oldest first

    def __len__(self) -> int:
        return sum(g.size for g in self._gens)

    def dispatched(self, instance_id: str, keys: Sequence[int]) -> None:
        """``instance_id`` was sent a prompt whose full blocks have ``keys``. Every dispatch that renews a block
        renews the ones before it (chained keys), so what an instance still has in the table is a leading run of
        each prompt (``matched`` bisects it): a block's newest entry expires no earlier than the next block's,
        and a generation dropped takes the older entries of both."""
        if self.ttl_s <= 0:
            return
        now = self._clock()
        self._expire(now)
        gen = self._gens[-1] if self._gens else None
        if gen is None or now >= gen.started + self.ttl_s / GENERATIONS or gen.size >= self.max_keys // GENERATIONS:
            gen = _Generation(now)
            self._gens.append(gen)
        table = gen.tables.get(instance_id)
        if table is None:
            table = gen.tables[instance_id] = {}
        before = len(table)
        gen.last_expiry = now + self.ttl_s
        table.update(zip(keys, repeat(gen.last_expiry)))
        gen.size += len(table) - before
        total = len(self)
        while total > self.max_keys and len(self._gens) > 1:
            total -= self._gens.popleft().size

    def matched(self, keys: Sequence[int], instance_ids: Sequence[str]) -> dict[str, int]:
        """Per instance of ``instance_ids``, the leading run of ``keys`` dispatched to it and still counting
        (instances with none are left out). Found by bisection: what an instance has of a chain is a leading run
        (``dispatched``)."""
        if self.ttl_s <= 0 or not self._gens:
            return {}
        now = self._clock()
        self._expire(now)
        out: dict[str, int] = {}
        for inst in instance_ids:
            tables = [t for g in reversed(self._gens) if (t := g.tables.get(inst))]  # newest first
            if not tables:
                continue
            lo, hi = 0, len(keys)
            while lo < hi:
                mid = (lo + hi) // 2
                if _expiry(tables, keys[mid]) > now:
                    lo = mid + 1
                else:
                    hi = mid
            if lo:
                out[inst] = lo
        return out

    def expiry(self, instance_id: str, key: int) -> float:
        """When ``key`` sent to ``instance_id`` stops counting (0 when it is not in the table)."""
        return _expiry([t for g in reversed(self._gens) if (t := g.tables.get(instance_id))], key)

    def forget(self, instance_id: str) -> None:
        """The instance went away (or restarted): what it was sent is not there."""
        for g in self._gens:
            g.size -= len(g.tables.pop(instance_id, {}))

    def _expire(self, now: float) -> None:
        while self._gens and self._gens[0].last_expiry <= now:
            self._gens.popleft()


def _expiry(tables: list[dict[int, float]], key: int) -> float:
    for table in tables:
        e = table.get(key)
        if e is not None:
            return e
    return 0.0


def merged(indexed: dict[str, int], recent: dict[str, int]) -> dict[str, int]:
    """Per instance, the longer of the two matches (the pool's entry stays the index's)."""
    out = dict(indexed)
    for inst, n in recent.items():
        out[inst] = max(out.get(inst, 0), n)
    return out
