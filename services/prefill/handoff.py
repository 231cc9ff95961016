"""How prefill hands a request's KV to decode: push the blocks part by part while the engine computes, then
announce them on ``kv.ready``. ``Handoff`` is the strategy the servicer holds; the fault tests' variant lives in
``faults.py`` (``make_handoff`` picks one at start-up), so the servicer has no fault branches."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, NamedTuple

from kvmesh.contracts.engine import ExportedKV
from kvmesh.contracts.ids import BlockKey, TransferId, part_transfer_id
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.messages import KVReady
from kvmesh.instance.host import EngineHost
from kvmesh.telemetry import tracing
from kvmesh.transfer import TransferClient
from kvmesh.transfer.client import TransferStats
from kvmesh.transfer.header import Versions
from opentelemetry.trace import Span

log = logging.getLogger(__name__)

Announce = Callable[[KVReady, Span | None], Awaitable[None]]


def announcer(host: EngineHost) -> Announce:
    """Publish ``kv.ready`` on the host's bus, with the parent span's trace context and the send time (decode's
    ``kv.ready`` span)."""
    async def announce(ready: KVReady, parent: Span | None = None) -> None:
        headers = tracing.inject(parent, {tracing.SENT_HEADER: str(time.time_ns())})
        await host.bus.publish(host.subjects.kv_ready(ready.decode_instance), ready, headers)
    return announce


class Target(NamedTuple):
    """Where a request's KV goes, as decode said when it accepted the request (through the router)."""

    address: str        # decode's transfer endpoint
    token: str          # the push capability decode issued: every part carries it
    versions: Versions  # the transfer header versions decode reads


class PartStats(NamedTuple):
    """One part of a push (``time.monotonic()`` readings)."""

    nbytes: int    # bytes sent (0 when nothing was)
    blocks: int
    exported: float  # the engine handed the part over
    start: float     # its push began (after the part before it was verified)
    end: float       # decode verified it
    layers: tuple[int, int] | None = None  # the blocks' slice of these layers (a layer group); None: all


class PushStream:
    """One request's KV on its way to decode, one part per piece the engine reads out (a prefill chunk's new
    blocks, or with layer groups their slice of a group of layers), each part a transfer of its own
    (``part_transfer_id``) whose header says which blocks and layers it holds. Parts are pushed in order, one
    at a time, on the event loop while the engine thread computes the next chunk (or the chunk's next
    layers). ``finish`` waits for all of them; a failed part fails it, and the parts after it are never sent.
    ``cancel`` stops what has not been sent."""

    def __init__(self, handoff: Handoff, transfer_id: TransferId, target: Target, layout: KVLayout) -> None:
        self.handoff, self.transfer_id, self.target, self.layout = handoff, transfer_id, target, layout
        self.done: list[PartStats] = []  # the parts verified so far, in order
        self.first_block = 0  # the request's first block pushed (the first part's)
        self._tasks: list[asyncio.Task[PartStats]] = []

    @property
    def parts(self) -> int:
        return len(self._tasks)

    def add(self, kv: ExportedKV) -> None:
        """Push ``kv`` (blocks ``kv.first_block ..`` of the request) once the parts before it are verified."""
        before = self._tasks[-1] if self._tasks else None
        if before is None:
            self.first_block = kv.first_block
        self._tasks.append(asyncio.create_task(self._push(len(self._tasks), kv, time.monotonic(), before)))

    async def finish(self) -> list[PartStats]:
        return list(await asyncio.gather(*self._tasks))

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def _push(self, part: int, kv: ExportedKV, exported: float,
                    before: asyncio.Task[PartStats] | None) -> PartStats:
        if before is not None:
            await before  # its failure is this part's too: decode needs them all
        n, bs = kv.num_blocks, self.layout.block_size
        tokens = min(kv.num_tokens, (kv.first_block + n) * bs) - kv.first_block * bs
        start = time.monotonic()
        stats = await self._send(part_transfer_id(self.transfer_id, part), kv.data, kv.piece_keys, tokens,
                                 kv.first_block, kv.layers)
        done = PartStats(stats.nbytes, n, exported, start, time.monotonic(), kv.layers)
        self.done.append(done)
        return done

    async def _send(self, transfer_id: TransferId, blocks: memoryview, keys: Sequence[BlockKey],
                    num_tokens: int, first_block: int, layers: tuple[int, int] | None) -> TransferStats:
        return await self.handoff.transfer.push(self.target.address, transfer_id, self.layout, blocks, list(keys),
                                                num_tokens, layers=layers, first_block=first_block,
                                                token=self.target.token, versions=self.target.versions)


def push_overlap(parts: list[PartStats], compute_end: float) -> dict[str, Any]:
    """``kv.push``'s attributes for a push that overlapped the prefill (``compute_end``: the last chunk's
    output left the engine): bytes sent, the push time (the parts' own push times added up), what of it was
    left after the compute (``kvmesh.critical_ms``, the part of the push on the TTFT path) and its share, and
    per part its blocks, layers (``first-end``), bytes, push time, wait behind the part before and end
    relative to ``compute_end``."""
    push_s = sum(p.end - p.start for p in parts)
    nbytes = sum(p.nbytes for p in parts)
    critical_s = max(0.0, parts[-1].end - compute_end) if parts else 0.0

    def ms(xs: Iterable[float]) -> list[float]:
        return [round(x * 1e3, 3) for x in xs]

    return {"kvmesh.bytes": nbytes, "kvmesh.gbps": round(nbytes / push_s / 1e9, 3) if push_s > 0 else 0.0,
            "kvmesh.push_ms": round(push_s * 1e3, 3), "kvmesh.critical_ms": round(critical_s * 1e3, 3),
            "kvmesh.critical_share": round(critical_s / push_s, 4) if push_s > 0 else 0.0,
            "kvmesh.part.blocks": [p.blocks for p in parts], "kvmesh.part.bytes": [p.nbytes for p in parts],
            "kvmesh.part.layers": ["all" if p.layers is None else f"{p.layers[0]}-{p.layers[1]}" for p in parts],
            "kvmesh.part.push_ms": ms(p.end - p.start for p in parts),
            "kvmesh.part.wait_ms": ms(p.start - p.exported for p in parts),
            "kvmesh.part.end_ms": ms(p.end - compute_end for p in parts)}


class Handoff:
    """Push a request's blocks to decode's transfer endpoint; announce them (``kv.ready``) once they landed."""

    def __init__(self, announce: Announce, transfer: TransferClient | None = None) -> None:
        self._announce = announce
        self.transfer = transfer or TransferClient()

    def open(self, transfer_id: TransferId, target: Target, layout: KVLayout) -> PushStream:
        """A push of one request's KV to decode's ``target``, in ``layout``."""
        return PushStream(self, transfer_id, target, layout)

    async def announce(self, ready: KVReady, span: Span | None) -> None:
        await self._announce(ready, span)

    async def close(self) -> None:
        await self.transfer.close()
