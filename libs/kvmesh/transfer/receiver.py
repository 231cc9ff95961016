"""The receiving side of one PD hand-off, one :class:`Receiver` per Decode call:

1. **grant**: the push's capability (a ``Grant`` of the transfer server: the request's hand-off parts, the blocks
   the push may hold, the kv wait as its deadline), handed to the caller at once (``send_grant``: decode puts it in
   the call's initial metadata, the router relays it to prefill), with the blocks held here (prefill pushes only
   past them), before any engine command, so prefill starts as early as it would without one;
2. **pin**: those held blocks kept until the import (``KVHolder.pin``);
3. **reserve**: blocks set aside for the push to land in (:class:`Reservation`; a part that arrives before is
   buffered);
4. **ready**: the request's ``kv.ready`` (authentic: MACed under the grant's token, naming a transfer of this
   request), matched on the :class:`KVReadyBoard`; its parts taken and verified against this prompt's block keys
   (``Assembly``); the grant revoked;
5. **result**: an :class:`Intake`: the KV to import (``ImportedKV``, in this engine's layout, cast when pushed in
   a dtype it takes), or why the prompt is recomputed. A push that cannot be used is dropped whole, never
   half-consumed.

:meth:`Receiver.close` always runs once the request's stream ended (after the request was added its sequence holds
its own references): the grant revoked, the reservation released unless the import adopted it, the pin dropped.

The receiver moves KV; it computes nothing. What it needs of the engine that imports the KV is :class:`KVHolder`
(a part of ``kvmesh.engines.Engine``: this layer sits below the engines), and a cast for pushes in another dtype
(``convert``); what it counts goes to :class:`ReceiveCounters`, what it would trace to :attr:`Receiver.attributes`."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvmesh.contracts.engine import EngineRequest, ImportedKV
from kvmesh.contracts.ids import NamespaceSeed, handoff_prefix
from kvmesh.contracts.keys import block_keys
from kvmesh.contracts.layout import KVLayout, layout_mismatch
from kvmesh.contracts.messages import KVReady
from kvmesh.transfer.assembly import Assembly
from kvmesh.transfer.grants import Grant
from kvmesh.transfer.landing import Landing
from kvmesh.transfer.server import ReceivedBlocks, TransferServer

EARLY_TTL_S = 60.0
EARLY_PER_REQUEST = 4  # announcements kept for one request id before its Decode call waits
_calls = itertools.count()


# ---- what the receiver needs from around it ------------------------------------------------------------------------
class Reserved(Protocol):
    """Blocks an engine set aside for a push (``kvmesh.engines.Reserved``)."""

    @property
    def block_ids(self) -> tuple[int, ...]: ...
    @property
    def landing(self) -> Landing | None: ...


class KVHolder(Protocol):
    """The engine's side of a hand-off (``kvmesh.engines.Engine`` has these; see its docstrings)."""

    def holds(self, namespace: NamespaceSeed, tokens: Sequence[int], max_blocks: int) -> int: ...
    async def pin(self, lease: str, namespace: NamespaceSeed, tokens: Sequence[int], max_blocks: int) -> int: ...
    def unpin(self, lease: str) -> None: ...
    async def reserve(self, lease: str, request: EngineRequest, first_block: int) -> Reserved | None: ...
    def release(self, lease: str) -> None: ...


@dataclass(frozen=True)
class ReceiveCounters:
    """Where a receiver counts: bytes taken from the transfer server (``received``), of them landed in place
    (``in_place``), and ``kv.ready`` announcements dropped, by why (``ready_dropped``)."""

    received: Callable[[int], None] = lambda n: None
    in_place: Callable[[int], None] = lambda n: None
    ready_dropped: Callable[[str], None] = lambda why: None


Convert = Callable[[ImportedKV, KVLayout], ImportedKV]  # a push in another dtype, cast to the engine's (ValueError)
SendGrant = Callable[[Grant, int], Awaitable[None]]    # the grant and the blocks held here, to whoever relays them


