"""KV intake of a decode instance: the ``kv.ready`` board (announcements matched with the Decode calls waiting
for them), and taking a request's pushed KV from the transfer server, verified against this prompt's block keys.

Anything that cannot be used is a reason to recompute, never a consumed block: the caller falls back."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.bus.trace_headers import trace_context
from kvmesh.contracts.engine import ImportedKV
from kvmesh.contracts.ids import NamespaceSeed, handoff_prefix
from kvmesh.contracts.keys import block_keys
from kvmesh.contracts.layout import layout_mismatch
from kvmesh.contracts.messages import KVReady, Message
from kvmesh.engines.convert import convert_import
from kvmesh.instance.host import EngineHost
from kvmesh.telemetry import tracing
from kvmesh.transfer import TransferServer
from kvmesh.transfer.server import ReceivedBlocks
from opentelemetry.trace import SpanKind

from services.decode.assembly import Assembly
from services.decode.reservation import Reservation

EARLY_TTL_S = 60.0
EARLY_PER_REQUEST = 4  # announcements kept for one request id before its Decode call waits
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Intake:
    """What became of a request's push: the KV to import, or why the prompt is recomputed (``fallback``);
    when ``kv.ready`` was received (epoch ns, 0 = never); and what ``decode.load`` reports about it."""

    imported: ImportedKV | None = None
    fallback: str = ""
    received_ns: int = 0
    attributes: dict[str, Any] = field(default_factory=dict)
    pool_fetch: str = ""  # a local prefill's fetch from the pool: its outcome (``EngineHost.warm_from_pool``)


def _fallback(why: str, received_ns: int = 0) -> Intake:
    return Intake(None, why, received_ns)


class KVReadyBoard:
    """Matches ``kv.ready`` announcements with the Decode calls waiting for them (either may come first).
    Each announcement travels with the time it was received (epoch ns). A waiter accepts only what its
    ``accept`` says (the MAC under the request's push capability): anything else is dropped and it waits on."""

    def __init__(self) -> None:
        self._waiting: dict[str, asyncio.Future[tuple[KVReady, int]]] = {}
        self._early: dict[str, tuple[float, list[tuple[KVReady, int]]]] = {}

    def post(self, ready: KVReady, received_ns: int | None = None) -> None:
        received_ns = time.time_ns() if received_ns is None else received_ns
        fut = self._waiting.pop(ready.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result((ready, received_ns))
            return
        now = time.monotonic()
        self._early = {k: v for k, v in self._early.items() if now - v[0] < EARLY_TTL_S}
        early = self._early.setdefault(ready.request_id, (now, []))[1]
        if len(early) < EARLY_PER_REQUEST:  # a flood of forgeries for one id cannot grow it
            early.append((ready, received_ns))

    async def wait(self, request_id: str, timeout_s: float,
                   accept: Callable[[KVReady], bool] = lambda _: True) -> tuple[KVReady, int]:
        deadline = time.monotonic() + timeout_s
        for ready, received_ns in self._early.pop(request_id, (0.0, []))[1]:
            if accept(ready):
                return ready, received_ns
        while True:
            fut: asyncio.Future[tuple[KVReady, int]] = asyncio.get_running_loop().create_future()
            self._waiting[request_id] = fut
            try:
                got = await asyncio.wait_for(fut, max(0.0, deadline - time.monotonic()))
            finally:
                self._waiting.pop(request_id, None)
            if accept(got[0]):
                return got


class KVIntake:
    """The ``kv.ready`` subscription of one decode instance and the receive of what it announces."""

    def __init__(self, host: EngineHost) -> None:
        self.w = host
        self.board = KVReadyBoard()

    async def on_kv_ready(self, msg: Message, headers: dict[str, str]) -> None:
        if not isinstance(msg, KVReady):  # only prefill's kv.ready goes to this subject
            return
        received = time.time_ns()
        try:
            sent = int(headers.get(tracing.SENT_HEADER, received))
        except ValueError:
            sent = received
        tracing.record("kv.ready", trace_context(headers), min(sent, received), received,
                       {tracing.REQUEST_ID: msg.request_id, tracing.MODEL: self.w.model_name,
                        "kvmesh.instance": self.w.instance_id,
                        "kvmesh.prefill_instance": msg.prefill_instance, "kvmesh.ok": msg.ok,
                        "kvmesh.blocks": len(msg.block_keys)}, SpanKind.CONSUMER)
        self.board.post(msg, received)

    def authentic(self, request_id: str, token: str) -> Callable[[KVReady], bool]:
        """Whether a ``kv.ready`` is the request's: MACed under its push capability ``token`` (which only the
        router and the chosen prefill hold) and naming a transfer of this request; what is not is counted and
        dropped."""
        def accept(ready: KVReady) -> bool:
            why = ("unauthenticated" if not ready.verify(token) else
                   "transfer_id" if ready.transfer_id and not ready.transfer_id.startswith(handoff_prefix(request_id))
                   else "")
            if why:
                self.w.metrics.kv_ready_dropped.labels(why).inc()
                log.warning("request %s: kv.ready from %r dropped (%s)", request_id, ready.prefill_instance, why)
            return not why
        return accept

    async def receive(self, request_id: str, prompt: list[int], namespace: NamespaceSeed, timeout_s: float,
                      pinned: int = 0, reservation: Reservation | None = None, token: str = "") -> Intake:
        """Wait for the request's ``kv.ready``, take its parts and verify them against this prompt's block keys
        (``namespace``: the request's, under its salt and its adapter's ``name@generation``, so KV pushed under
        another generation never matches). ``pinned``: the leading blocks of the prompt this instance holds for
        the request; a push that starts past them (a delta) is usable only when they cover the gap.
        ``reservation``: the blocks reserved for the push (parts landed in them in place); once the push
        verified, they are handed to the import, which adopts them (the caller releases the reservation as the
        call ends, whatever happened). A push that cannot be used is dropped whole (its parts discarded)."""
        deadline = time.monotonic() + timeout_s
        received_ns = 0
        try:
            ready, received_ns = await self._ready(request_id, timeout_s, token)
            t = time.monotonic()
            parts = await self._take(ready, deadline)
            assembly = Assembly(self.w.layout, ready.first_block, len(prompt),
                                block_keys(namespace, prompt, self.w.layout.block_size))
            imported = self._imported(ready, parts, assembly, pinned, reservation)
        except _Unusable as e:
            self._transfer().discard_prefix(handoff_prefix(request_id))
            return _fallback(str(e), e.received_ns or received_ns)
        self.w.metrics.transfer_bytes.labels("receive_in_place").inc(assembly.landed_bytes)
        return Intake(imported, "", received_ns, {
            "kvmesh.in_place": assembly.landed_bytes > 0, "kvmesh.landed_bytes": assembly.landed_bytes,
            "kvmesh.reserved_blocks": len(reservation.block_ids) if reservation is not None else 0,
            "kvmesh.blocks": assembly.end - ready.first_block, "kvmesh.bytes": sum(got.nbytes for got in parts),
            "kvmesh.first_block": ready.first_block, "kvmesh.parts": len(parts),
            "kvmesh.converted": ready.layout != self.w.layout,
            "kvmesh.take_ms": round((time.monotonic() - t) * 1e3, 3),
            "kvmesh.receive_ms": round(sum(got.seconds for got in parts) * 1e3, 3),
            "kvmesh.prefill_instance": ready.prefill_instance})

    async def _ready(self, request_id: str, timeout_s: float, token: str) -> tuple[KVReady, int]:
        """The request's authentic ``kv.ready`` (and when it was received), if it announces a push this engine can
        use."""
        try:
            ready, received_ns = await self.board.wait(request_id, timeout_s, self.authentic(request_id, token))
        except TimeoutError:  # parts a prefill pushed before it died or stalled are dropped, never used
            raise _Unusable(f"kv.ready not received within {timeout_s:g}s") from None
        if not ready.ok:
            raise _Unusable(f"prefill {ready.prefill_instance}: {ready.error}", received_ns)
        diff = "none given" if ready.layout is None else layout_mismatch(self.w.layout, ready.layout)
        if diff is not None and ready.layout not in self.w.convertible:
            raise _Unusable(f"pushed KV's layout does not match this engine's: {diff}", received_ns)
        return ready, received_ns

    async def _take(self, ready: KVReady, deadline: float) -> list[ReceivedBlocks]:
        """The announced parts, pushed in order while prefill computed (most are here already)."""
        parts = []
        for part in ready.part_ids():
            try:
                parts.append(await self._transfer().take(part, max(0.1, deadline - time.monotonic())))
            except TimeoutError:
                raise _Unusable("kv.ready arrived but its blocks did not") from None
            except Exception as e:  # noqa: BLE001 - TransferRejected and friends: never consume, recompute
                raise _Unusable(f"pushed KV rejected: {e}") from None
        self.w.metrics.transfer_bytes.labels("receive").inc(sum(got.nbytes for got in parts))
        return parts

    def _imported(self, ready: KVReady, parts: list[ReceivedBlocks], assembly: Assembly, pinned: int,
                  reservation: Reservation | None) -> ImportedKV:
        """The parts verified and assembled into the KV to import, in this engine's layout."""
        first = ready.first_block
        try:
            for got in parts:
                assembly.add(got)
        except ValueError as e:
            raise _Unusable(f"pushed KV does not match this prompt: {e}") from None
        if gap := assembly.missing():
            raise _Unusable(f"pushed KV did not all arrive: {gap}")
        if pinned < first:
            raise _Unusable(f"the push starts at block {first} but only {pinned} leading blocks are held here "
                            "(evicted before the request arrived)")
        lease = None
        if reservation is not None and reservation.block_ids:
            if reservation.first_block != first:
                raise _Unusable(f"the push starts at block {first}, decode reserved blocks from "
                                f"{reservation.first_block}")
            reservation.hand_over()  # no byte lands in those blocks any more: the import adopts them
            lease = reservation.lease
        elif assembly.landed_bytes:  # cannot happen: a landing exists only for a reservation; never consume
            raise _Unusable("parts landed in place, but no reservation holds them")
        imported = ImportedKV(ready.layout or self.w.layout, assembly.prompt_tokens, ready.first_token, first,
                              tuple(assembly.parts), lease, ready.first_logprobs)
        if imported.layout == self.w.layout:
            return imported
        try:  # pushed in a dtype this instance names (kv_convert_from): cast to its own
            return convert_import(imported, self.w.layout)
        except ValueError as e:
            raise _Unusable(f"pushed KV could not be converted: {e}") from None

    def _transfer(self) -> TransferServer:
        assert self.w.transfer_server is not None  # RolePlugin(receives_kv=True): the host started one
        return self.w.transfer_server


class _Unusable(Exception):
    """Why a push cannot be used (the prompt is recomputed), with when its ``kv.ready`` was received."""

    def __init__(self, why: str, received_ns: int = 0) -> None:
        super().__init__(why)
        self.received_ns = received_ns
