"""The global block index: which instance holds which block key in which tier, fed by KV event batches.

Layout in memory: one dict ``block key -> holder set``. A holder is an ``(instance_id, tier)`` pair interned to
a small id; a set of holders is a bitmask, bit ``1 << id`` each. With up to 8 holders every mask is one of
CPython's cached small ints, so a block costs little more than its dict slot and its key; with more, a mask is an
int as wide as its highest holder id, 4 bytes every 30 bits. Most blocks have one or two holders (a conversation's
blocks on its instance, and in its host tier or on one other instance), so a set of one or two holders whose mask
would pass 240 bits is kept packed instead (``_pack``): the ids themselves in one small negative int (~32 B instead
of ~130-180 B a block at 1,024 instances). Every read unpacks it (``_unpack``: a negative value is packed). A fleet
of up to 120 instances (240 holders) never packs, and pays nothing for it.
Removing a whole instance scans the dict once (rare: ``AllBlocksCleared`` or an instance that stopped beating)
instead of keeping a reverse index per holder.

Not thread-safe: the owner (the cache server) calls it from its event loop only.
"""

from __future__ import annotations

import enum
import functools
import logging
import secrets
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np
from kvmesh.contracts.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.contracts.messages import KVEventBatch
from kvmesh.contracts.shards import SLOTS, at

SLOT_MASK = SLOTS - 1

log = logging.getLogger(__name__)


class Holder(NamedTuple):
    instance_id: str
    tier: str


class PrefixMatch(NamedTuple):
    instance_id: str
    tier: str
    num_blocks: int


# PrefixMatch from a ready tuple without a Python frame (``PrefixMatch(...)`` and ``_make`` each run one): an
# answer on a large fleet makes one per holder of a shared prefix
_new_match = functools.partial(tuple.__new__, PrefixMatch)


class Order(enum.Enum):
    """Where a batch falls in its instance's sequence."""

    NEXT = "next"    # seq == last + 1, or 1 from an instance not known yet
    STALE = "stale"  # seq <= last: a redelivery, or the instance restarted and numbers from 1 again
    GAP = "gap"      # batches are missing (from an unknown instance: seq > 1, its beginning is not in the stream)


_FEW_BITS = 16  # up to this many set bits, peeling them off one by one is faster than unpacking the mask


def _unpacked(mask: int) -> np.ndarray:
    """The positions of ``mask``'s set bits, lowest first, unpacked by numpy."""
    packed = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), np.uint8)
    return np.flatnonzero(np.unpackbits(packed, bitorder="little"))


def _bits(mask: int) -> list[int]:
    """Holder ids set in ``mask``, lowest first. A mask of many holders (a prefix shared across a large fleet)
    is unpacked by numpy: peeling ``k`` bits off a mask of ``n`` holders makes ``k`` big ints of ``n`` bits."""
    if mask.bit_count() > _FEW_BITS:
        return _unpacked(mask).tolist()
    ids = []
    while mask:
        low = mask & -mask
        ids.append(low.bit_length() - 1)
        mask ^= low
    return ids


def _id_array(mask: int) -> np.ndarray:
    """The holder ids set in ``mask`` as a uint32 array."""
    return (np.asarray(_bits(mask)) if mask.bit_count() <= _FEW_BITS else _unpacked(mask)).astype(np.uint32)


_WIDE = 1 << 240  # a mask this wide (60 B and more) is kept packed when it has one or two holders
_ID_BITS = 24     # a packed holder id's bits (ids past 2**24 - 2 stay masks)
_ID_MASK = (1 << _ID_BITS) - 1


def _pack(mask: int) -> int:
    """``mask`` as the index keeps it: one or two holders of a wide mask as ``~(low | (high + 1) << 24)`` (a
    negative int), anything else as the mask itself."""
    if mask < _WIDE or mask.bit_count() > 2:
        return mask
    low = (mask & -mask).bit_length() - 1
    rest = mask ^ (1 << low)
    high = rest.bit_length() - 1 if rest else -1
    if low > _ID_MASK or high + 1 > _ID_MASK:
        return mask
    return ~(low | (high + 1) << _ID_BITS)


def _unpack(value: int) -> int:
    """The holder mask of a value the index keeps (``_pack``)."""
    if value >= 0:
        return value
    packed = ~value
    high = packed >> _ID_BITS
    return 1 << (packed & _ID_MASK) | (1 << (high - 1) if high else 0)


