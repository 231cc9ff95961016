"""Re-replication and hand-over: a (re)started shard fetches, from the other copies' shards, the pooled blocks of
its slots that it lacks (a crash lost its DRAM tier), so a second failure does not find a block's last copy gone;
and, from every other shard, the blocks of its slots written there under another shard count (a resharding), so
adding shards moves the pool's blocks to their new owners instead of losing them.

It runs once per start, once the shard serves, with the shards listed in ``peers``. Copies (``pool_copies`` > 1): each
of its slots comes from one other copy (``ShardMap.repair_sources``: the first live one in rank order): it lists
what that shard holds of them (``ListBlocks``, a few hundred slots a call), keeps the keys its own pool lacks
under each layout, and reads them with ``GetBlocks(copy=True)`` (inline; a copy is no use there: no hit, no
promotion) in calls of ``BATCH_BYTES`` at most, paced to ``repair_mb_s``. A shard it cannot reach gives its
slots to the next live copy; slots with none wait ``RETRY_S`` and are tried again, until every slot was
repaired from somewhere once. Blocks written meanwhile come straight from the engines, as always.

Hand-over (any ``pool_copies``): a resharding restarts every shard with the new count (a graceful stop spills the
DRAM tier to the disk tier, which survives it), so a shard's pool may hold blocks of slots the new map gives to
another shard. Each shard asks every other shard once what it holds of its slots, once that shard answers at this
shard's count (``ListBlocks`` carries the count; a shard still at the old one refuses it, and is asked again every
``RETRY_S``): from then on callers cannot write to it under the old map, so one listing finds all it will ever
hold of them. With one copy a shard holds nothing of another's slots but what a resharding left, so the question
is only that (``foreign_only``: one call, one pass over its pool, an empty answer under an unchanged map). With
copies, a slot's new copies may be the old holder and a shard as new as this one, and the copies phase asks only
the first, so the hand-over lists every block of this shard's slots the other holds, as the repair does.
The old holder's copy stays until its eviction takes it: no caller asks a shard for blocks of slots it does not own.
Taking shards away is the same hand-over: the shards that stay restart with the smaller count, those that go restart
as leaving (``CacheServiceSettings.leaving``: a number at or past the count; they own no slots and take no writes),
and each shard that stays asks each leaving one too (``peers`` lists them after the shards, or their beats name
them) for the blocks of its slots; a leaving shard is stopped once every shard that stays has asked it.

Pull, not push: the restarted shard is the one that knows it lost its blocks, and the only one that needs the
other shards' addresses (``kvmesh up`` learns them once the shards are up, and gives them to a restarted one).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
from kvmesh import tls
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.shards import SLOTS, ShardMap
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc
from kvmesh.settings import CacheServiceSettings, SharedSettings

from services.cachesvc.pool import Pool
from services.cachesvc.store import PoolFull, StoreUnavailable

log = logging.getLogger("cachesvc.repair")

R = TypeVar("R")
SLOTS_PER_LIST = 256  # slots one ListBlocks asks about (a 16th of the map: its answer stays small)
SLOTS_PER_HANDOVER = 1024  # the hand-over's, with copies: each call is a pass over the answering shard's pool
BATCH_BYTES = 16 << 20  # block bytes one GetBlocks fetches at most (the storage thread stores them in one put)
RETRY_S = 5.0  # slots whose other copies are all unreachable are tried again this often
CALL_TIMEOUT_S = 30.0


class PeerFailed(Exception):
    """A shard did not answer a repair call; its slots go to the next live copy, or wait."""


def slot_mask(slots: Sequence[int]) -> bytes:
    """``slots`` as ListBlocks' bitmask: bit ``s`` of the little-endian bytes."""
    mask = 0
    for s in slots:
        mask |= 1 << s
    return mask.to_bytes(SLOTS // 8, "little")


def mask_slots(mask: bytes) -> set[int]:
    """The slots of a ListBlocks bitmask; ValueError (what to send) when it is longer than the map."""
    if len(mask) > SLOTS // 8:
        raise ValueError(f"slots has {len(mask)} bytes: a bitmask of the {SLOTS} slots takes at most {SLOTS // 8}")
    bits = int.from_bytes(mask, "little")
    return {s for s in range(bits.bit_length()) if bits >> s & 1}


def _copy_runs(got: cache_pb2.GetBlocksResponse, n: int) -> list[tuple[int, int, int, float, tuple[str, ...]]]:
    """The answer's first ``n`` blocks as runs of one retention and one set of sessions: (first, end, priority,
    seconds it holds, the sessions that hold them). A shard that sends no retention or no sessions (an older
    build) gives none of it."""
    if len(got.priorities) == n and len(got.priority_s) == n:
        # whole seconds (a second's difference is not worth another put), never rounded down to 0 (= for good)
        kept = [(p, 0.0 if s <= 0 else float(max(1, round(s)))) for p, s in zip(got.priorities, got.priority_s)]
    else:
        kept = [(0, 0.0)] * n
    held = [tuple(h.keys) for h in got.sessions] if len(got.sessions) == n else [()] * n
    runs, first = [], 0
    for (priority, seconds, sessions), group in itertools.groupby(
            (p, s, h) for (p, s), h in zip(kept, held, strict=True)):
        end = first + len(list(group))
        runs.append((first, end, priority, seconds, sessions))
        first = end
    return runs


class Repair:
    """One shard's repair from the others. ``storage`` runs a function on the pool's storage thread."""

    def __init__(self, cfg: CacheServiceSettings, shared: SharedSettings, smap: ShardMap, pool: Pool,
                 storage: Callable[..., Awaitable[Any]], repaired: Callable[[int, int, int], None],
                 peers: Mapping[int, str] | None = None) -> None:
        """``peers``: every shard's address by shard number, then those of shards leaving (default:
        ``cfg.peers``)."""
        self.shard, self.smap, self.pool = cfg.shard, smap, pool
        self.storage = storage
        self.repaired = repaired  # (source shard, blocks, bytes): the metrics
        self.rate = cfg.repair_mb_s << 20
        self.max_bytes = min(BATCH_BYTES, (cfg.max_message_mb << 20) - (1 << 20))
        opts = [("grpc.max_receive_message_length", cfg.max_message_mb << 20)]
        addresses = dict(enumerate(cfg.peer_addresses)) if peers is None else peers
        self.channels = {s: tls.aio_channel(a, opts, shared) for s, a in addresses.items() if s != cfg.shard}
        self.stubs = {s: cache_pb2_grpc.CacheServiceStub(ch) for s, ch in self.channels.items()}
        self.blocks = 0  # fetched and stored since start (Stats)
        self.bytes = 0
        self.pending = len(smap.pool_slots(cfg.shard)) if smap.pool_copies > 1 else 0  # slots to repair (Stats)
        self.handover_pending = len(self.stubs)  # shards not yet asked for blocks of this one's slots (Stats)
        self._paced = (time.monotonic(), 0)  # (since, bytes fetched since): the rate cap

    async def run(self) -> None:
        if self.smap.pool_copies > 1:
            await self._copies()
        await self._handover()

    async def _copies(self) -> None:
        pending = set(self.smap.pool_slots(self.shard))
        started = time.monotonic()
        log.info("repair: fetching what this shard lacks of its %d slots from the other copies' shards (%d MB/s "
                 "at most)", len(pending), self.rate >> 20)
        failing: set[int] = set()  # shards whose failure was logged, until they answer again
        while pending:
            down: set[int] = set()
            while plan := self.smap.repair_sources(self.shard, set(self.stubs) - down, sorted(pending)):
                for source, slots in plan.items():
                    if not await self._asked(source, slots, failing, logging.WARNING, "repair: shard %d did not "
                                             "answer (its slots go to the next live copy, or wait %gs): %s"):
                        down.add(source)
                        continue
                    pending.difference_update(slots)
                    self.pending = len(pending)
            if pending:
                await asyncio.sleep(RETRY_S)
        log.info("repair done: %d blocks (%d MB) fetched in %.1fs", self.blocks, self.bytes >> 20,
                 time.monotonic() - started)

    async def _handover(self) -> None:
        """Ask every other shard, once it serves at this count, for the blocks of this shard's slots it holds."""
        slots = self.smap.pool_slots(self.shard)
        left, failing = set(self.stubs), set[int]()
        before = self.blocks
        started = time.monotonic()
        while left:
            for source in sorted(left):
                if await self._asked(source, slots, failing, logging.INFO, "hand-over: shard %d not asked yet "
                                     "(asked again every %gs until it serves at this count): %s",
                                     foreign_only=self.smap.pool_copies == 1, step=SLOTS_PER_HANDOVER):
                    left.discard(source)
                    self.handover_pending = len(left)
            if left:
                await asyncio.sleep(RETRY_S)
        log.info("hand-over done: every other shard asked for the blocks of this shard's %d slots; %d blocks "
                 "fetched in %.1fs", len(slots), self.blocks - before, time.monotonic() - started)

    async def _asked(self, source: int, slots: list[int], failing: set[int], level: int, why: str,
                     foreign_only: bool = False, step: int = SLOTS_PER_LIST) -> bool:
        """Fetch what this shard lacks of ``slots`` from ``source`` (``_from``): False when it did not answer
        (said at ``level`` with ``why`` once, until it answers again: ``failing``)."""
        try:
            await self._from(source, slots, foreign_only, step)
        except PeerFailed as e:
            if source not in failing:
                failing.add(source)
                log.log(level, why, source, RETRY_S, e)
            return False
        failing.discard(source)
        return True

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()

    async def _from(self, source: int, slots: list[int], foreign_only: bool = False,
                    step: int = SLOTS_PER_LIST) -> None:
        """Fetch what this shard lacks of ``slots`` from ``source``, listing ``step`` slots a call (each call a pass
        over its pool); ``foreign_only``: of what it holds of them outside its own slots (the hand-over with one
        copy), listed in one call (an empty answer under an unchanged map)."""
        stub = self.stubs[source]
        view = cache_pb2.ShardView(shard=source, shards=self.smap.shards)
        step = len(slots) if foreign_only else step
        for i in range(0, len(slots), max(1, step)):
            listed = await self._call(stub.ListBlocks, cache_pb2.ListBlocksRequest(
                slots=slot_mask(slots[i:i + step]), foreign_only=foreign_only, view=view), source)
            for held in listed.blocks:
                layout = KVLayout.from_proto(held.layout)
                want = await self.storage(self.pool.lacking, layout, list(held.block_keys))
                if want:
                    await self._fetch(stub, view, source, layout, want)

    async def _fetch(self, stub: cache_pb2_grpc.CacheServiceStub, view: cache_pb2.ShardView, source: int,
                     layout: KVLayout, keys: list[int]) -> None:
        """Read ``keys`` from ``source`` and store them; a key it no longer holds (evicted since it listed it)
        is skipped."""
        per_call = max(1, self.max_bytes // layout.block_nbytes)
        proto_layout = layout.to_proto()
        i = 0
        while i < len(keys):
            batch = keys[i:i + per_call]
            try:
                got = await self._call(stub.GetBlocks, cache_pb2.GetBlocksRequest(
                    layout=proto_layout, block_keys=batch, copy=True, view=view), source)
            except _Refused:  # held there only under another layout since: skip it
                i += 1
                continue
            n = len(got.block_keys)
            if n == 0:
                i += 1
                continue
            if list(got.block_keys) != batch[:n]:
                raise PeerFailed(f"shard {source} answered with blocks that were not asked for")
            stored = 0
            for first, last, priority, priority_s, sessions in _copy_runs(got, n):  # runs of one retention
                nb = layout.block_nbytes
                put = functools.partial(self._put, layout, batch[first:last], list(got.checksums[first:last]),
                                        memoryview(got.data)[first * nb:last * nb], priority, priority_s,
                                        sessions, f"cachesvc shard {source} (repair)")
                try:
                    stored += await self.storage(put)
                except (PoolFull, StoreUnavailable, ValueError) as e:  # ours is full, or a block arrived damaged
                    log.warning("repair: %d blocks from shard %d not stored: %s", last - first, source, e)
            self.blocks += stored
            self.bytes += stored * layout.block_nbytes
            self.repaired(source, stored, stored * layout.block_nbytes)
            i += n
            await self._pace(len(got.data))

    def _put(self, layout: KVLayout, keys: list[int], checksums: list[int], data: memoryview, priority: int,
             priority_s: float, sessions: tuple[str, ...], writer: str) -> int:
        """On the storage thread: store a run of copies with their retention, held by the sessions that held
        them there; the blocks stored."""
        stored = self.pool.put(layout, keys, checksums, data, priority=priority, priority_s=priority_s,
                               writer=writer).stored
        self.pool.hold_too(sessions, keys)
        return stored

    async def _pace(self, nbytes: int) -> None:
        """Sleep as long as keeps the fetch rate at ``repair_mb_s`` over the last few seconds."""
        since, done = self._paced
        now = time.monotonic()
        if now - since > 5.0:  # a fresh window: an idle while earns no burst
            since, done = now, 0
        done += nbytes
        self._paced = (since, done)
        ahead = since + done / self.rate - now
        if ahead > 0:
            await asyncio.sleep(ahead)

    async def _call(self, method: Callable[..., Awaitable[R]], request: Any, source: int) -> R:
        try:
            return await method(request, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION and isinstance(request, cache_pb2.GetBlocksRequest):
                raise _Refused(e.details()) from None
            raise PeerFailed(f"{type(request).__name__[:-7]} to shard {source}: {e.code().name}: {e.details()}") \
                from None


class _Refused(Exception):
    """GetBlocks refused the first key (held only under another layout)."""
