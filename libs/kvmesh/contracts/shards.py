"""Which cachesvc shard owns which block key, and how the shards' MatchPrefix answers add up to the whole one.

The index and the pool are partitioned over ``shards`` cachesvc processes (``cachesvc-0`` ... ``cachesvc-N-1``).
A key falls in one of ``SLOTS`` slots by its low bits (block keys are xxh3 hashes: uniform); each slot ranks the
shards by rendezvous hashing (highest random weight over ``(slot, shard)``), computed once. So going from N to
N + 1 shards moves about 1/(N + 1) of the slots, and every process that knows N agrees on the map without
talking.

- The **pool** of a key lives on the slot's first shard (one copy: a dead shard's blocks become recomputes).
- The **index** entries of a key live on the slot's first ``copies`` shards (default 2): each such shard
  indexes the key from the events stream, so while one of them is down another still answers for it.

A shard answers MatchPrefix for the keys it owns and counts every key it does not own as present: its count for
``(instance, tier)`` is where that holder's run breaks at one of its own keys, and a holder it does not list
breaks at its first own key. The whole answer is the least count over the shards that answered, cut where a key
has no owner among them (:func:`combine`): exactly what one unsharded index would answer while every key has a
live owner, and never more than it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence

import xxhash

SLOTS = 4096  # a power of two: a key's slot is its low bits
POOL = "pool"  # the instance id of cachesvc's own tiers in MatchPrefix answers

Holder = tuple[str, str]  # (instance id, tier)


def _rank(slot: int, shards: int) -> tuple[int, ...]:
    weight = {s: xxhash.xxh3_64_intdigest(struct.pack("<II", slot, s)) for s in range(shards)}
    return tuple(sorted(range(shards), key=lambda s: (-weight[s], s)))


class ShardMap:
    """The key -> shard map of ``shards`` shards, ``copies`` of each index entry (at most ``shards``)."""

    def __init__(self, shards: int, copies: int = 2) -> None:
        if shards < 1:
            raise ValueError(f"a shard map needs at least one shard, not {shards}")
        if copies < 1:
            raise ValueError(f"the index needs at least one copy of each entry, not {copies}")
        self.shards = shards
        self.copies = min(copies, shards)
        self._ranks = [_rank(slot, shards) for slot in range(SLOTS)] if shards > 1 else [(0,)] * SLOTS

    def rank(self, key: int) -> tuple[int, ...]:
        """Every shard, in the order ``key`` prefers them."""
        return self._ranks[key & (SLOTS - 1)]

    def pool_owner(self, key: int) -> int:
        return self._ranks[key & (SLOTS - 1)][0]

    def index_owners(self, key: int) -> tuple[int, ...]:
        return self._ranks[key & (SLOTS - 1)][:self.copies]

    def pool_positions(self, shard: int, keys: Sequence[int]) -> list[int]:
        """The positions in ``keys`` whose pool ``shard`` holds."""
        ranks, mask = self._ranks, SLOTS - 1
        return [p for p, k in enumerate(keys) if ranks[k & mask][0] == shard]

    def index_positions(self, shard: int, keys: Sequence[int]) -> list[int]:
        """The positions in ``keys`` whose index entries ``shard`` keeps."""
        ranks, mask, copies = self._ranks, SLOTS - 1, self.copies
        return [p for p, k in enumerate(keys) if shard in ranks[k & mask][:copies]]

    def indexes(self, shard: int, key: int) -> bool:
        return shard in self._ranks[key & (SLOTS - 1)][:self.copies]

    def index_slots(self, shard: int) -> list[bool]:
        """Per slot: whether ``shard`` indexes its keys (a key's slot is ``key & (SLOTS - 1)``)."""
        return [shard in r[:self.copies] for r in self._ranks]

    def split_pool(self, keys: Sequence[int]) -> dict[int, list[int]]:
        """Positions of ``keys`` by the shard whose pool holds them (shards without any left out)."""
        out: dict[int, list[int]] = {}
        ranks, mask = self._ranks, SLOTS - 1
        for p, k in enumerate(keys):
            out.setdefault(ranks[k & mask][0], []).append(p)
        return out


def at(positions: Sequence[int], run: int, total: int) -> int:
    """Where a run of ``run`` leading keys among ``positions`` (a shard's own keys, ascending) breaks in the
    whole list of ``total`` keys: the position of its first own key past the run (``total``: none)."""
    return positions[run] if run < len(positions) else total


def combine(smap: ShardMap, keys: Sequence[int], answers: Mapping[int, Iterable[tuple[str, str, int]]]
            ) -> list[tuple[str, str, int]]:
    """The whole MatchPrefix answer from the answers of the shards that gave one (``shard -> (instance, tier,
    num_blocks)``, each counting the keys it does not own as present). Per holder: the least count over them,
    a holder a shard does not list counting up to that shard's first own key; everything cut at the first key
    none of them owns (its holders are unknown). The pool's tiers (instance ``pool``) follow the pool's map,
    the instances' the index's. Holders at 0 are left out."""
    n = len(keys)
    if not n or not answers:
        return []
    index_first = dict.fromkeys(answers, n)  # shard -> its first own key (index)
    pool_first = dict.fromkeys(answers, n)
    index_cut = pool_cut = n
    ranks, mask, copies = smap._ranks, SLOTS - 1, smap.copies
    open_index = set(answers)
    open_pool = set(answers)
    for p, key in enumerate(keys):
        rank = ranks[key & mask]
        if pool_cut == n:
            owner = rank[0]
            if owner in open_pool:
                pool_first[owner] = p
                open_pool.discard(owner)
            elif owner not in answers:
                pool_cut = p
        if index_cut == n:
            owners = rank[:copies]
            if not any(s in answers for s in owners):
                index_cut = p
            for s in owners:
                if s in open_index:
                    index_first[s] = p
                    open_index.discard(s)
        if index_cut < n and pool_cut < n:
            break
    least: dict[Holder, int] = {}
    listed: dict[int, dict[Holder, int]] = {}
    for shard, matches in answers.items():
        own = listed[shard] = {}
        for instance, tier, count in matches:
            own[(instance, tier)] = count
            least.setdefault((instance, tier), n)
    out = []
    for holder in least:
        pool = holder[0] == POOL
        firsts = pool_first if pool else index_first
        count = min(listed[s].get(holder, firsts[s]) for s in answers)
        count = min(count, pool_cut if pool else index_cut)
        if count > 0:
            out.append((holder[0], holder[1], count))
    return out
