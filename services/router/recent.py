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
from collections import OrderedDict
from collections.abc import Callable, Sequence


class RecentPrefixes:
    """Per instance, block keys of the prompts dispatched to it and when each stops counting. At most
    ``max_keys`` keys in all (the oldest go first)."""

    def __init__(self, ttl_s: float, max_keys: int = 200_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._clock = clock
        self._keys: OrderedDict[tuple[str, int], float] = OrderedDict()  # (instance, block key) -> expiry

    def __len__(self) -> int:
        return len(self._keys)

    def dispatched(self, instance_id: str, keys: Sequence[int]) -> None:
        """``instance_id`` was sent a prompt whose full blocks have ``keys``. Last block first, so that a prompt's
        earlier blocks are always the newer entries: every dispatch that renews a block renews the ones before it
        (chained keys), so the oldest entries, which go first, are the ends of prompts, and what an instance still
        has in the table is a leading run of each prompt (``matched`` bisects it)."""
        if self.ttl_s <= 0:
            return
        expiry = self._clock() + self.ttl_s
        for key in reversed(keys):
            item = (instance_id, key)
            self._keys[item] = expiry
            self._keys.move_to_end(item)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)

    def matched(self, keys: Sequence[int], instance_ids: Sequence[str]) -> dict[str, int]:
        """Per instance of ``instance_ids``, the leading run of ``keys`` dispatched to it and still counting
        (instances with none are left out). Found by bisection: what an instance has of a chain is a leading run
        (``dispatched``)."""
        if self.ttl_s <= 0 or not self._keys:
            return {}
        now = self._clock()
        self._expire(now)
        get = self._keys.get
        out: dict[str, int] = {}
        for inst in instance_ids:
            lo, hi = 0, len(keys)
            while lo < hi:
                mid = (lo + hi) // 2
                expiry = get((inst, keys[mid]))
                if expiry is not None and expiry > now:
                    lo = mid + 1
                else:
                    hi = mid
            if lo:
                out[inst] = lo
        return out

    def forget(self, instance_id: str) -> None:
        """The instance went away (or restarted): what it was sent is not there."""
        for item in [item for item in self._keys if item[0] == instance_id]:
            del self._keys[item]

    def _expire(self, now: float) -> None:
        # keys are in dispatch order and share one TTL, so the expired ones are at the front
        while self._keys:
            item, expiry = next(iter(self._keys.items()))
            if expiry > now:
                break
            del self._keys[item]


def merged(indexed: dict[str, int], recent: dict[str, int]) -> dict[str, int]:
    """Per instance, the longer of the two matches (the pool's entry stays the index's)."""
    out = dict(indexed)
    for inst, n in recent.items():
        out[inst] = max(out.get(inst, 0), n)
    return out
