"""The pool: its tiers in order (DRAM, disk, an external store; each optional) behind one put / get, and the
leases that protect what readers fetch.

- A put verifies every checksum, then stores the blocks no tier holds yet (under that layout) in the first tier
  that takes them. What a tier evicts to make room spills to the next tier (best effort: a spill that finds no
  room is dropped, the pool is a cache).
- A get returns the leading run of keys held under the reader's layout, from whichever tier holds each block,
  reading adjacent disk blocks at once. A hit below the first tier is copied up into it (promotion); the lower
  copy stays, so a hot block ends up replicated in DRAM and on disk.
- A reader with another layout is refused (``LayoutMismatch`` names the fields that differ).
- ``lease_s`` on a get (or ``lease``) pins the whole present leading run, not only what fits in one reply;
  eviction in every tier skips pinned keys until the lease is released or expires.
- With a session-aware strategy the tiers share its session table: a put names the session whose request wrote
  the blocks and every block of its context (``session_request``), signals end or pause sessions
  (``session_signal``), and blocks an engine instance also holds go before the pool's last copies
  (``mark_replicated``, from cachesvc's index).

Not thread-safe, except ``leading`` (dict membership tests only; see ``store.py``): one storage thread owns it.
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol, runtime_checkable

import xxhash
from kvmesh.contracts.events import BlockRemoved, BlockStored
from kvmesh.contracts.ids import BlockKey
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.sessions import SessionEvent
from kvmesh.contracts.shards import SLOTS
from kvmesh.engine.eviction import make_policy
from kvmesh.engine.eviction import now as monotonic
from kvmesh.engine.sessions import SessionTable, owner_after
from kvmesh.settings import CacheServiceSettings

from services.cachesvc.disk import DiskTier
from services.cachesvc.dram import DramTier
from services.cachesvc.store import (
    Evicted,
    LayoutMismatch,
    Leases,
    PoolFull,
    PutResult,
    Retention,
    Shadowing,
    StoredBlock,
    StoreUnavailable,
    Tier,
    check_layout,
    layout_diff,
)

log = logging.getLogger(__name__)
WRITERS_REMEMBERED = 1 << 20  # the writer and checksum of the last this many blocks stored (about 150 MB at most)

QUARANTINE_FILE = "quarantined.keys"  # in disk_dir: the quarantined block keys, 8 bytes each (little endian)


@runtime_checkable
class Flushes(Protocol):
    """A tier that writes its state on a timer; ``flush`` returns at once when nothing is due."""

    def flush(self, force: bool = False) -> None: ...


class GetResult(NamedTuple):
    blocks: list[StoredBlock]
    tiers: list[str]         # where each block came from
    lease_id: int            # 0: no lease
    leased: int              # keys the lease pins


class Pool:
    def __init__(self, tiers: Sequence[Tier], leases: Leases, sessions: SessionTable | None = None,
                 quarantine_file: Path | None = None) -> None:
        self.tiers = list(tiers)
        self.leases = leases
        self.sessions = sessions  # the tiers' session-aware strategy's table (None: the strategy reads none)
        # (key, layout) -> (checksum, writer) of what was stored: a second writer cannot shadow a block
        self.writers: OrderedDict[tuple[int, KVLayout], tuple[int, str]] = OrderedDict()
        self.quarantined: set[int] = set()  # keys an instance's KV canary caught diverging: never served
        # where they are kept across restarts (beside the disk tier, whose copies outlive a restart too)
        self.quarantine_file = quarantine_file
        if quarantine_file is not None and quarantine_file.exists():
            raw = quarantine_file.read_bytes()
            self.quarantined.update(k for (k,) in struct.iter_unpack("<Q", raw[:len(raw) // 8 * 8]))
        # told (on the storage thread) what each tier stored and removed: the server publishes it (pool.events)
        self.on_events: Callable[[list[BlockStored | BlockRemoved]], None] | None = None

    @classmethod
    def from_config(cls, cfg: CacheServiceSettings, clock: Callable[[], float] = monotonic,
                    cluster: str = "local") -> Pool:
        """The tiers ``cfg`` turns on (blocking: scans the disk tier, connects to the external store); the external
        store's objects are named under ``kvmesh/<cluster>``."""
        policy = make_policy(cfg.pool_eviction)
        sessions: SessionTable | None = getattr(policy, "sessions", None)
        if sessions is not None:
            sessions.idle_s = cfg.session_idle_s
        leases = Leases(clock, cfg.max_leases_per_caller)
        tiers: list[Tier] = []
        quarantine_file = Path(cfg.disk_dir) / QUARANTINE_FILE if cfg.disk_dir else None
        if cfg.pool_capacity_mb > 0:
            tiers.append(DramTier(cfg.pool_capacity_mb << 20, policy, leases.pinned, clock))
        if cfg.disk_dir:
            tiers.append(DiskTier(Path(cfg.disk_dir), cfg.disk_capacity_mb << 20, cfg.disk_segment_mb << 20,
                                  policy, leases.pinned, clock, reserve_bytes=cfg.disk_reserve_mb << 20))
        if cfg.external == "mooncake":
            from services.cachesvc.mooncake import MooncakeSettings, MooncakeTier

            settings = MooncakeSettings(cfg.mooncake_master, cfg.mooncake_metadata_url, cfg.mooncake_host,
                                        cfg.mooncake_segment_mb << 20, cfg.external_capacity_mb << 20,
                                        cfg.mooncake_replicas, cfg.mooncake_manifest_s, cfg.durable_name)
            tiers.append(MooncakeTier(settings, f"kvmesh/{cluster}", policy, leases.pinned, clock))
        return cls(tiers, leases, sessions, quarantine_file)

    def tier(self, name: str) -> Tier | None:
        return next((t for t in self.tiers if t.name == name), None)

    # -- queries (any thread) --------------------------------------------------------------------------------

    def held_bits(self, keys: Sequence[int], positions: Sequence[int]) -> list[tuple[str, int]]:
        """Per tier: a bitmask over ``keys``' positions with bit ``p`` set when ``keys[p]`` (``p`` among
        ``positions``) is held in this tier or a faster one (any layout; a quarantined key is not). Tiers
        with no bit are left out. A shard's MatchPrefix: the caller ORs the shards' masks."""
        masks = [0] * len(self.tiers)
        for p in positions:
            key = keys[p]
            if key in self.quarantined:
                continue
            fastest = next((i for i, t in enumerate(self.tiers) if t.has(key)), None)
            if fastest is not None:
                for i in range(fastest, len(masks)):
                    masks[i] |= 1 << p
        return [(t.name, m) for t, m in zip(self.tiers, masks) if m]

    def leading(self, keys: Sequence[int]) -> list[tuple[str, int]]:
        """Per tier: the leading run of ``keys`` (any layout) that this tier together with the faster ones
        holds; so the last tier's count is what a get can return at best, and the first tier's what comes from
        it alone. Tiers with 0 are left out."""
        counts = [0] * len(self.tiers)
        slowest = 0
        for key in keys:
            if key in self.quarantined:
                break
            fastest = next((i for i, t in enumerate(self.tiers) if t.has(key)), None)
            if fastest is None:
                break
            slowest = max(slowest, fastest)
            for i in range(slowest, len(counts)):
                counts[i] += 1
        return [(t.name, n) for t, n in zip(self.tiers, counts) if n]

    # -- storage thread --------------------------------------------------------------------------------------

    def put(self, layout: KVLayout, keys: Sequence[int], checksums: Sequence[int], data: bytes | memoryview,
            priority: int = 0, priority_s: float = 0.0, verified: bool = False, session: str = "",
            session_end: bool = False, session_blocks: Sequence[int] = (), writer: str = "") -> PutResult:
        """Store the blocks of ``data`` (back to back, in ``keys`` order) after verifying every checksum; keys
        already held under ``layout`` are skipped. All or nothing: any bad block rejects the whole put.
        ``priority`` (the ``priority`` eviction policy) holds for ``priority_s`` seconds (0: forever).
        ``verified``: the bytes were already checked against ``checksums`` (a transfer the transfer engine
        verified), so they are not hashed again. ``session``: the session whose request wrote them, which holds
        ``session_blocks`` (default ``keys``) now, or nothing when ``session_end``. ``writer``: who writes (the
        caller's mesh identity), remembered with each block stored; a put of a held key whose bytes differ from
        its writer's raises Shadowing (nothing stored), the same bytes are skipped as before."""
        nbytes = check_layout(layout)
        if len(checksums) != len(keys):
            raise ValueError(f"checksums has {len(checksums)} entries for {len(keys)} block_keys")
        view = memoryview(data).cast("B")
        if len(view) != len(keys) * nbytes:
            raise ValueError(f"data has {len(view)} bytes, but {len(keys)} blocks of this layout take "
                             f"{len(keys)} x {nbytes} = {len(keys) * nbytes} bytes")
        blocks = [StoredBlock(k, c, view[i * nbytes:(i + 1) * nbytes]) for i, (k, c) in enumerate(zip(keys, checksums))]
        for i, b in enumerate(() if verified else blocks):
            actual = xxhash.xxh3_64_intdigest(b.data)
            if actual != b.checksum:
                raise ValueError(f"block {i} (key {b.key:#018x}) fails its checksum: sent {b.checksum:#018x}, "
                                 f"its bytes hash to {actual:#018x}; nothing was stored")
        if not self.tiers:
            raise PoolFull("the pool has no tier: set pool_capacity_mb, disk_dir or external")
        new = {b.key: b for b in blocks if not any(t.holds(b.key, layout) for t in self.tiers)}
        for b in blocks:
            first = self.writers.get((b.key, layout)) if b.key not in new else None
            if first is not None and first[0] != b.checksum:
                raise Shadowing(f"block {b.key:#018x} is held as {first[1] or 'its first writer'} wrote it; "
                                f"{writer or 'this caller'} sent other bytes, which cannot replace them: nothing "
                                "was stored")
        if new:
            self.leases.reap()
            until = self.leases.clock() + priority_s if priority_s > 0 else float("inf")
            self._store(0, layout, list(new.values()), Retention(priority, until, session))
            for b in new.values():
                self.writers[(b.key, layout)] = (b.checksum, writer)
                self.writers.move_to_end((b.key, layout))
            while len(self.writers) > WRITERS_REMEMBERED:
                self.writers.popitem(last=False)
        if session:
            self.session_request(session, list(session_blocks or keys), session_end)
        return PutResult(stored=len(new), skipped=len(keys) - len(new))

    def retention(self, key: int) -> tuple[int, float]:
        """The retention a copy of ``key`` should keep (a repair's): its highest priority still holding in any
        tier, and for how many more seconds (0: for good; (0, 0) when none holds)."""
        now = self.leases.clock()
        held = [(u.priority, u.priority_until) for t in self.tiers for u in t.usages(key)
                if u.priority and u.priority_until > now]
        if not held:
            return 0, 0.0
        priority, until = max(held)
        return priority, 0.0 if until == float("inf") else max(until - now, 1e-3)

    # -- sessions and copies (storage thread) ----------------------------------------------------------------

    def quarantine(self, keys: Sequence[int]) -> None:
        """An instance's KV canary caught these blocks diverging: never served again (until cachesvc restarts:
        the tiers cannot overwrite what they hold, so a later put of the same key does not lift it). With a disk
        tier the keys are appended to ``QUARANTINE_FILE`` in its directory, read back at start: its copies
        outlive a restart, so must their quarantine."""
        new = [k for k in dict.fromkeys(keys) if k not in self.quarantined]
        self.quarantined.update(new)
        if new and self.quarantine_file is not None:
            try:
                with self.quarantine_file.open("ab") as f:
                    f.write(b"".join(struct.pack("<Q", k & 0xFFFF_FFFF_FFFF_FFFF) for k in new))
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:  # still quarantined in memory; a restart would forget these
                log.error("could not record %d quarantined keys in %s: %s", len(new), self.quarantine_file, e)
        if self.on_events is not None:
            events = [BlockRemoved(held, t.name, "quarantine") for t in self.tiers
                      if (held := tuple(BlockKey(k) for k in keys if t.has(k)))]
            if events:
                self.on_events(list(events))

    def session_request(self, session: str, blocks: Sequence[int], end: bool = False) -> None:
        """A request of ``session`` used ``blocks`` (its context): the session holds them now (nothing, when
        ``end``); what it let go of, and what it holds, are ranked again. A write-back comes after its request
        finished, perhaps after the pause it ended in: it does not end a pause (which runs out when overdue)."""
        if self.sessions is None:
            return
        changed = self.sessions.request(session, blocks, self.leases.clock(), end, resume=False)
        self._owned_by(session, blocks)
        self._rerank(changed | set(blocks))

    def holding(self, keys: Sequence[int]) -> list[tuple[str, ...]]:
        """The sessions that hold each of ``keys`` here, in order (what a repair's copy carries)."""
        return self.sessions.holding(keys) if self.sessions is not None else [() for _ in keys]

    def hold_too(self, sessions: Sequence[str], keys: Sequence[int]) -> None:
        """A copy's blocks (a repair's) are held by ``sessions`` here as they were at the shard they came from:
        they rank as those sessions' until the sessions' own requests say otherwise."""
        if self.sessions is None or not sessions:
            return
        changed: set[int] = set()
        for session in sessions:
            changed |= self.sessions.hold_too(session, keys, self.leases.clock())
            self._owned_by(session, keys)
        self._rerank(changed | set(keys))

    def _owned_by(self, session: str, keys: Sequence[int]) -> None:
        for key in keys:
            for tier in self.tiers:
                for usage in tier.usages(key):
                    usage.session_owner = owner_after(usage.session_owner, session)

    def session_signal(self, session: str, event: SessionEvent, expected_s: float = 0.0) -> None:
        """``session`` paused, demoted, released or ended (``SessionTable.signal``; a pause of a session not
        seen yet is recorded: its write-back may come after the signal)."""
        if self.sessions is not None:
            self._rerank(self.sessions.signal(session, event, self.leases.clock(), expected_s, create=True))

    def mark_replicated(self, shared: Sequence[int], sole: Sequence[int]) -> None:
        """Of the pool's blocks, ``shared`` are held by an engine instance too (they go first), ``sole`` no
        longer are."""
        for keys, replicated in ((shared, True), (sole, False)):
            for key in keys:
                for tier in self.tiers:
                    usages = [u for u in tier.usages(key) if u.replicated != replicated]
                    for u in usages:
                        u.replicated = replicated
                    if usages:
                        tier.rerank(key)

    def _rerank(self, keys: set[int]) -> None:
        for key in keys:
            for tier in self.tiers:
                if tier.has(key):
                    tier.rerank(key)

    def get(self, layout: KVLayout, keys: Sequence[int], max_bytes: int | None = None,
            lease_s: float = 0.0, holder: str = "", touch: bool = True) -> GetResult:
        """The leading run of ``keys`` held under ``layout``, cut to ``max_bytes``; with ``lease_s`` > 0 the
        whole run is leased first. LayoutMismatch when the first key is held only under other layouts.
        ``touch=False``: a copy for another shard, not a use (no hit counted, nothing promoted)."""
        nbytes = check_layout(layout)
        run: list[tuple[int, int]] = []  # (key, index of the fastest tier holding it)
        for key in keys:
            where = None if key in self.quarantined else \
                next((i for i, t in enumerate(self.tiers) if t.holds(key, layout)), None)
            if where is None:
                if not run:
                    self._refuse_other_layouts(key, layout)
                break
            run.append((key, where))
        lease_id = self.leases.grant([k for k, _ in run], lease_s, holder) if lease_s > 0 and run else 0
        limit = len(run) if max_bytes is None else min(len(run), max_bytes // nbytes)
        blocks: list[StoredBlock] = []
        names: list[str] = []
        for where, group in itertools.groupby(run[:limit], key=lambda item: item[1]):
            wanted = [k for k, _ in group]
            got = self.tiers[where].read(layout, wanted, touch)
            blocks += got
            names += [self.tiers[where].name] * len(got)
            if len(got) < len(wanted):
                break
        if touch:
            self._promote(layout, [b for b, name in zip(blocks, names) if name != self.tiers[0].name])
        return GetResult(blocks, names, lease_id, len(run) if lease_id else 0)

    def listing(self, slots: Container[int]) -> dict[KVLayout, list[int]]:
        """Every block held (any tier, not quarantined) whose key's slot is among ``slots``, by layout: what a
        shard that lost its copies fetches from this one."""
        out: dict[KVLayout, dict[int, None]] = {}
        for tier in self.tiers:
            for key in tier.held_keys():
                if key & (SLOTS - 1) in slots and key not in self.quarantined:
                    for layout in tier.layouts(key):
                        out.setdefault(layout, {})[key] = None
        return {layout: list(keys) for layout, keys in out.items()}

    def lacking(self, layout: KVLayout, keys: Sequence[int]) -> list[int]:
        """Those of ``keys`` no tier holds under ``layout`` (a quarantined key counts as held: never wanted)."""
        return [k for k in keys if k not in self.quarantined and not any(t.holds(k, layout) for t in self.tiers)]

    def lease(self, keys: Sequence[int], lease_s: float, holder: str = "") -> tuple[int, int]:
        """Pin the leading run of ``keys`` the pool holds (any layout): ``(lease id, keys pinned)``; ``holder``
        (the caller's mesh identity) holds at most ``max_leases_per_caller`` at once (TooManyLeases)."""
        run = list(itertools.takewhile(lambda k: any(t.has(k) for t in self.tiers), keys))
        return (self.leases.grant(run, lease_s, holder), len(run)) if run else (0, 0)

    def drain(self) -> int:
        """Spill the DRAM tier to the next one (a graceful stop); returns the blocks that went."""
        if len(self.tiers) < 2 or not isinstance(self.tiers[0], DramTier):
            return 0
        before = sum(len(t) for t in self.tiers[1:])
        drained = self.tiers[0].drain()
        self._told(self.tiers[0], None, [], drained)
        self._spill(1, drained)
        return sum(len(t) for t in self.tiers[1:]) - before

    def maintain(self) -> None:
        """Periodic work (the server calls it once a second): end expired leases, drop sessions silent past
        ``session_idle_s``, let tiers write what they persist on a timer (the external tier's manifest)."""
        self.leases.reap()
        if self.sessions is not None:
            self._rerank(self.sessions.expire(self.leases.clock()))
        for t in self.tiers:
            if isinstance(t, Flushes):
                t.flush()

    def close(self) -> None:
        for t in self.tiers:
            t.close()

    def _store(self, start: int, layout: KVLayout, blocks: list[StoredBlock], retention: Retention) -> None:
        """Put ``blocks`` into the first tier from ``start`` on that takes them; spill what it evicts."""
        refused: PoolFull | None = None
        for i in range(start, len(self.tiers)):
            try:
                evicted = self.tiers[i].put(layout, blocks, retention)
            except PoolFull as e:
                refused = e
                continue
            self._told(self.tiers[i], layout, [b.key for b in blocks], evicted)
            self._spill(i + 1, evicted)
            return
        raise refused or PoolFull("no tier below can take the blocks")

    def _spill(self, start: int, evicted: list[Evicted]) -> None:
        if start >= len(self.tiers):
            return
        for layout, group in itertools.groupby(evicted, key=lambda e: e.layout):
            blocks = [e.block for e in group if not any(t.holds(e.block.key, layout) for t in self.tiers[start:])]
            if blocks:
                try:
                    self._store(start, layout, blocks, Retention())
                except (PoolFull, StoreUnavailable) as e:
                    log.debug("dropped %d evicted blocks: %s", len(blocks), e)

    def _promote(self, layout: KVLayout, blocks: list[StoredBlock]) -> None:
        todo = [b for b in blocks if not self.tiers[0].holds(b.key, layout)]
        if not todo:
            return
        try:
            evicted = self.tiers[0].put(layout, todo, Retention())
            self._told(self.tiers[0], layout, [b.key for b in todo], evicted)
            self._spill(1, evicted)
        except (PoolFull, StoreUnavailable) as e:
            log.debug("no promotion of %d blocks: %s", len(todo), e)

    def _told(self, tier: Tier, layout: KVLayout | None, stored: Sequence[int], evicted: Sequence[Evicted]) -> None:
        """Tell ``on_events`` that ``tier`` stored ``stored`` and let go of ``evicted`` (a key it still holds in
        another layout is not gone)."""
        if self.on_events is None:
            return
        events: list[BlockStored | BlockRemoved] = []
        if stored and layout is not None:
            events.append(BlockStored(tuple(map(BlockKey, stored)), None, layout.block_size, tier.name))
        gone = tuple(dict.fromkeys(BlockKey(e.block.key) for e in evicted if not tier.has(e.block.key)))
        if gone:
            events.append(BlockRemoved(gone, tier.name, str(getattr(getattr(tier, "policy", None), "name", ""))))
        if events:
            self.on_events(events)

    def _refuse_other_layouts(self, key: int, layout: KVLayout) -> None:
        for t in self.tiers:
            stored = next(iter(t.layouts(key)), None)
            if stored is not None:
                raise LayoutMismatch(f"block {key:#018x} is stored with another layout "
                                     f"({layout_diff(stored, layout)}); a reader must match it")