class BlockIndex:
    def __init__(self, slots: Sequence[bool] | None = None) -> None:
        """``slots``: a shard's index keeps only the keys whose slot (``kvmesh.contracts.shards``) is true."""
        self._slots = slots
        self._masks: dict[int, int] = {}               # block key -> holder mask, one or two wide ones packed
        self._ids: dict[Holder, int] = {}              # holder -> id
        self._holders: list[Holder | None] = []        # id -> holder (None: free)
        self._free: list[int] = []                     # released ids, reused lowest first
        # numbers the id -> holder table (``holder_names``): bumped when an id is given or freed; the high bits
        # are this process's, so a restarted cachesvc never repeats a number a caller kept from its predecessor
        self.holders_epoch = secrets.randbits(31) << 32 | 1
        self._last_seq: dict[str, int] = {}            # instance -> seq of its last applied batch
        self.events_applied = 0                        # KV events (not batches) applied
        self.event_gaps = 0                            # batches that skipped seqs
        self.duplicates = 0                            # batches ignored as already applied

    def __len__(self) -> int:
        """Distinct block keys held by anyone."""
        return len(self._masks)

    def instances(self) -> set[str]:
        """Instances that hold blocks or whose events have been applied."""
        return set(self._last_seq) | {h.instance_id for h in self._holders if h is not None}

    # -- events ----------------------------------------------------------------------------------------------

    def order(self, batch: KVEventBatch) -> Order:
        last = self._last_seq.get(batch.instance_id, 0)
        return Order.NEXT if batch.seq == last + 1 else Order.STALE if batch.seq <= last else Order.GAP

    def apply(self, batch: KVEventBatch) -> bool:
        """Apply one instance's batch; False when it is stale (``seq`` not past the last one). A gap is
        counted in ``event_gaps`` and applied anyway: the caller resyncs from a snapshot when it can."""
        order = self.order(batch)
        if order is Order.STALE:
            self.duplicates += 1
            return False
        if order is Order.GAP:
            self.event_gaps += 1
            log.warning("kv events of %s: gap after seq %d (got %d)", batch.instance_id,
                        self._last_seq.get(batch.instance_id, 0), batch.seq)
        self._last_seq[batch.instance_id] = batch.seq
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(self._intern(Holder(batch.instance_id, event.tier)), event.block_keys)
            elif isinstance(event, BlockRemoved):
                hid = self._ids.get(Holder(batch.instance_id, event.tier))
                if hid is not None:
                    self._remove(hid, event.block_keys)
            elif isinstance(event, AllBlocksCleared):
                self._clear(batch.instance_id)
        self.events_applied += len(batch.events)
        return True

    def replace_instance(self, instance_id: str, seq: int, blocks: Iterable[tuple[str, Sequence[int]]]) -> None:
        """Make ``instance_id`` hold exactly ``blocks`` (tier, keys), as of its batch ``seq`` (a snapshot)."""
        self._clear(instance_id)
        for tier, keys in blocks:
            self._store(self._intern(Holder(instance_id, tier)), keys)
        self._last_seq[instance_id] = seq

    def forget_seq(self, instance_id: str) -> None:
        """Take the instance's next batch as its first (it restarted and numbers from 1 again)."""
        self._last_seq.pop(instance_id, None)

    def drop_instance(self, instance_id: str) -> int:
        """Forget an instance that is gone: its blocks in every tier and its sequence number (a restarted
        instance starts numbering again). Returns how many (key, tier) entries were removed."""
        self._last_seq.pop(instance_id, None)
        return self._clear(instance_id)

    def _intern(self, holder: Holder) -> int:
        hid = self._ids.get(holder)
        if hid is None:
            if self._free:
                self._free.sort(reverse=True)
                hid = self._free.pop()
                self._holders[hid] = holder
            else:
                hid = len(self._holders)
                self._holders.append(holder)
            self._ids[holder] = hid
            self.holders_epoch += 1
        return hid

    def _store(self, hid: int, keys: Sequence[int]) -> None:
        bit, masks = 1 << hid, self._masks
        alone = _pack(bit)  # a key no one held: this holder alone
        narrow = bit < _WIDE
        if self._slots is not None:
            slots = self._slots
            keys = [k for k in keys if slots[k & SLOT_MASK]]
        for key in keys:
            value = masks.get(key)
            if value is None:
                masks[key] = alone
            elif narrow and 0 <= value < _WIDE:  # a narrow mask stays one (every key of a small fleet)
                masks[key] = value | bit
            else:
                masks[key] = _pack(_unpack(value) | bit)

    def _remove(self, hid: int, keys: Sequence[int]) -> None:
        keep, masks = ~(1 << hid), self._masks
        for key in keys:
            value = masks.get(key)
            if value is not None:
                mask = _unpack(value)
                if mask & keep:
                    masks[key] = _pack(mask & keep)
                else:
                    del masks[key]

    def _clear(self, instance_id: str) -> int:
        """Remove every block of ``instance_id`` and release its holder ids."""
        hids = [hid for holder, hid in self._ids.items() if holder.instance_id == instance_id]
        if not hids:
            return 0
        bits = sum(1 << hid for hid in hids)
        removed = 0
        masks = self._masks
        for key, mask in [(k, m) for k, v in masks.items() if (m := v if v >= 0 else _unpack(v)) & bits]:
            removed += (mask & bits).bit_count()
            if mask & ~bits:
                masks[key] = _pack(mask & ~bits)
            else:
                del masks[key]
        for hid in hids:
            holder = self._holders[hid]
            assert holder is not None
            del self._ids[holder]
            self._holders[hid] = None
            self._free.append(hid)
        self.holders_epoch += 1
        return removed

    # -- queries ---------------------------------------------------------------------------------------------

    def instances_holding(self, key: int) -> set[str]:
        """The instances that hold ``key`` in any tier."""
        return {h.instance_id for hid in _bits(_unpack(self._masks.get(key, 0)))
                if (h := self._holders[hid]) is not None}

    def _drops(self, keys: Sequence[int]) -> list[tuple[int, int]]:
        """Walks ``keys`` once with the set of holders of ``keys[0]`` still matching: ``(position, holders whose
        run ends just before it)`` for each group that drops out, in walk order, the last at ``len(keys)`` (those
        that hold them all); stops when none is left."""
        masks = self._masks
        mask = _unpack(masks.get(keys[0], 0)) if keys else 0
        dropped: list[tuple[int, int]] = []
        for position in range(1, len(keys) if mask else 0):
            value = masks.get(keys[position], 0)
            if value < 0:  # _unpack, inline: this loop is MatchPrefix
                value = ~value
                high = value >> _ID_BITS
                value = 1 << (value & _ID_MASK) | (1 << (high - 1) if high else 0)
            still = mask & value
            if still != mask:
                dropped.append((position, mask ^ still))
                mask = still
                if not mask:
                    break
        if mask:
            dropped.append((len(keys), mask))
        return dropped

    def match_prefix(self, keys: Sequence[int]) -> list[PrefixMatch]:
        """For every holder of ``keys[0]``: how many leading keys it holds (its count stops at its first
        missing key), most first, then by instance and tier (:meth:`_drops`). The answer is as long as the holders
        of ``keys[0]`` (on a large fleet, of a shared system prompt: most of it)."""
        out: list[PrefixMatch] = []
        for n, group in reversed(self._drops(keys)):
            holders = sorted(h for hid in _bits(group) if (h := self._holders[hid]) is not None)
            out += [_new_match((*holder, n)) for holder in holders]
        return out

    def holder_names(self) -> list[tuple[int, str, str]]:
        """``(id, instance, tier)`` of every holder id in use: what the ids of :meth:`match_packed` name."""
        return [(hid, h.instance_id, h.tier) for hid, h in enumerate(self._holders) if h is not None]

    def match_packed(self, keys: Sequence[int], mine: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`match_prefix` (``mine`` given: :meth:`match_own`) as two uint32 arrays, holder ids and their
        counts, in no particular order: no Python object per holder, which is most of an answer's cost when a
        prompt's first block is held across a large fleet."""
        own = [keys[p] for p in mine] if mine is not None else keys
        ids: list[np.ndarray] = []
        counts: list[np.ndarray] = []
        for position, group in self._drops(own):
            dropped = _id_array(group)
            ids.append(dropped)
            counts.append(np.full(len(dropped), position, np.uint32))
        if not ids:
            return np.zeros(0, np.uint32), np.zeros(0, np.uint32)
        out_ids, out_counts = np.concatenate(ids), np.concatenate(counts)
        if mine is not None:  # a run over the own keys -> where it breaks in the whole list
            out_counts = np.append(np.asarray(mine, np.uint32), np.uint32(len(keys)))[out_counts]
        return out_ids, out_counts

    def match_own(self, keys: Sequence[int], mine: Sequence[int]) -> list[PrefixMatch]:
        """A shard's :meth:`match_prefix`: over its own positions ``mine`` of ``keys`` alone, every other key
        counted as present, so each count is the position in ``keys`` where that holder's run breaks at one of
        the shard's keys (``kvmesh.contracts.shards.combine`` takes the least over the shards)."""
        if not mine:
            return []
        total = len(keys)
        return [_new_match((m.instance_id, m.tier, at(mine, m.num_blocks, total)))
                for m in self.match_prefix([keys[p] for p in mine])]
