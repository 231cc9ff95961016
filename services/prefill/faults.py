"""Fault injection for the fault tests (``[instance]``'s test-only ``fault_*`` settings, read as one
``kvmesh.settings.Faults``): what a broken network, a stuck or a dying peer does to a hand-off, produced on purpose
so the tests can show decode never consumes it and never waits forever. ``make_handoff`` gives the plain
``Handoff`` unless a fault is asked for."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Sequence

from kvmesh.contracts.ids import BlockKey, TransferId
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.messages import KVReady
from kvmesh.settings import Faults
from kvmesh.transfer import ClientTLS, TransferClient
from kvmesh.transfer.backends import Backend, Staged
from kvmesh.transfer.client import TransferStats
from opentelemetry.trace import Span

from services.prefill.handoff import Announce, Handoff, PushStream, Target

log = logging.getLogger(__name__)

STALL_S = 60.0  # longer than any kv_timeout_s a test uses: the push is as good as lost


class FaultyHandoff(Handoff):
    """The first ``corrupt`` parts get a byte flipped on the wire; the first ``stall`` requests announce their
    ``kv.ready`` but their blocks never come (the call ends after ``STALL_S``); with ``drop_ready`` no
    successful push is ever announced; with ``hang_after`` > 0 a request's push stops for good after that many
    parts (what decode sees of a prefill that dies half-way; the fault test kills it there); the first
    ``forge`` requests push under a token decode never issued (what an impostor on the network would send:
    decode refuses every part)."""

    def __init__(self, announce: Announce, corrupt: int = 0, stall: int = 0, drop_ready: bool = False,
                 hang_after: int = 0, forge: int = 0, transfer_tls: ClientTLS | None = None) -> None:
        super().__init__(announce, FaultyTransferClient(corrupt, transfer_tls))
        self.stalls = stall
        self.drop_ready = drop_ready
        self.hang_after = hang_after
        self.forgeries = forge
        self._stalled: set[str] = set()

    def open(self, transfer_id: TransferId, target: Target, layout: KVLayout) -> PushStream:
        if self.forgeries > 0:
            self.forgeries -= 1
            log.warning("transfer %s: fault injection: pushed under a forged token", transfer_id)
            target = target._replace(token=secrets.token_urlsafe(24))  # never issued
        if self.stalls > 0:
            self.stalls -= 1
            self._stalled.add(transfer_id)
            return _WithheldStream(self, transfer_id, target, layout)
        if self.hang_after > 0:
            return _HangingStream(self, transfer_id, target, layout, self.hang_after)
        return super().open(transfer_id, target, layout)

    async def announce(self, ready: KVReady, span: Span | None) -> None:
        if self.drop_ready and ready.ok:
            log.warning("request %s: fault injection: kv.ready dropped", ready.request_id)
            if span is not None:
                span.add_event("kv.ready dropped (fault injection)")
            return
        await super().announce(ready, span)
        if ready.transfer_id in self._stalled:
            self._stalled.discard(ready.transfer_id)
            log.warning("request %s: fault injection: kv.ready announced, the KV push stalls", ready.request_id)
            await asyncio.sleep(STALL_S)


class _WithheldStream(PushStream):
    """Sends nothing (``FaultyHandoff``'s stall)."""

    async def _send(self, transfer_id: TransferId, blocks: memoryview, keys: Sequence[BlockKey],
                    num_tokens: int, first_block: int, layers: tuple[int, int] | None) -> TransferStats:
        return TransferStats(0, 0.0, 0.0)


class _HangingStream(PushStream):
    """Sends the first ``hang_after`` parts, then never another (``FaultyHandoff``'s half-way push)."""

    def __init__(self, handoff: Handoff, transfer_id: TransferId, target: Target, layout: KVLayout,
                 hang_after: int) -> None:
        super().__init__(handoff, transfer_id, target, layout)
        self.hang_after = hang_after

    async def _send(self, transfer_id: TransferId, blocks: memoryview, keys: Sequence[BlockKey],
                    num_tokens: int, first_block: int, layers: tuple[int, int] | None) -> TransferStats:
        if len(self.done) >= self.hang_after:
            log.warning("transfer %s: fault injection: the push hangs after %d parts", self.transfer_id,
                        len(self.done))
            await asyncio.Event().wait()
        return await super()._send(transfer_id, blocks, keys, num_tokens, first_block, layers)


class FaultyTransferClient(TransferClient):
    """Flips one byte of the first ``corrupt`` payloads after they were checksummed, i.e. on the wire."""

    def __init__(self, corrupt: int, transfer_tls: ClientTLS | None = None) -> None:
        super().__init__(tls=transfer_tls)
        self.corrupt = corrupt

    def _stage(self, backend: Backend, payload: memoryview, local_host: str) -> Staged:
        if self.corrupt > 0:
            self.corrupt -= 1
            raw = bytearray(payload)
            raw[len(raw) // 2] ^= 0x5A
            payload = memoryview(raw)
        return super()._stage(backend, payload, local_host)


def make_handoff(faults: Faults, announce: Announce, transfer_tls: ClientTLS | None = None) -> Handoff:
    """The hand-off an instance uses: faulty only when ``faults`` (its test-only settings) asks for any;
    ``transfer_tls``: TLS on its transfer connections (``kvmesh.tls.transfer_client_tls``)."""
    if not faults.on:
        return Handoff(announce, TransferClient(tls=transfer_tls))
    log.warning("fault injection on: corrupt %d pushes, stall %d, drop kv.ready %s, hang after %d parts, "
                "forge %d tokens", faults.corrupt_pushes, faults.stall_pushes, faults.drop_kv_ready,
                faults.hang_after_parts, faults.forge_tokens)
    return FaultyHandoff(announce, faults.corrupt_pushes, faults.stall_pushes, faults.drop_kv_ready,
                         faults.hang_after_parts, faults.forge_tokens, transfer_tls)
