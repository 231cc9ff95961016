"""An external tier on Mooncake Store (PyPI ``mooncake-transfer-engine-non-cuda``; needs Debian's
``libibverbs1``), so a multi-node pool runs on an existing distributed engine.

cachesvc treats the store as a cache and keeps its own index of what it put there: the store forgets every key
when its master restarts, reads of a dead holder's objects fail for a while, and nothing tells cachesvc when the
store evicts on its own. A read that misses or fails checksum drops the key from this index and ends the run.
cachesvc also bounds what it keeps there (``capacity_bytes``) and removes by its own eviction strategy.
Leases protect blocks only inside cachesvc; the store's own leases cover reads in flight.

Objects are named ``<namespace>/<layout id>/<block key hex>`` (the layout id is an xxh3_64 of the layout) and
hold the block's checksum (8 bytes, little-endian) followed by its bytes.

The index outlives a cachesvc restart through a manifest in the store itself: a header
``<namespace>/manifest/<owner>`` (JSON: generation, layouts, one checksum per chunk) and its chunks
``<namespace>/manifest/<owner>/<generation>/<i>`` (fixed-size records: key, checksum, size, layout, hits,
priority, times relative to the write). The storage thread writes it when the index changed, at most every
``manifest_s`` seconds (``Pool.maintain``), and at close: chunks of a new generation first, the header last,
then the old chunks go, so a crash mid-write leaves the previous manifest whole. A starting tier keeps the
entries whose objects still exist; a missing manifest (the master restarted: its objects are gone too) or an
unreadable one starts empty. Blocks put after the last write are orphans until the store evicts them. Objects
live where the store places them: those in the memory cachesvc itself lends (``segment_bytes``) go when it
stops, so lend 0 to keep every block on the store's other nodes.

The store has no authentication; its master and clients are reachable by anyone who can reach their ports, so
run them on a private network (tests bind the master to 127.0.0.1). Calls block: the pool's storage thread
makes them.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash
from kvmesh.contracts.layout import KVLayout
from kvmesh.engine.eviction import EvictionPolicy

from services.cachesvc.store import (
    Evicted,
    PoolFull,
    Retention,
    StoredBlock,
    StoreUnavailable,
    Usage,
    pick_victims,
)

log = logging.getLogger(__name__)
NO_SPACE = -200   # the store is full of objects it may not evict (leased)
MANIFEST_VERSION = 1
RECORD = struct.Struct("<QQIHQqdd")  # key, checksum, nbytes, layout index, hits, priority, last access, until
CHUNK_RECORDS = (4 << 20) // RECORD.size  # a chunk object stays well under the client's 16 MiB buffer
EXIST_BATCH = 8192


def store_class() -> tuple[Any, Any]:
    """``(MooncakeDistributedStore, ReplicateConfig)``, or a RuntimeError saying what to install."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except (ImportError, OSError) as e:
        raise RuntimeError("the mooncake external tier needs the PyPI package 'mooncake-transfer-engine-non-cuda' "
                           f"(pip install 'kvmesh[mooncake]') and Debian's libibverbs1: {e}") from e
    return MooncakeDistributedStore, ReplicateConfig


@dataclass(frozen=True)
class MooncakeSettings:
    master: str                # master RPC address, host:port
    metadata_url: str          # e.g. http://127.0.0.1:8080/metadata (the master's built-in HTTP server)
    local_host: str            # this client's address as other store nodes reach it
    segment_bytes: int         # memory this process contributes to the store (0, or at least 16 MiB)
    capacity_bytes: int        # what cachesvc keeps in the store at most
    replicas: int = 1
    manifest_s: float = 5.0    # the index is written to the store at most this often
    owner: str = "cachesvc"    # names this replica's manifest (its durable name)


@dataclass(slots=True)
class _Meta:
    checksum: int
    nbytes: int
    usage: Usage


def _record(key: int, layout_index: int, meta: _Meta, now: float) -> bytes:
    u = meta.usage
    return RECORD.pack(key, meta.checksum, meta.nbytes, layout_index, u.hit_count, u.priority,
                       u.last_access - now, u.priority_until - now)


