"""An external tier on Mooncake Store (PyPI ``mooncake-transfer-engine-non-cuda``; needs Debian's
``libibverbs1``), so a multi-node pool runs on an existing distributed engine.

cachesvc treats the store as a cache and keeps its own index of what it put there: the store forgets every key
when its master restarts, reads of a dead holder's objects fail for a while, and nothing tells cachesvc when the
store evicts on its own. A read that misses or fails checksum drops the key from this index and ends the run.
cachesvc also bounds what it keeps there (``capacity_bytes``) and removes by its own eviction strategy.
Leases protect blocks only inside cachesvc; the store's own leases cover reads in flight.

Objects are named ``<namespace>/<layout id>/<block key hex>`` (the layout id is an xxh3_64 of the layout) and
hold the block's checksum (8 bytes, little-endian) followed by its bytes.

The store has no authentication; its master and clients are reachable by anyone who can reach their ports, so
run them on a private network (tests bind the master to 127.0.0.1). Calls block: the pool's storage thread
makes them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash
from kvmesh.engine.eviction import EvictionPolicy
from kvmesh.engine.kv_cache import KVLayout

from services.cachesvc.disk import encode_layout
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
    segment_bytes: int         # memory this process contributes to the store (at least 16 MiB)
    capacity_bytes: int        # what cachesvc keeps in the store at most
    replicas: int = 1


@dataclass(slots=True)
class _Meta:
    checksum: int
    nbytes: int
    usage: Usage


class MooncakeTier:
    name = "external"

    def __init__(self, settings: MooncakeSettings, namespace: str, policy: EvictionPolicy,
                 pinned: Callable[[int], bool], clock: Callable[[], float]) -> None:
        store_cls, config_cls = store_class()
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", settings.local_host)
        self.store = store_cls()
        rc = self.store.setup(settings.local_host, settings.metadata_url, settings.segment_bytes,
                              min(settings.segment_bytes, 64 << 20), "tcp", "", settings.master)
        if rc != 0:
            raise RuntimeError(f"Mooncake Store setup (master {settings.master}, metadata "
                               f"{settings.metadata_url}) failed: rc={rc}; is mooncake_master running there, "
                               "and is the segment at least 16 MiB?")
        self.replicate = config_cls()
        self.replicate.replica_num = settings.replicas
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

    def __len__(self) -> int:
        return sum(len(by_layout) for by_layout in self._meta.values())

    def has(self, key: int) -> bool:
        return key in self._meta

    def layouts(self, key: int) -> Iterable[KVLayout]:
        return self._meta.get(key, {}).keys()

    def holds(self, key: int, layout: KVLayout) -> bool:
        return layout in self._meta.get(key, {})

    def _name(self, layout: KVLayout, key: int) -> str:
        layout_id = self._layout_ids.get(layout)
        if layout_id is None:
            layout_id = self._layout_ids[layout] = xxhash.xxh3_64_hexdigest(encode_layout(layout))
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
            usage = Usage(self._order, t, priority=retention.priority, priority_until=retention.until)
            self._meta.setdefault(b.key, {})[layout] = _Meta(b.checksum, len(b.data), usage)
        self.used_bytes += need
        return []

    def read(self, layout: KVLayout, keys: Sequence[int]) -> list[StoredBlock]:
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
            meta.usage.hit(t)
            out.append(StoredBlock(key, checksum, data))
        return out

    def _forget(self, key: int, layout: KVLayout) -> _Meta:
        meta = self._meta[key].pop(layout)
        if not self._meta[key]:
            del self._meta[key]
        self.used_bytes -= meta.nbytes
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

    def close(self) -> None:
        self.store.close()