@dataclass(frozen=True)
class Intake:
    """What became of a request's push: the KV to import, or why the prompt is recomputed (``fallback``);
    when ``kv.ready`` was received (epoch ns, 0 = never); and what the import's span reports about it."""

    imported: ImportedKV | None = None
    fallback: str = ""
    received_ns: int = 0
    attributes: dict[str, Any] = field(default_factory=dict)


# ---- kv.ready ------------------------------------------------------------------------------------------------------
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


def forged(ready: KVReady, request_id: str, token: str) -> str:
    """Why ``ready`` is not the request's own announcement ("" when it is): not MACed under its push capability
    ``token`` (which only the router and the chosen prefill hold), or naming another request's transfer."""
    if not ready.verify(token):
        return "unauthenticated"
    if ready.transfer_id and not ready.transfer_id.startswith(handoff_prefix(request_id)):
        return "transfer_id"
    return ""


# ---- the blocks a push lands in ------------------------------------------------------------------------------------
class Reservation:
    """Blocks ``first_block ..`` of ``request``'s prompt, reserved for its push so it lands straight in the
    engine's KV: no receive buffer, no copy at import (the engine adopts the blocks as they are).

    :meth:`acquire`: the engine sets the blocks aside and lends their memory as a ``Landing``, which the transfer
    server gets under the request's hand-off prefix. :meth:`hand_over`, once every (block, layer) is verified: the
    landing is revoked (no more writes) and the import adopts the blocks. :meth:`release`, always, as the call
    ends: the landing is revoked first, on the event loop, where every write into it happens, so no byte reaches
    those blocks after it returns; then the engine frees them (nothing when the import adopted them). A reserve
    still on its way to the engine when the call was cancelled is released the same way."""

    def __init__(self, server: TransferServer, engine: KVHolder, request: EngineRequest, first_block: int,
                 block_size: int) -> None:
        self.server, self.engine, self.request, self.first_block = server, engine, request, first_block
        self.request_id = request.request_id
        self.lease = f"{self.request_id}#reserve{next(_calls)}"  # this call's own, even if the request id repeats
        self.num_blocks = -(-len(request.prompt) // block_size) - first_block
        self.block_ids: list[int] = []
        self.landing: Landing | None = None
        self._asked = False

    async def acquire(self) -> bool:
        """Reserve the blocks and open the landing; False (the push is buffered) when the engine's memory cannot
        be written from outside or it has no room."""
        if self.num_blocks <= 0:
            return False
        self._asked = True
        reserved = await self.engine.reserve(self.lease, self.request, self.first_block)
        if reserved is None or reserved.landing is None:
            return False
        self.block_ids = list(reserved.block_ids)
        self.landing = reserved.landing
        self.server.land(handoff_prefix(self.request_id), self.landing)
        return True

    def hand_over(self) -> None:
        """Nothing more lands in the blocks: the engine may adopt them."""
        self._unland()

    def release(self) -> None:
        """Stop every write into the blocks, then free them (unless adopted). Idempotent."""
        self._unland()
        if self._asked:
            self.engine.release(self.lease)
            self._asked = False

    def _unland(self) -> None:
        if self.landing is not None:
            self.server.unland(handoff_prefix(self.request_id), self.landing)


# ---- the receiver ----------------------------------------------------------------------------------------------------
class Receiver:
    """Steps 1 to 5 of the module docstring for ``request``'s push, into ``engine`` (whose KV is ``layout``; it
    also takes pushes in the ``convertible`` layouts, cast by ``convert``)."""

    def __init__(self, server: TransferServer, board: KVReadyBoard, engine: KVHolder, request: EngineRequest,
                 namespace: NamespaceSeed, layout: KVLayout, *, convertible: frozenset[KVLayout] = frozenset(),
                 convert: Convert | None = None, in_place: bool = True,
                 counters: ReceiveCounters = ReceiveCounters()) -> None:
        self.server, self.board, self.engine, self.request = server, board, engine, request
        self.namespace, self.layout, self.convertible, self.convert = namespace, layout, convertible, convert
        self.in_place, self.counters = in_place, counters
        self.request_id, self.prompt = request.request_id, list(request.prompt)
        self.grant: Grant | None = None
        self.reservation: Reservation | None = None
        self.attributes: dict[str, Any] = {}  # held, pinned and reserved blocks, for the caller's trace
        self._pin_asked = False  # from then on the lease may be held, even if the call is cancelled

    async def receive(self, wait_s: float, send_grant: SendGrant) -> Intake:
        """Grant, pin, reserve, then wait up to ``wait_s`` in all for the push. :class:`NothingToWaitFor` (an empty
        prompt, a wait of 0) before anything was granted."""
        deadline = time.monotonic() + wait_s
        # what this instance holds of the prompt now, not what the index says (it lags when turns come back to
        # back): prefill pushes from the first block decode lacks, at least the last token's
        first = self.engine.holds(self.namespace, self.prompt, (len(self.prompt) - 1) // self.layout.block_size)
        end = -(-len(self.prompt) // self.layout.block_size)
        try:
            self.grant = self.server.grant(handoff_prefix(self.request_id), first, end, wait_s)
        except ValueError as e:
            raise NothingToWaitFor(f"nothing to wait for: {e}") from None
        await send_grant(self.grant, first)
        self.attributes["kvmesh.held_blocks"] = first
        pinned = await self._pin(first)
        if pinned >= first:  # else the push cannot be used anyway (the intake says why)
            self.reservation = Reservation(self.server, self.engine, self.request, first, self.layout.block_size)
            if self.in_place:  # else the push is buffered, and copied in at import
                await self.reservation.acquire()
            self.attributes["kvmesh.reserved_blocks"] = len(self.reservation.block_ids)
        intake = await self._intake(deadline, pinned, self.grant.token)
        self._revoke()  # taken, or given up on: nothing more is pushed
        if intake.imported is None and self.reservation is not None:  # recomputed: its blocks are needed now
            self.reservation.release()
        return intake

    def close(self) -> None:
        """Revoke, release, unpin (idempotent)."""
        self._revoke()
        if self.reservation is not None:  # nothing lands any more; its blocks freed unless the import adopted them
            self.reservation.release()
        if self._pin_asked:  # a call cancelled while it waited gets no count back, but the engine may have pinned
            self.engine.unpin(self.request_id)
            self._pin_asked = False

    async def _pin(self, first: int) -> int:
        """The blocks held here, kept until imported (prefill pushes only past them)."""
        if not first:
            return 0
        self._pin_asked = True
        pinned = await self.engine.pin(self.request_id, self.namespace, self.prompt, first)
        self.attributes["kvmesh.pinned_blocks"] = pinned
        return pinned

    def _revoke(self) -> None:
        if self.grant is not None:
            self.server.revoke(handoff_prefix(self.request_id), self.grant)
        self.grant = None

    # ---- step 4: the push -------------------------------------------------------------------------------------------
    async def _intake(self, deadline: float, pinned: int, token: str) -> Intake:
        """Wait for the request's ``kv.ready``, take its parts and verify them against this prompt's block keys
        (``namespace``: the request's, under its salt and its adapter's ``name@generation``, so KV pushed under
        another generation never matches). ``pinned``: the leading blocks of the prompt held here; a push that
        starts past them (a delta) is usable only when they cover the gap. Parts landed in the reservation are
        handed to the import, which adopts those blocks."""
        received_ns = 0
        try:
            ready, received_ns = await self._ready(max(0.0, deadline - time.monotonic()), token)
            t = time.monotonic()
            parts = await self._take(ready, deadline)
            assembly = Assembly(self.layout, ready.first_block, len(self.prompt),
                                block_keys(self.namespace, self.prompt, self.layout.block_size))
            imported = self._imported(ready, parts, assembly, pinned)
        except _Unusable as e:
            self.server.discard_prefix(handoff_prefix(self.request_id))
            return Intake(None, str(e), e.received_ns or received_ns)
        self.counters.in_place(assembly.landed_bytes)
        reservation = self.reservation
        return Intake(imported, "", received_ns, {
            "kvmesh.in_place": assembly.landed_bytes > 0, "kvmesh.landed_bytes": assembly.landed_bytes,
            "kvmesh.reserved_blocks": len(reservation.block_ids) if reservation is not None else 0,
            "kvmesh.blocks": assembly.end - ready.first_block, "kvmesh.bytes": sum(got.nbytes for got in parts),
            "kvmesh.first_block": ready.first_block, "kvmesh.parts": len(parts),
            "kvmesh.converted": ready.layout != self.layout,
            "kvmesh.take_ms": round((time.monotonic() - t) * 1e3, 3),
            "kvmesh.receive_ms": round(sum(got.seconds for got in parts) * 1e3, 3),
            "kvmesh.prefill_instance": ready.prefill_instance})

    async def _ready(self, timeout_s: float, token: str) -> tuple[KVReady, int]:
        """The request's authentic ``kv.ready`` (and when it was received), if it announces a push this engine can
        use; a forged one is counted, dropped, and waited past."""
        def accept(ready: KVReady) -> bool:
            why = forged(ready, self.request_id, token)
            if why:
                self.counters.ready_dropped(why)
            return not why

        try:
            ready, received_ns = await self.board.wait(self.request_id, timeout_s, accept)
        except TimeoutError:  # parts a prefill pushed before it died or stalled are dropped, never used
            raise _Unusable(f"kv.ready not received within {timeout_s:g}s") from None
        if not ready.ok:
            raise _Unusable(f"prefill {ready.prefill_instance}: {ready.error}", received_ns)
        diff = "none given" if ready.layout is None else layout_mismatch(self.layout, ready.layout)
        if diff is not None and ready.layout not in self.convertible:
            raise _Unusable(f"pushed KV's layout does not match this engine's: {diff}", received_ns)
        return ready, received_ns

    async def _take(self, ready: KVReady, deadline: float) -> list[ReceivedBlocks]:
        """The announced parts, pushed in order while prefill computed (most are here already)."""
        parts = []
        for part in ready.part_ids():
            try:
                parts.append(await self.server.take(part, max(0.1, deadline - time.monotonic())))
            except TimeoutError:
                raise _Unusable("kv.ready arrived but its blocks did not") from None
            except Exception as e:  # noqa: BLE001 - TransferRejected and friends: never consume, recompute
                raise _Unusable(f"pushed KV rejected: {e}") from None
        self.counters.received(sum(got.nbytes for got in parts))
        return parts

    def _imported(self, ready: KVReady, parts: list[ReceivedBlocks], assembly: Assembly,
                  pinned: int) -> ImportedKV:
        """The parts verified and assembled into the KV to import, in this engine's layout."""
        first, reservation = ready.first_block, self.reservation
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
        imported = ImportedKV(ready.layout or self.layout, assembly.prompt_tokens, ready.first_token, first,
                              tuple(assembly.parts), lease, ready.first_logprobs)
        if imported.layout == self.layout:
            return imported
        if self.convert is None:
            raise _Unusable(f"pushed KV is {imported.layout.dtype}, this engine casts none")
        try:  # pushed in a dtype this instance names (kv_convert_from): cast to its own
            return self.convert(imported, self.layout)
        except ValueError as e:
            raise _Unusable(f"pushed KV could not be converted: {e}") from None


class NothingToWaitFor(ValueError):
    """A push that cannot be granted (an empty prompt, a wait of 0): the request is invalid."""


class _Unusable(Exception):
    """Why a push cannot be used (the prompt is recomputed), with when its ``kv.ready`` was received."""

    def __init__(self, why: str, received_ns: int = 0) -> None:
        super().__init__(why)
        self.received_ns = received_ns