class MooncakeTier:
    name = "external"

    def __init__(self, settings: MooncakeSettings, namespace: str, policy: EvictionPolicy,
                 pinned: Callable[[int], bool], clock: Callable[[], float]) -> None:
        store_cls, config_cls = store_class()
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", settings.local_host)
        self.store = store_cls()
        buffer_bytes = min(max(settings.segment_bytes, 16 << 20), 64 << 20)
        rc = self.store.setup(settings.local_host, settings.metadata_url, settings.segment_bytes,
                              buffer_bytes, "tcp", "", settings.master)
        if rc != 0:
            raise RuntimeError(f"Mooncake Store setup (master {settings.master}, metadata "
                               f"{settings.metadata_url}) failed: rc={rc}; is mooncake_master running there, "
                               "and is the segment 0 or at least 16 MiB?")
        self.replicate = config_cls()
        self.replicate.replica_num = settings.replicas
        self.pin = config_cls()  # the manifest: never evicted by the store
        self.pin.replica_num = settings.replicas
        self.pin.with_hard_pin = True
        self.namespace = namespace
        self.capacity_bytes = settings.capacity_bytes
        self.policy = policy
        self.pinned = pinned
        self.clock = clock
        self.used_bytes = 0
        self.evicted = 0
        self.lost = 0  # indexed blocks the store no longer had
        self._meta: dict[int, dict[KVLayout, _Meta]] = {}
        self._layout_ids: dict[KVLayout, str] = {}
        self._order = 0
        self.manifest = f"{namespace}/manifest/{settings.owner}"
        self.manifest_s = settings.manifest_s
        self._generation = 0
        self._chunks: list[str] = []  # the manifest's chunk objects now in the store
        self._dirty = False
        self._flushed_at = clock()
        self._recover()

    def __len__(self) -> int:
        return sum(len(by_layout) for by_layout in self._meta.values())

    def has(self, key: int) -> bool:
        return key in self._meta

    def held_keys(self) -> Iterable[int]:
        return self._meta.keys()

    def layouts(self, key: int) -> Iterable[KVLayout]:
        return self._meta.get(key, {}).keys()

    def holds(self, key: int, layout: KVLayout) -> bool:
        return layout in self._meta.get(key, {})

    def _name(self, layout: KVLayout, key: int) -> str:
        layout_id = self._layout_ids.get(layout)
        if layout_id is None:
            layout_id = self._layout_ids[layout] = xxhash.xxh3_64_hexdigest(layout.to_json())
        return f"{self.namespace}/{layout_id}/{key:016x}"

    def put(self, layout: KVLayout, blocks: Sequence[StoredBlock], retention: Retention) -> list[Evicted]:
        need = sum(len(b.data) for b in blocks)
        if need > self.capacity_bytes:
            raise PoolFull(f"the new blocks take {need} bytes but cachesvc keeps at most {self.capacity_bytes} "
                           "in the external store")
        self._evict(self.used_bytes + need - self.capacity_bytes)
        names = [self._name(layout, b.key) for b in blocks]
        values = [b.checksum.to_bytes(8, "little") + bytes(b.data) for b in blocks]
        rc = self.store.put_batch(names, values, self.replicate)
        if rc == NO_SPACE:
            raise PoolFull("the external store is full of objects it may not evict (rc=-200); retry later")
        if rc != 0:
            raise StoreUnavailable(f"Mooncake Store put_batch of {len(blocks)} blocks failed: rc={rc}")
        t = self.clock()
        for b in blocks:
            self._order += 1
            usage = retention.usage(self._order, t, b.key)
            self._meta.setdefault(b.key, {})[layout] = _Meta(b.checksum, len(b.data), usage)
        self.used_bytes += need
        self._dirty = True
        return []

    def read(self, layout: KVLayout, keys: Sequence[int], touch: bool = True) -> list[StoredBlock]:
        run = []
        for key in keys:
            meta = self._meta.get(key, {}).get(layout)
            if meta is None:
                break
            run.append((key, meta))
        if not run:
            return []
        values = self.store.get_batch([self._name(layout, key) for key, _ in run])
        out = []
        t = self.clock()
        for (key, meta), value in zip(run, values):
            data = memoryview(value)[8:]
            checksum = int.from_bytes(value[:8], "little")
            if len(data) != meta.nbytes or xxhash.xxh3_64_intdigest(data) != checksum:
                self._forget(key, layout)
                self.lost += 1
                break
            meta.checksum = checksum  # an earlier copy of the same block may have won the put: it is as good
            if touch:
                meta.usage.hit(t)
            out.append(StoredBlock(key, checksum, data))
        self._dirty = self._dirty or bool(out)
        return out

    def usages(self, key: int) -> Iterable[Usage]:
        return [m.usage for m in self._meta.get(key, {}).values()]

    def rerank(self, key: int) -> None:
        """Nothing to do: entries are ranked afresh at each eviction pass."""

    def _forget(self, key: int, layout: KVLayout) -> _Meta:
        meta = self._meta[key].pop(layout)
        if not self._meta[key]:
            del self._meta[key]
        self.used_bytes -= meta.nbytes
        self._dirty = True
        return meta

    def _evict(self, nbytes: int) -> None:
        entries = ((key, layout, m.usage, m.nbytes) for key, by_layout in self._meta.items()
                   for layout, m in by_layout.items())
        victims = pick_victims(entries, self.policy, self.pinned, nbytes, self.clock(), self.name)
        if victims:
            self.store.batch_remove([self._name(layout, key) for key, layout in victims])  # leased there: it ages out
            for key, layout in victims:
                self._forget(key, layout)
            self.evicted += len(victims)

    def flush(self, force: bool = False) -> None:
        """Write the manifest if the index changed and ``manifest_s`` passed since the last write (``force``:
        whenever it changed). A failed write is logged and retried on the next call."""
        now = self.clock()
        if not self._dirty or (not force and now - self._flushed_at < self.manifest_s):
            return
        layouts = list({layout: None for by_layout in self._meta.values() for layout in by_layout})
        index = {layout: i for i, layout in enumerate(layouts)}
        entries = sorted(((m.usage.order, key, layout, m) for key, by_layout in self._meta.items()
                          for layout, m in by_layout.items()), key=lambda e: e[0])
        records = b"".join(_record(key, index[layout], m, now) for _, key, layout, m in entries)
        step = CHUNK_RECORDS * RECORD.size
        chunks = [records[i:i + step] for i in range(0, len(records), step)]
        generation = self._generation + 1
        names = [f"{self.manifest}/{generation}/{i}" for i in range(len(chunks))]
        header = json.dumps({"version": MANIFEST_VERSION, "generation": generation, "entries": len(entries),
                             "layouts": [layout.to_dict() for layout in layouts],
                             "chunks": [xxhash.xxh3_64_intdigest(c) for c in chunks]}).encode()
        rc = self.store.upsert_batch(names, chunks, self.pin) if chunks else 0
        if rc == 0:
            rc = self.store.upsert(self.manifest, header, self.pin)
        if rc != 0:
            log.warning("could not write the external tier's manifest %s (rc=%d); retrying later",
                        self.manifest, rc)
            return
        if self._chunks:
            self.store.batch_remove(self._chunks, True)
        self._generation, self._chunks = generation, names
        self._dirty, self._flushed_at = False, now
        log.debug("wrote manifest %s: %d entries in %d chunks", self.manifest, len(entries), len(chunks))

    def _recover(self) -> None:
        """Rebuild the index from the manifest, keeping the entries whose objects still exist."""
        header = self.store.get(self.manifest)
        if not header:
            log.info("no manifest %s in the external store: starting empty", self.manifest)
            return
        try:
            found = self._read_manifest(header)
        except (ValueError, LookupError, TypeError, AttributeError, struct.error) as e:
            log.warning("the external tier's manifest %s is unreadable (%s): starting empty; its blocks "
                        "stay in the store until it evicts them", self.manifest, e)
            return
        exist: list[int] = []
        for i in range(0, len(found), EXIST_BATCH):
            batch = found[i:i + EXIST_BATCH]
            exist += self.store.batch_is_exist([self._name(layout, key) for key, layout, _ in batch])
        for (key, layout, meta), present in zip(found, exist):
            if present == 1:
                self._meta.setdefault(key, {})[layout] = meta
                self.used_bytes += meta.nbytes
        kept = len(self)
        self._order = len(found)
        self._dirty = kept < len(found)
        log.info("recovered %d external blocks (%d bytes) from manifest %s; %d were gone from the store",
                 kept, self.used_bytes, self.manifest, len(found) - kept)

    def _read_manifest(self, header: bytes) -> list[tuple[int, KVLayout, _Meta]]:
        """The manifest's entries in write order; ValueError (LookupError, ...) when it is not whole."""
        head = json.loads(header)
        if head.get("version") != MANIFEST_VERSION:
            raise ValueError(f"version {head.get('version')!r}, expected {MANIFEST_VERSION}")
        layouts = [KVLayout.from_dict(fields) for fields in head["layouts"]]
        generation = int(head["generation"])
        names = [f"{self.manifest}/{generation}/{i}" for i in range(len(head["chunks"]))]
        chunks = self.store.get_batch(names) if names else []
        for name, chunk, checksum in zip(names, chunks, head["chunks"]):
            if not chunk or xxhash.xxh3_64_intdigest(chunk) != checksum:
                raise ValueError(f"chunk {name} is missing or fails its checksum")
        now = self.clock()
        found = []
        for order, (key, checksum, nbytes, layout, hits, priority, last, until) in enumerate(
                RECORD.iter_unpack(b"".join(chunks)), start=1):
            usage = Usage(order, now + last, hits, priority, now + until, key=key)
            found.append((key, layouts[layout], _Meta(checksum, nbytes, usage)))
        if len(found) != head["entries"]:
            raise ValueError(f"{len(found)} entries, the header says {head['entries']}")
        self._generation, self._chunks = generation, names
        return found

    def close(self) -> None:
        self.flush(force=True)
        self.store.close()
