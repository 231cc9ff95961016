"""Snapshot-on-gap: keeps the index exact when an instance's event batches skip or repeat sequence numbers.

A batch that is not the instance's next one (a gap: events were lost; or a stale seq: a redelivery, or the
instance restarted and numbers from 1 again, which only a snapshot tells apart) starts a resync: cachesvc asks
the instance for a snapshot (``kvmesh.bus.snapshot``) and holds back that instance's batches meanwhile. Then:

- snapshot received: the instance's blocks are replaced with it, and the held batches after its ``seq`` are
  applied;
- no snapshot (the instance is gone, or does not answer snapshots): the held batches are applied as they are.
  A held batch with seq 1 is taken as a restart (numbering starts again), a gap is counted and applied anyway.

After a NATS outage cachesvc asks every instance it indexes for a snapshot the same way (:meth:`Resync.refresh`):
what an instance evicted or stored while the bus was down, and published nowhere, is then in the index again.

Runs on the event loop, like the index.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from kvmesh.bus.snapshot import Snapshot
from kvmesh.contracts.messages import KVEventBatch

from services.cachesvc.index import BlockIndex, Order

log = logging.getLogger(__name__)

Fetch = Callable[[str], Awaitable[Snapshot | None]]


class Resync:
    def __init__(self, index: BlockIndex, fetch: Fetch) -> None:
        self.index = index
        self.fetch = fetch
        self.gaps = 0         # gaps detected
        self.stale = 0        # stale batches detected
        self.applied = 0      # snapshots applied
        self.failed = 0       # resyncs that got no snapshot
        self.refreshed = 0    # resyncs asked for after a NATS outage
        self._held: dict[str, list[KVEventBatch]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def requested(self) -> int:
        return self.gaps + self.stale

    def on_batch(self, batch: KVEventBatch) -> None:
        inst = batch.instance_id
        if inst in self._held:
            self._held[inst].append(batch)
            return
        order = self.index.order(batch)
        if order is Order.NEXT:
            self.index.apply(batch)
            return
        if order is Order.GAP:
            self.gaps += 1
        else:
            self.stale += 1
        log.info("kv events of %s: %s batch seq %d; asking for a snapshot", inst, order.value, batch.seq)
        self._start(inst, [batch])

    def refresh(self, instances: Iterable[str]) -> None:
        """Resync ``instances`` from snapshots (the bus was down: their events may not all have been published);
        an instance that sends none keeps what the index holds."""
        for inst in instances:
            if inst not in self._held:
                self.refreshed += 1
                self._start(inst, [])

    def _start(self, inst: str, held: list[KVEventBatch]) -> None:
        self._held[inst] = held
        task = asyncio.create_task(self._resync(inst), name=f"resync-{inst}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resync(self, inst: str) -> None:
        try:
            snapshot = await self.fetch(inst)
        except Exception:
            log.exception("snapshot request to %s failed", inst)
            snapshot = None
        held = self._held.pop(inst)
        if snapshot is not None:
            self.index.replace_instance(inst, snapshot.seq, snapshot.blocks.items())
            self.applied += 1
            log.info("applied the snapshot of %s at seq %d (%d blocks)", inst, snapshot.seq,
                     sum(map(len, snapshot.blocks.values())))
        else:
            self.failed += 1
        for batch in held:
            if snapshot is None and batch.seq == 1:
                self.index.forget_seq(inst)
            self.index.apply(batch)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
