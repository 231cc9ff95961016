"""Which cachesvc shard owns which block key, and how the shards' MatchPrefix answers add up to the whole one.

The index and the pool are partitioned over ``shards`` cachesvc processes (``cachesvc-0`` ... ``cachesvc-N-1``).
A key falls in one of ``SLOTS`` slots by its low bits (block keys are xxh3 hashes: uniform); each slot ranks the
shards by rendezvous hashing (highest random weight over ``(slot, shard)``), computed once. So going from N to
N + 1 shards moves about 1/(N + 1) of the slots, and every process that knows N agrees on the map without
talking.

- The **index** entries of a key live on the slot's first ``copies`` shards (default 2): each such shard
  indexes the key from the events stream, so while one of them is down another still answers for it.
- The **pool** keeps a block on the slot's first ``pool_copies`` shards (default 1: a dead shard's blocks
  become recomputes; 2: none is lost to one dead shard). A shard that (re)starts fetches what it lacks of its
  slots from the other copies (``repair_sources``: each slot from one of them, the first live in rank order).

A shard answers MatchPrefix for the keys it owns. For the instances it counts every key it does not own as
present: its count for ``(instance, tier)`` is where that holder's run breaks at one of its own keys, and a
holder it does not list breaks at its first own key; the index's copies hold the same entries (the same stream),
so the whole answer is the least count over the shards that answered, cut where a key has no owner among them.
For its pool it sends, per tier, a bitmask of the positions it holds (copies may differ: one was evicted, or
written while the other was down), which the caller ORs (:func:`combine`; the router combines packed answers
the same way, ``services/router/holders.py``). Exactly what one unsharded index and pool would answer while every
key has a live owner, and never more than it.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Iterable, Mapping, Sequence

import xxhash

SLOTS = 4096  # a power of two: a key's slot is its low bits
POOL = "pool"  # the instance id of cachesvc's own tiers in MatchPrefix answers

Holder = tuple[str, str]  # (instance id, tier)


def _rank(slot: int, shards: int) -> tuple[int, ...]:
    weight = {s: xxhash.xxh3_64_intdigest(struct.pack("<II", slot, s)) for s in range(shards)}
    return tuple(sorted(range(shards), key=lambda s: (-weight[s], s)))


class ShardMap:
    """The key -> shard map of ``shards`` shards, ``copies`` of each index entry and ``pool_copies`` of each
    pooled block (each at most ``shards``)."""

    def __init__(self, shards: int, copies: int = 2, pool_copies: int = 1) -> None:
        if shards < 1:
            raise ValueError(f"a shard map needs at least one shard, not {shards}")
        if copies < 1 or pool_copies < 1:
            raise ValueError(f"the index and the pool need at least one copy of each entry, not {copies} and "
                             f"{pool_copies}")
        self.shards = shards
        self.copies = min(copies, shards)
        self.pool_copies = min(pool_copies, shards)
        self._ranks = [_rank(slot, shards) for slot in range(SLOTS)] if shards > 1 else [(0,)] * SLOTS
        self._index_owners = [r[:self.copies] for r in self._ranks]

    def rank(self, key: int) -> tuple[int, ...]:
        """Every shard, in the order ``key`` prefers them."""
        return self._ranks[key & (SLOTS - 1)]

    def pool_owners(self, key: int) -> tuple[int, ...]:
        return self._ranks[key & (SLOTS - 1)][:self.pool_copies]

    def index_owners(self, key: int) -> tuple[int, ...]:
        return self._ranks[key & (SLOTS - 1)][:self.copies]

    def pool_positions(self, shard: int, keys: Sequence[int]) -> list[int]:
        """The positions in ``keys`` whose blocks ``shard``'s pool keeps."""
        ranks, mask, copies = self._ranks, SLOTS - 1, self.pool_copies
        return [p for p, k in enumerate(keys) if shard in ranks[k & mask][:copies]]

    def index_positions(self, shard: int, keys: Sequence[int]) -> list[int]:
        """The positions in ``keys`` whose index entries ``shard`` keeps."""
        ranks, mask, copies = self._ranks, SLOTS - 1, self.copies
        return [p for p, k in enumerate(keys) if shard in ranks[k & mask][:copies]]

    def index_slots(self, shard: int) -> list[bool]:
        """Per slot: whether ``shard`` indexes its keys (a key's slot is ``key & (SLOTS - 1)``)."""
        return [shard in r[:self.copies] for r in self._ranks]

    def first_slots(self, shard: int) -> list[bool]:
        """Per slot: whether ``shard`` ranks first for its keys (their first index and pool copy)."""
        return [r[0] == shard for r in self._ranks]

    def pool_slots(self, shard: int) -> list[int]:
        """The slots whose blocks ``shard``'s pool keeps."""
        return [slot for slot, r in enumerate(self._ranks) if shard in r[:self.pool_copies]]

    def repair_sources(self, shard: int, live: Collection[int], slots: Iterable[int]) -> dict[int, list[int]]:
        """Where ``shard`` fetches the blocks of each of ``slots`` (its own) that it lacks: from the first of the
        slot's other pool copies, in rank order, that is ``live``; so each slot comes from one shard, not from
        every copy. Slots with no live other copy (or that are not ``shard``'s) are left out."""
        out: dict[int, list[int]] = {}
        for slot in slots:
            owners = self._ranks[slot][:self.pool_copies]
            if shard not in owners:
                continue
            source = next((s for s in owners if s != shard and s in live), None)
            if source is not None:
                out.setdefault(source, []).append(slot)
        return out

    def split_pool(self, keys: Sequence[int], copy: int | None = None) -> dict[int, list[int]]:
        """Positions of ``keys`` by the shard whose pool keeps them: every copy's shard (a position under each),
        or only the ``copy``-th (0: the first). Shards without any are left out."""
        out: dict[int, list[int]] = {}
        ranks, mask = self._ranks, SLOTS - 1
        which = range(self.pool_copies) if copy is None else (copy,)
        for p, k in enumerate(keys):
            rank = ranks[k & mask]
            for c in which:
                out.setdefault(rank[c], []).append(p)
        return out


