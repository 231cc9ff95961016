"""The receiving end (decode side): accept pushed transfers, verify them, hold them until taken.

Every transfer is checked before anyone can take it: its layout must equal the expected layout in every
field, every block must match its xxh3_64 checksum. (A server started with ``expected_layout=None`` takes any
well-formed layout and leaves that check to the taker, who reads ``ReceivedBlocks.layout``: cachesvc, which
stores every layout.) A refused transfer is recorded as a rejection (``take`` raises
:class:`TransferRejected`), never as data. Memory is bounded twice: verified transfers nobody takes are
dropped after ``ttl`` seconds, and a transfer that would push the bytes held (in flight + waiting) past
``max_buffered_bytes`` is refused before its payload is read.

In place: a receiver that reserved memory for a request's parts (decode: blocks of its KV pool) hands the server
a :class:`~kvmesh.transfer.landing.Landing` under the parts' transfer-id prefix (:meth:`TransferServer.land`);
those parts are received straight into it (tcp, shm), verified where they landed, and taken as
``ReceivedBlocks`` with ``landed`` set and no bytes of their own. :meth:`TransferServer.unland` (or
``discard_prefix``) revokes it: from then on nothing is written into that memory (see ``landing``). Without a
landing, or over a backend that cannot scatter (mooncake), a part is buffered as before.

Concurrency: all state lives on the event loop that called :meth:`TransferServer.start`; one task per
connection, each connection carrying one transfer at a time.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Self

import numpy as np

from kvmesh.contracts.ids import BlockKey, TransferBackend, TransferId
from kvmesh.contracts.layout import KVLayout, layout_mismatch
from kvmesh.transfer.backends import Backend, ScatterBackend, TcpBackend
from kvmesh.transfer.errors import TransferRejected
from kvmesh.transfer.header import (
    MAX_HEADER_BYTES,
    TransferHeader,
    corrupt_blocks,
    corrupt_landed_blocks,
    decode_header,
)
from kvmesh.transfer.landing import Landing
from kvmesh.transfer.registry import get_backend
from kvmesh.transfer.wire import (
    MAGIC,
    PREFIX,
    Address,
    Reply,
    configure,
    drain,
    encode_reply,
    recv_bytes,
    recv_into,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)  # eq would compare buffers
class ReceivedBlocks:
    """A verified transfer. ``data`` holds its ``num_blocks`` blocks back to back (flat, writable, owned by
    the taker; the engine views it as a tensor with ``kv_cache.blocks_from_bytes``); ``block_keys`` are the
    keys of its full blocks (a partial last block has none). ``landed``: its bytes were received in place (in
    the landing its transfer id fell under) and verified there; ``data`` is empty."""

    transfer_id: TransferId
    layout: KVLayout
    block_keys: tuple[BlockKey, ...]
    num_tokens: int
    data: memoryview
    nbytes: int
    seconds: float  # header arrival -> verified
    checksums: tuple[int, ...] = ()  # each block's xxh3_64, which its bytes were verified against
    layers: tuple[int, int] | None = None  # each block's slice of these layers (None: whole blocks)
    first_block: int = 0  # where its first block sits in the sender's sequence (a hand-off's part)
    landed: bool = False

    @property
    def num_blocks(self) -> int:
        return self.nbytes // self.layout.layers_nbytes(self.layers)


@dataclass
class _Slot:
    """One transfer id: waited for, delivered, or refused."""

    ready: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: ReceivedBlocks | TransferRejected | None = None
    nbytes: int = 0  # counted in the server's buffered bytes while held
    expiry: asyncio.TimerHandle | None = None
    waiters: int = 0


class TransferServer:
    def __init__(self, sock: socket.socket, expected_layout: KVLayout | None, backend: Backend, *, ttl: float,
                 max_buffered_bytes: int, io_timeout: float) -> None:
        self.expected_layout = expected_layout
        self.ttl = ttl
        self.max_buffered_bytes = max_buffered_bytes
        self.io_timeout = io_timeout
        self._sock = sock
        self._backends: dict[str, Backend] = {TransferBackend.TCP: TcpBackend(), backend.name: backend}
        host, port = sock.getsockname()[:2]
        host = socket.gethostname() if host in ("0.0.0.0", "::") else host
        self.address = str(Address(backend.name, host, port))
        self._slots: dict[str, _Slot] = {}
        self._in_flight: set[str] = set()
        self._discarded: dict[str, asyncio.TimerHandle] = {}
        self._discarded_prefixes: dict[str, asyncio.TimerHandle] = {}
        self._landings: dict[str, Landing] = {}  # transfer-id prefix -> where those parts land in place
        self._buffered = 0
        self._connections: set[asyncio.Task[None]] = set()
        self._accepting = asyncio.create_task(self._accept())

    @classmethod
    async def start(cls, expected_layout: KVLayout | None, host: str = "127.0.0.1", port: int = 0,
                    backend: TransferBackend | str = TransferBackend.TCP, *, ttl: float = 60.0, max_buffered_bytes: int = 1 << 30,
                    io_timeout: float = 30.0) -> TransferServer:
        """Listen on ``host:port`` (0 = any free port). ``backend`` is what :attr:`address` advertises; plain
        ``tcp`` is always accepted too. ``expected_layout`` None: accept any layout (the taker checks it).
        Raises RuntimeError when the backend cannot run here (mooncake)."""
        chosen = get_backend(backend)
        if backend == TransferBackend.MOONCAKE:
            from kvmesh.transfer.mooncake_backend import engine

            engine(host)
        sock = socket.create_server((host, port))
        sock.setblocking(False)
        return cls(sock, expected_layout, chosen, ttl=ttl, max_buffered_bytes=max_buffered_bytes,
                   io_timeout=io_timeout)

    @property
    def buffered_bytes(self) -> int:
        """Bytes held: transfers being received plus verified ones not yet taken."""
        return self._buffered

    async def take(self, transfer_id: TransferId | str, timeout: float) -> ReceivedBlocks:
        """Wait until ``transfer_id`` has arrived and been verified, and hand it over (once).
        Raises asyncio.TimeoutError, or TransferRejected when it arrived but was refused."""
        slot = self._slots.setdefault(transfer_id, _Slot())
        slot.waiters += 1
        try:
            async with asyncio.timeout(timeout):
                await slot.ready.wait()
        finally:
            slot.waiters -= 1
            if slot.outcome is None and slot.waiters == 0 and self._slots.get(transfer_id) is slot:
                del self._slots[transfer_id]
        outcome = slot.outcome
        self._pop(transfer_id, slot)
        if isinstance(outcome, TransferRejected):
            raise TransferRejected(outcome.reason)
        assert outcome is not None
        return outcome

    def land(self, prefix: str, landing: Landing) -> None:
        """Receive the transfers whose id starts with ``prefix`` (one request's parts) into ``landing``, from
        now until :meth:`unland`. A part that does not fit it is refused (it would have nowhere to go that the
        taker expects)."""
        self.unland(prefix)
        self._landings[prefix] = landing

    def unland(self, prefix: str, landing: Landing | None = None) -> None:
        """Revoke the landing under ``prefix`` (only if it is ``landing``, when given; nothing when none): once
        this returns, no byte is written into its memory, and a part of it still being received is read into
        scratch and refused. Call it on the server's event loop."""
        held = self._landings.get(prefix)
        if held is not None and (landing is None or held is landing):
            del self._landings[prefix]
            held.revoke()
        if landing is not None:
            landing.revoke()

    @property
    def landings(self) -> int:
        """Landings open (what a leak check counts)."""
        return len(self._landings)

    def discard(self, transfer_id: str) -> None:
        """Drop ``transfer_id`` (the caller gave up on it): free its bytes if it arrived, refuse it if it
        arrives within ``ttl``, and wake any ``take`` still waiting for it with a rejection."""
        if slot := self._slots.get(transfer_id):
            if slot.outcome is None:
                slot.outcome = TransferRejected(f"transfer {transfer_id} was discarded by the receiver")
                slot.ready.set()
            self._pop(transfer_id, slot)
        if old := self._discarded.pop(transfer_id, None):
            old.cancel()
        loop = asyncio.get_running_loop()
        self._discarded[transfer_id] = loop.call_later(self.ttl, self._discarded.pop, transfer_id, None)

    def discard_prefix(self, prefix: str) -> None:
        """:meth:`discard` every transfer whose id starts with ``prefix``: held, in flight, or arriving within
        ``ttl`` (a request's parts, when its sender died half-way and nobody will take them); a landing under
        ``prefix`` is revoked."""
        self.unland(prefix)
        for transfer_id in [t for t in self._slots if t.startswith(prefix)]:
            self.discard(transfer_id)
        if old := self._discarded_prefixes.pop(prefix, None):
            old.cancel()
        loop = asyncio.get_running_loop()
        self._discarded_prefixes[prefix] = loop.call_later(self.ttl, self._discarded_prefixes.pop, prefix, None)

    async def close(self) -> None:
        self._accepting.cancel()
        self._sock.close()
        for prefix in list(self._landings):
            self.unland(prefix)
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(self._accepting, *self._connections, return_exceptions=True)
        for transfer_id, slot in list(self._slots.items()):
            if slot.outcome is None:
                slot.outcome = TransferRejected("the transfer server closed")
                slot.ready.set()
            self._pop(transfer_id, slot)
        for handle in [*self._discarded.values(), *self._discarded_prefixes.values()]:
            handle.cancel()
        self._discarded.clear()
        self._discarded_prefixes.clear()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- connections -----------------------------------------------------------------------------------------

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            configure(conn)
            task = asyncio.create_task(self._serve(conn))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, sock: socket.socket) -> None:
        """One connection: header, payload, reply; repeat. A broken or stalled sender only loses its own
        transfer in progress."""
        loop = asyncio.get_running_loop()
        try:
            while (prefix := await self._first_bytes(sock, PREFIX.size)) is not None:
                try:
                    async with asyncio.timeout(self.io_timeout):
                        header = await self._read_header(sock, prefix)
                except TransferRejected as e:  # unparseable: payload length unknown, so reply and close
                    log.warning("transfer refused: %s", e.reason)
                    await loop.sock_sendall(sock, encode_reply(Reply(False, e.reason)))
                    return
                await self._receive(sock, header)
        except (ConnectionError, TimeoutError, OSError) as e:
            log.warning("transfer connection dropped: %s", e or type(e).__name__)
        except Exception:  # a bug must cost one connection, not the server
            log.exception("transfer connection failed")
        finally:
            sock.close()

    @staticmethod
    async def _first_bytes(sock: socket.socket, n: int) -> bytearray | None:
        """The next ``n`` bytes, or None when the peer closed cleanly between frames."""
        buf = bytearray(n)
        got = await asyncio.get_running_loop().sock_recv_into(sock, buf)
        if got == 0:
            return None
        await recv_into(sock, memoryview(buf)[got:])
        return buf

    @staticmethod
    async def _read_header(sock: socket.socket, prefix: bytearray) -> TransferHeader:
        magic, length = PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise TransferRejected(f"not a kvmesh transfer frame (magic {bytes(magic)!r})")
        if length > MAX_HEADER_BYTES:
            raise TransferRejected(f"header of {length} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
        return decode_header(bytes(await recv_bytes(sock, length)))

    async def _receive(self, sock: socket.socket, header: TransferHeader) -> None:
        tid, nbytes = header.transfer_id, header.nbytes
        backend = self._backends.get(header.backend)
        landing = self._landing(tid) if isinstance(backend, ScatterBackend) else None
        reason, record = self._refusal(header, buffered=landing is None)
        if reason is None and backend is not None:
            if isinstance(backend, ScatterBackend) and landing is not None:
                reason = await self._land(sock, header, backend, landing)
            else:
                reason = await self._fetch(sock, header, backend)
        elif header.backend == TransferBackend.TCP:  # refused unread: drop the inline payload to keep the stream in sync
            async with asyncio.timeout(self.io_timeout):
                await drain(sock, nbytes)
        if reason is not None:
            log.warning("transfer %s refused: %s", tid, reason)
            if record:
                self._settle(tid, TransferRejected(reason), 0)
        await asyncio.get_running_loop().sock_sendall(sock, encode_reply(Reply(reason is None, reason or "")))

    def _refusal(self, header: TransferHeader, buffered: bool = True) -> tuple[str | None, bool]:
        """Why ``header`` is refused before its payload is read (None: admitted), and whether to record it
        as the transfer's outcome (not for duplicates, which must not overwrite the original). ``buffered``:
        it would be held here (not landed in place), so it counts against ``max_buffered_bytes``."""
        tid = header.transfer_id
        if self._discarded_id(tid):
            return f"transfer {tid} was discarded by the receiver", False
        if tid in self._in_flight:
            return f"transfer {tid} is already being received", False
        if (slot := self._slots.get(tid)) and isinstance(slot.outcome, ReceivedBlocks):
            return f"transfer {tid} was already received and not yet taken", False
        if header.backend not in self._backends:
            return f"backend {header.backend!r} is not served here (it takes {sorted(self._backends)})", True
        if self.expected_layout is not None and (diff := layout_mismatch(self.expected_layout, header.layout)):
            return f"layout mismatch: {diff}", True
        if buffered and self._buffered + header.nbytes > self.max_buffered_bytes:
            return (f"over capacity: {header.nbytes} bytes would exceed the {self.max_buffered_bytes}-byte "
                    f"receive buffer ({self._buffered} bytes held)"), True
        return None, True

    async def _fetch(self, sock: socket.socket, header: TransferHeader, backend: Backend) -> str | None:
        """Receive and verify an admitted transfer; returns the refusal reason, or None once delivered."""
        tid, nbytes = header.transfer_id, header.nbytes
        self._in_flight.add(tid)
        self._buffered += nbytes
        delivered = False
        started = time.perf_counter()
        try:
            view = np.empty(nbytes, dtype=np.uint8).data  # not zeroed: every byte is about to be written
            try:
                async with asyncio.timeout(self.io_timeout):
                    await backend.fetch(header, sock, view)
            except TransferRejected as e:
                return e.reason
            if bad := corrupt_blocks(header, view):
                return _mismatch(header, bad)
            if self._discarded_id(tid):  # given up on while it was being received
                return f"transfer {tid} was discarded by the receiver"
            received = ReceivedBlocks(tid, header.layout, header.block_keys, header.num_tokens, view, nbytes,
                                      time.perf_counter() - started, header.checksums, header.layers,
                                      header.first_block)
            self._settle(tid, received, nbytes)
            delivered = True
            return None
        finally:
            self._in_flight.discard(tid)
            if not delivered:
                self._buffered -= nbytes

    async def _land(self, sock: socket.socket, header: TransferHeader, backend: ScatterBackend,
                    landing: Landing) -> str | None:
        """Receive an admitted transfer in place and verify it there; returns the refusal reason, or None once
        delivered. A refused part's cells stay claimed: its bytes are garbage, never taken."""
        tid = header.transfer_id
        try:
            views = landing.claim(header)
        except TransferRejected as e:
            if backend.inline:
                async with asyncio.timeout(self.io_timeout):
                    await drain(sock, header.nbytes)
            return e.reason
        self._in_flight.add(tid)
        started = time.perf_counter()
        try:
            try:
                async with asyncio.timeout(self.io_timeout):
                    landed = await backend.fetch_landed(header, sock, views, lambda: landing.open)
            except TransferRejected as e:
                return e.reason
            if not landed or not landing.open:
                return f"transfer {tid}: the blocks reserved for it were released while it was received"
            if bad := corrupt_landed_blocks(header, views):
                return _mismatch(header, bad)
            if self._discarded_id(tid):
                return f"transfer {tid} was discarded by the receiver"
            landing.landed_bytes += header.nbytes
            self._settle(tid, ReceivedBlocks(tid, header.layout, header.block_keys, header.num_tokens,
                                             memoryview(b""), header.nbytes, time.perf_counter() - started,
                                             header.checksums, header.layers, header.first_block, landed=True), 0)
            return None
        finally:
            self._in_flight.discard(tid)

    # -- slots -----------------------------------------------------------------------------------------------

    def _landing(self, tid: str) -> Landing | None:
        """Where the part ``tid`` lands in place (None: buffered)."""
        landing = next((landing for prefix, landing in self._landings.items() if tid.startswith(prefix)), None)
        return landing if landing is not None and landing.admits(tid) else None

    def _discarded_id(self, tid: str) -> bool:
        return tid in self._discarded or any(tid.startswith(p) for p in self._discarded_prefixes)

    def _settle(self, tid: str, outcome: ReceivedBlocks | TransferRejected, nbytes: int) -> None:
        """Make ``outcome`` what ``take(tid)`` returns (replacing a rejection) for ``ttl`` seconds."""
        slot = self._slots.setdefault(tid, _Slot())
        if slot.expiry:
            slot.expiry.cancel()
        self._buffered -= slot.nbytes
        slot.outcome, slot.nbytes = outcome, nbytes
        slot.expiry = asyncio.get_running_loop().call_later(self.ttl, self._expire, tid, slot)
        slot.ready.set()

    def _expire(self, tid: str, slot: _Slot) -> None:
        if isinstance(slot.outcome, ReceivedBlocks):
            log.warning("transfer %s dropped: not taken within %g s", tid, self.ttl)
        self._pop(tid, slot)

    def _pop(self, tid: str, slot: _Slot) -> None:
        if self._slots.get(tid) is slot:
            del self._slots[tid]
        if slot.expiry:
            slot.expiry.cancel()
        self._buffered -= slot.nbytes
        slot.nbytes = 0


def _mismatch(header: TransferHeader, bad: list[int]) -> str:
    """The refusal of a payload whose blocks ``bad`` do not hash to the header's checksums."""
    shown = ", ".join(map(str, bad[:8])) + (", ..." if len(bad) > 8 else "")
    return f"checksum mismatch in {len(bad)} of {header.num_blocks} blocks ({shown})"
