"""The names behind packed MatchPrefix answers.

A cachesvc answers MatchPrefix packed (``MatchPrefixRequest.packed``): the ``(instance, tier)`` holders of the
prompt's prefix as its own holder ids with their counts, two arrays, and the id -> name table only when the
caller's copy is not current (``holders_epoch``). So an answer costs no Python object per holder, which on a large
fleet sharing a system prompt (1,000+ holders a shard) is most of a sharded MatchPrefix. :class:`HolderNames` keeps,
per shard, the tables of the last few epochs translated into the router's own numbering, fleet-wide, in which
:func:`combine_packed` takes the least over the shards and :meth:`HolderNames.best` the
longest run per instance. An answer in the old form (``matches``, from a cachesvc that predates packing) is
numbered the same way.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from kvmesh.contracts.shards import POOL, ShardMap, firsts_and_cut
from kvmesh.proto.v1 import cache_pb2

log = logging.getLogger(__name__)

EPOCHS_KEPT = 4          # per shard: an answer in flight may name the table before the last change
MAX_HOLDERS = 1 << 16    # past this many numbers (instances come and go), the numbering starts again


class HolderNames:
    def __init__(self, shards: int) -> None:
        self._shards = shards
        self.reset()

    def reset(self) -> None:
        """Forget every number and table: the next answers bring their tables again."""
        self._number: dict[tuple[str, str], int] = {}   # (instance, tier) -> the router's number
        self._instance_numbers: dict[str, int] = {}      # instance -> its place in self.instances
        self.instances: list[str] = []
        self._instance_of = np.zeros(0, np.int64)        # number -> place in self.instances
        self._tables: list[OrderedDict[int, np.ndarray]] = [OrderedDict() for _ in range(self._shards)]

    def __len__(self) -> int:
        return len(self._number)

    def maybe_reset(self) -> None:
        """Start the numbering again once it passed ``MAX_HOLDERS`` (call between requests' answers)."""
        if len(self._number) > MAX_HOLDERS:
            self.reset()

    def epoch(self, shard: int) -> int:
        """The epoch of ``shard``'s newest table this router has (0: none): what a request says it knows."""
        tables = self._tables[shard]
        return next(reversed(tables)) if tables else 0

    def numbers(self, holders: Iterable[tuple[str, str]]) -> np.ndarray:
        """The router's numbers of ``holders``, given in order, new ones numbered as they come."""
        out = []
        for holder in holders:
            number = self._number.get(holder)
            if number is None:
                number = self._number[holder] = len(self._number)
                place = self._instance_numbers.setdefault(holder[0], len(self.instances))
                if place == len(self.instances):
                    self.instances.append(holder[0])
                if number >= len(self._instance_of):
                    grown = np.zeros(max(64, 2 * number), np.int64)
                    grown[:len(self._instance_of)] = self._instance_of
                    self._instance_of = grown
                self._instance_of[number] = place
            out.append(number)
        return np.asarray(out, np.int64)

    def learn(self, shard: int, epoch: int, names: Iterable[tuple[int, str, str]]) -> None:
        """``shard``'s id -> name table of ``epoch``: ``(id, instance, tier)`` of every id it uses."""
        names = list(names)
        table = np.full(max((hid for hid, _, _ in names), default=-1) + 1, -1, np.int64)
        table[[hid for hid, _, _ in names]] = self.numbers((instance, tier) for _, instance, tier in names)
        tables = self._tables[shard]
        tables[epoch] = table
        tables.move_to_end(epoch)
        while len(tables) > EPOCHS_KEPT:
            tables.popitem(last=False)

    def translate(self, shard: int, epoch: int, ids: np.ndarray) -> np.ndarray | None:
        """``shard``'s holder ids of ``epoch`` in the router's numbers; None when that table is not here (ask
        again with epoch 0) or names no such id. No ids need no table: an index that holds nothing has no names to
        send, and its empty answer is read as it is, not asked again."""
        if not len(ids):
            return ids
        table = self._tables[shard].get(epoch)
        if table is None:
            return None
        if len(ids) and int(ids.max()) >= len(table):
            return None
        out = table[ids]
        return None if len(out) and int(out.min()) < 0 else out

    def read(self, shard: int, resp: cache_pb2.MatchPrefixResponse) -> tuple[np.ndarray, np.ndarray] | None:
        """``shard``'s MatchPrefix answer as the router's holder numbers and their counts, its pool's entries left
        out; None: packed in a table of names not here (ask again with epoch 0), or malformed."""
        if not resp.packed:  # a cachesvc that predates packing: one TierMatch per holder
            held = [(m.instance_id, m.tier, m.num_blocks) for m in resp.matches if m.instance_id != POOL]
            return self.numbers((i, t) for i, t, _ in held), np.asarray([n for _, _, n in held], np.int64)
        if resp.holders:
            self.learn(shard, resp.holders_epoch, ((h.id, h.instance_id, h.tier) for h in resp.holders))
        if len(resp.holder_ids) != len(resp.holder_counts) or len(resp.holder_ids) % 4:
            log.warning("cachesvc shard %d sent %d bytes of holder ids with %d of counts; its answer is left out",
                        shard, len(resp.holder_ids), len(resp.holder_counts))
            return None
        numbers = self.translate(shard, resp.holders_epoch, np.frombuffer(resp.holder_ids, "<u4").astype(np.int64))
        return None if numbers is None else (numbers, np.frombuffer(resp.holder_counts, "<u4").astype(np.int64))

    def best(self, numbers: np.ndarray, counts: np.ndarray) -> dict[str, int]:
        """Per instance, the most of its holders' counts (its tiers), those above 0."""
        if not len(numbers):
            return {}
        top = np.zeros(len(self.instances), np.int64)
        np.maximum.at(top, self._instance_of[numbers], counts)
        instances = self.instances
        return {instances[i]: int(top[i]) for i in np.flatnonzero(top).tolist()}


def combine_packed(smap: ShardMap, keys: Sequence[int], answers: Mapping[int, tuple[np.ndarray, np.ndarray]],
                   holders: int) -> tuple[np.ndarray, np.ndarray]:
    """``kvmesh.contracts.shards.combine`` of packed answers, the instances only: ``answers`` is shard -> (holder
    numbers, counts), the numbers the caller's own (``< holders``; a holder has one number in every answer).
    Returns the holders with a count above 0 and their counts, as arrays: a few whole-array operations per shard
    whatever the fleet's size."""
    n = len(keys)
    if not n or not answers:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    first, cut = firsts_and_cut(smap, keys, answers)
    least = np.full(holders, cut, np.int64)
    listed = np.zeros(holders, bool)
    row = np.empty(holders, np.int64)
    for shard, (ids, counts) in answers.items():
        row.fill(first[shard])  # a holder this shard does not list: up to its first own key
        row[ids] = counts
        np.minimum(least, row, out=least)
        listed[ids] = True
    keep = np.flatnonzero(listed & (least > 0))
    return keep, least[keep]