def at(positions: Sequence[int], run: int, total: int) -> int:
    """Where a run of ``run`` leading keys among ``positions`` (a shard's own keys, ascending) breaks in the
    whole list of ``total`` keys: the position of its first own key past the run (``total``: none)."""
    return positions[run] if run < len(positions) else total


def leading_ones(mask: int) -> int:
    """How many low bits of ``mask`` are set before the first clear one."""
    return (mask ^ (mask + 1)).bit_length() - 1


def firsts_and_cut(smap: ShardMap, keys: Sequence[int], answered: Iterable[int]) -> tuple[dict[int, int], int]:
    """Per answering shard, the position of its first own key (``len(keys)``: none); and where the whole answer
    is cut: the first key none of them owns (``len(keys)``: none)."""
    n = len(keys)
    answered = set(answered)
    first = dict.fromkeys(answered, n)
    cut = n
    owners_of, mask = smap._index_owners, SLOTS - 1
    waiting = set(answered)
    missing = len(answered) < smap.shards  # else every key has an owner that answered: no cut to look for
    for p, key in enumerate(keys):
        owners = owners_of[key & mask]
        if missing and not any(s in answered for s in owners):
            cut = p
            break
        for s in owners:
            if s in waiting:
                first[s] = p
                waiting.discard(s)
        if not waiting and not missing:
            break
    return first, cut


def pool_entries(n: int, pools: Mapping[int, Iterable[tuple[str, int]]]) -> list[tuple[str, str, int]]:
    """The pool's MatchPrefix entries for ``n`` keys from the shards' ``pools`` (shard -> ``(tier, mask)``): per
    tier, the leading run of the shards' position masks ORed."""
    held: dict[str, int] = {}
    for shard_pool in pools.values():
        for tier, positions in shard_pool:
            held[tier] = held.get(tier, 0) | positions
    out = []
    for tier, positions in held.items():
        count = min(n, leading_ones(positions))
        if count > 0:
            out.append((POOL, tier, count))
    return out


def combine(smap: ShardMap, keys: Sequence[int], answers: Mapping[int, Iterable[tuple[str, str, int]]],
            pools: Mapping[int, Iterable[tuple[str, int]]]) -> list[tuple[str, str, int]]:
    """The whole MatchPrefix answer from the answers of the shards that gave one: ``answers`` (shard ->
    ``(instance, tier, num_blocks)``, each counting the keys it does not own as present) and ``pools`` (shard ->
    ``(tier, mask)``, its pool's positions held per tier). Per instance holder: the least count over them, a
    holder a shard does not list counting up to that shard's first own key; cut at the first key none of them
    owns (its holders are unknown). Per pool tier (instance ``pool``): the leading run of the shards' masks
    ORed. Holders at 0 are left out."""
    n = len(keys)
    if not n or not answers:
        return []
    first, cut = firsts_and_cut(smap, keys, answers)
    # per holder, the least over the shards: most holders are listed by every shard (a shared prefix on a large
    # fleet: ~1,500 a shard), so that case runs as whole-list operations, not a Python step per (holder, shard)
    listed = [{(instance, tier): count for instance, tier, count in matches} for matches in answers.values()]
    firsts = [first[s] for s in answers]
    everywhere = set(listed[0]).intersection(*listed[1:])
    order = list(everywhere)
    least = dict(zip(order, map(min, zip(*([own[h] for h in order] for own in listed)))))
    for holder in set().union(*listed) - everywhere:  # a shard that does not list it: its first own key
        least[holder] = min(own.get(holder, f) for own, f in zip(listed, firsts))
    out = [(holder[0], holder[1], c) for holder, count in least.items() if (c := min(count, cut)) > 0]
    return out + pool_entries(n, pools)

