"""How prefill hands a request's KV to decode (push the blocks, then announce them on ``kv.ready``), and a
faulty variant for the fault tests (``fault_*`` worker settings): what a broken network or a stuck peer does to
a hand-off, produced on purpose so the tests can show decode never consumes it and never waits forever.

``make_handoff`` picks one at start-up; the servicer has no fault branches."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.messages import KVReady
from kvmesh.instance.host import EngineHost
from kvmesh.telemetry import tracing
from kvmesh.transfer import TransferClient
from kvmesh.transfer.backends import Backend, Staged
from kvmesh.transfer.client import TransferStats
from opentelemetry.trace import Span

log = logging.getLogger(__name__)

STALL_S = 60.0  # longer than any kv_timeout_s a test uses: the push is as good as lost
Announce = Callable[[KVReady, Span | None], Awaitable[None]]


def announcer(host: EngineHost) -> Announce:
    """Publish ``kv.ready`` on the host's bus, with the parent span's trace context and the send time (decode's
    ``kv.ready`` span)."""
    async def announce(ready: KVReady, parent: Span | None = None) -> None:
        headers = tracing.inject(parent, {tracing.SENT_HEADER: str(time.time_ns())})
        await host.bus.publish(host.subjects.kv_ready(ready.decode_instance), ready, headers)
    return announce


class Handoff:
    """Push a request's blocks to decode's transfer endpoint; announce them (``kv.ready``) once they landed."""

    def __init__(self, announce: Announce, transfer: TransferClient | None = None) -> None:
        self._announce = announce
        self.transfer = transfer or TransferClient()

    async def push(self, ready: KVReady, address: str, layout: KVLayout, blocks: memoryview,
                   span: Span) -> TransferStats:
        """``blocks``: the bytes of whole blocks in ``layout`` (``kv_cache.block_bytes`` of the engine's): the
        request's blocks from ``ready.first_block`` on, so the transfer covers the tokens from there."""
        return await self.transfer.push(address, ready.transfer_id, layout, blocks, list(ready.block_keys),
                                        ready.num_tokens - ready.first_block * layout.block_size)

    async def announce(self, ready: KVReady, span: Span | None) -> None:
        await self._announce(ready, span)

    async def close(self) -> None:
        await self.transfer.close()


class FaultyHandoff(Handoff):
    """The first ``corrupt`` pushes get a byte flipped on the wire; the first ``stall`` pushes announce their
    ``kv.ready`` and then stall; with ``drop_ready`` no successful push is ever announced."""

    def __init__(self, announce: Announce, corrupt: int = 0, stall: int = 0, drop_ready: bool = False) -> None:
        super().__init__(announce, FaultyTransferClient(corrupt))
        self.stalls = stall
        self.drop_ready = drop_ready

    async def push(self, ready: KVReady, address: str, layout: KVLayout, blocks: memoryview,
                   span: Span) -> TransferStats:
        if self.stalls > 0:
            self.stalls -= 1
            log.warning("request %s: fault injection: kv.ready announced, the KV push stalls", ready.request_id)
            await self._announce(ready, span)
            await asyncio.sleep(STALL_S)
        return await super().push(ready, address, layout, blocks, span)

    async def announce(self, ready: KVReady, span: Span | None) -> None:
        if self.drop_ready and ready.ok:
            log.warning("request %s: fault injection: kv.ready dropped", ready.request_id)
            if span is not None:
                span.add_event("kv.ready dropped (fault injection)")
            return
        await super().announce(ready, span)


class FaultyTransferClient(TransferClient):
    """Flips one byte of the first ``corrupt`` payloads after they were checksummed, i.e. on the wire."""

    def __init__(self, corrupt: int) -> None:
        super().__init__()
        self.corrupt = corrupt

    def _stage(self, backend: Backend, payload: memoryview, local_host: str) -> Staged:
        if self.corrupt > 0:
            self.corrupt -= 1
            raw = bytearray(payload)
            raw[len(raw) // 2] ^= 0x5A
            payload = memoryview(raw)
        return super()._stage(backend, payload, local_host)


def make_handoff(cfg: object, announce: Announce) -> Handoff:
    """The hand-off a worker with settings ``cfg`` uses: faulty only when one of its ``fault_*`` settings asks."""
    corrupt, stall = getattr(cfg, "fault_corrupt_pushes", 0), getattr(cfg, "fault_stall_pushes", 0)
    drop = getattr(cfg, "fault_drop_kv_ready", False)
    if corrupt or stall or drop:
        log.warning("fault injection on: corrupt %d pushes, stall %d, drop kv.ready %s", corrupt, stall, drop)
        return FaultyHandoff(announce, corrupt, stall, drop)
    return Handoff(announce)
