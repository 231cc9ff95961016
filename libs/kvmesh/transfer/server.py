"""The receiving end (decode side): accept pushed transfers, verify them, hold them until taken.

Only pushes its own side asked for: the owner issues a capability for each push it expects
(:meth:`TransferServer.grant`, see :mod:`kvmesh.transfer.grants`) and a part without it, after its deadline or
for blocks it does not cover is refused before its payload is read. Every refusal is counted by
:class:`~kvmesh.transfer.errors.Refusal` (:attr:`TransferServer.refused`) and logged with the peer's address.
With an ``ssl.SSLContext`` (``tls``) the control connection is TLS and a plain-text peer is refused.

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

Hostile peers (:class:`Limits`): a connection that sends no frame within ``idle_timeout_s`` (before its first
byte, or between frames) is closed; one past ``max_connections_per_peer`` from its host is closed unread, and one
past ``max_connections`` (at most half the process's file-descriptor limit) takes the place of the connection idle
longest, or is closed unread when none is idle. When the process runs out of file descriptors (``EMFILE`` /
``ENFILE``) the accept loop closes the connection idle longest and backs off (up to 1 s) instead of ending.
A header is read only when it is no larger than the pushes its grants expect
(:func:`~kvmesh.transfer.header.header_limit` of the widest grant held): no JSON is parsed for a peer nobody asked
to push that much. These refusals are counted (``connections``, ``idle``, ``malformed``) and logged once per
peer and reason a minute.

Header versions: the server reads those its ``codec`` speaks (:attr:`TransferServer.versions`, which its owner
advertises with each capability it issues) and refuses the rest as ``version``.

Concurrency: all state lives on the event loop that called :meth:`TransferServer.start`; one task per
connection, each connection carrying one transfer at a time.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
import ssl
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Self, TypeVar

import numpy as np

from kvmesh.contracts.ids import BlockKey, TransferBackend, TransferId
from kvmesh.contracts.layout import KVLayout, layout_mismatch
from kvmesh.settings import SharedSettings
from kvmesh.transfer.backends import Backend, ScatterBackend, TcpBackend, skip_inline
from kvmesh.transfer.conn import TLS_RECORD, Conn, TlsConn, first_byte
from kvmesh.transfer.errors import Refusal, TransferRejected
from kvmesh.transfer.grants import Grant, Grants
from kvmesh.transfer.header import (
    CODEC,
    MAX_HEADER_BYTES,
    HeaderCodec,
    TransferHeader,
    Verifier,
    Versions,
    header_limit,
)
from kvmesh.transfer.landing import Landing
from kvmesh.transfer.registry import get_backend
from kvmesh.transfer.wire import MAGIC, PREFIX, Address, Reply, configure, encode_reply, refusal_reply

log = logging.getLogger(__name__)

_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_MAX_BACKOFF_S = 1.0
T = TypeVar("T")
_WARN_EVERY_S = 60.0  # a peer's refusals of one kind are logged at most this often (and counted always)


@dataclass(frozen=True)
class Limits:
    """What one transfer endpoint holds open for its peers (``[shared] transfer_*``)."""

    idle_timeout_s: float = 60.0       # no frame (first byte, or the next one) within this: closed
    max_connections: int = 1024        # in all (at most half the file-descriptor limit)
    max_connections_per_peer: int = 128  # from one host

    @classmethod
    def of(cls, shared: SharedSettings) -> Limits:
        return cls(shared.transfer_idle_timeout_s, shared.transfer_max_connections,
                   shared.transfer_max_connections_per_peer)

    def total(self) -> int:
        """``max_connections``, or half the process's soft ``RLIMIT_NOFILE`` when that is lower: the rest is
        for everything else the process opens."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return self.max_connections if soft == resource.RLIM_INFINITY else max(1, min(self.max_connections,
                                                                                      soft // 2))


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
                 max_buffered_bytes: int, io_timeout: float, tls: ssl.SSLContext | None = None,
                 convertible: frozenset[KVLayout] = frozenset(), limits: Limits = Limits(),
                 codec: HeaderCodec = CODEC) -> None:
        self.expected_layout = expected_layout
        self.convertible = convertible  # other layouts taken (buffered, never landed in place): the taker converts
        self.ttl = ttl
        self.max_buffered_bytes = max_buffered_bytes
        self.io_timeout = io_timeout
        self.tls = tls
        self.limits = limits
        self.codec = codec
        self.max_connections = limits.total()
        self.grants = Grants(linger_s=ttl)
        self.refused: dict[Refusal, int] = dict.fromkeys(Refusal, 0)  # transfers refused, by why
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
        self._per_peer: Counter[str] = Counter()  # open connections by the peer's host
        self._idle: dict[asyncio.Task[None], float] = {}  # connections waiting for a frame -> since (monotonic)
        self._warned: dict[tuple[str, Refusal], tuple[float, int]] = {}  # -> (last logged, refusals since)
        self._accepting = asyncio.create_task(self._accept())

    @classmethod
    async def start(cls, expected_layout: KVLayout | None, host: str = "127.0.0.1", port: int = 0,
                    backend: TransferBackend | str = TransferBackend.TCP, *, ttl: float = 60.0,
                    max_buffered_bytes: int = 1 << 30, io_timeout: float = 30.0,
                    tls: ssl.SSLContext | None = None,
                    convertible: frozenset[KVLayout] = frozenset(), limits: Limits = Limits(),
                    codec: HeaderCodec = CODEC) -> TransferServer:
        """Listen on ``host:port`` (0 = any free port). ``backend`` is what :attr:`address` advertises; plain
        ``tcp`` is always accepted too. ``expected_layout`` None: accept any layout (the taker checks it).
        ``tls``: a server-side context; every connection must then speak TLS (``kvmesh.tls``). ``convertible``:
        layouts besides ``expected_layout`` that the taker converts (``contracts.layout.converter``): they are
        received into buffers, never in place. ``limits``: the connections held open (see the module).
        ``codec``: the header versions it reads (this build's by default). Raises RuntimeError when the backend
        cannot run here (mooncake)."""
        chosen = get_backend(backend)
        if backend == TransferBackend.MOONCAKE:
            from kvmesh.transfer.mooncake_backend import engine

            engine(host)
        sock = socket.create_server((host, port))
        sock.setblocking(False)
        return cls(sock, expected_layout, chosen, ttl=ttl, max_buffered_bytes=max_buffered_bytes,
                   io_timeout=io_timeout, tls=tls, convertible=convertible, limits=limits, codec=codec)

    @property
    def versions(self) -> Versions:
        """The header versions this server reads: advertise them beside each capability issued, as
        ``str(versions)``, so the sender writes one of them."""
        return self.codec.speaks

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
            raise TransferRejected(outcome.reason, outcome.kind)
        assert outcome is not None
        return outcome

    def grant(self, prefix: str, first_block: int, end_block: int, timeout_s: float) -> Grant:
        """Take pushes of transfer ids starting with ``prefix`` (one request's parts, or one transfer id) that
        carry the returned grant's ``token`` and hold blocks ``first_block .. end_block - 1`` of the sender's
        sequence, for ``timeout_s`` seconds; hand the token to the one sender expected. Replaces a grant issued
        under the same prefix before."""
        return self.grants.issue(prefix, first_block, end_block, timeout_s)

    def revoke(self, prefix: str, grant: Grant | None = None) -> None:
        """No more pushes under ``prefix`` (only if its grant is ``grant``, when given): they are refused as
        ``expired``. What arrived already stays until taken or discarded."""
        self.grants.revoke(prefix, grant)

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
        arrives within ``ttl``, and wake any ``take`` still waiting for it with a rejection. A grant issued for
        exactly ``transfer_id`` is revoked."""
        self.grants.revoke(transfer_id)
        if slot := self._slots.get(transfer_id):
            if slot.outcome is None:
                slot.outcome = _discarded(transfer_id)
                slot.ready.set()
            self._pop(transfer_id, slot)
        if old := self._discarded.pop(transfer_id, None):
            old.cancel()
        loop = asyncio.get_running_loop()
        self._discarded[transfer_id] = loop.call_later(self.ttl, self._discarded.pop, transfer_id, None)

    def discard_prefix(self, prefix: str) -> None:
        """:meth:`discard` every transfer whose id starts with ``prefix``: held, in flight, or arriving within
        ``ttl`` (a request's parts, when its sender died half-way and nobody will take them); a landing and a
        grant under ``prefix`` are revoked."""
        self.unland(prefix)
        self.grants.revoke(prefix)
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
        self.grants.close()
        for transfer_id, slot in list(self._slots.items()):
            if slot.outcome is None:
                slot.outcome = TransferRejected("the transfer server closed", Refusal.DISCARDED)
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

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._connections)

    async def _accept(self) -> None:
        """Accept forever. Out of file descriptors, it frees the connection idle longest and backs off, doubling
        up to 1 s (the waiting peers stay in the listen backlog), instead of ending: asyncio's ``sock_accept``
        raises ``EMFILE`` to its caller, which would end this task and with it the endpoint."""
        loop = asyncio.get_running_loop()
        backoff = 0.0
        while True:
            try:
                sock, addr = await loop.sock_accept(self._sock)
            except OSError as e:
                if e.errno not in _OUT_OF_FDS:
                    if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):  # the peer left: next one
                        continue
                    raise
                backoff = min(_MAX_BACKOFF_S, max(0.01, 2 * backoff))
                self._warn("", Refusal.CONNECTIONS, f"cannot accept a connection ({errno.errorcode[e.errno]}: "
                           f"{len(self._connections)} open here); closing the one idle longest, retrying in "
                           f"{backoff:g} s")
                self._evict_idle()
                await asyncio.sleep(backoff)
                continue
            backoff = 0.0
            self._admit(sock, str(addr[0]))

    def _admit(self, sock: socket.socket, host: str) -> None:
        """Serve ``sock`` from ``host``, or close it unread when it is over a cap."""
        over = None
        if self._per_peer[host] >= self.limits.max_connections_per_peer:
            over = f"{self._per_peer[host]} connections from this peer (max_connections_per_peer)"
        elif len(self._connections) >= self.max_connections and not self._evict_idle():
            over = f"{len(self._connections)} connections open, none idle (max_connections {self.max_connections})"
        if over is not None:
            sock.close()
            self.refused[Refusal.CONNECTIONS] += 1
            self._warn(host, Refusal.CONNECTIONS, f"connection closed unread: {over}")
            return
        configure(sock)
        task = asyncio.create_task(self._serve(sock))
        self._per_peer[host] += 1
        self._connections.add(task)
        task.add_done_callback(lambda t: self._closed(t, host))

    def _closed(self, task: asyncio.Task[None], host: str) -> None:
        self._connections.discard(task)
        self._idle.pop(task, None)
        self._per_peer[host] -= 1
        if self._per_peer[host] <= 0:
            del self._per_peer[host]

    def _evict_idle(self) -> bool:
        """Close the connection waiting longest for a frame (its peer reconnects when it has one to send);
        False when none is idle."""
        if not self._idle:
            return False
        task = min(self._idle, key=self._idle.__getitem__)
        del self._idle[task]
        task.cancel()
        self.refused[Refusal.IDLE] += 1
        self._warn("", Refusal.IDLE, "closed the connection idle longest to make room for a new one")
        return True

    def _warn(self, peer: str, kind: Refusal, message: str) -> None:
        """Log ``message`` for ``peer`` once per ``kind`` and minute, with how many more came meanwhile."""
        now = time.monotonic()
        last, since = self._warned.get((peer, kind), (-_WARN_EVERY_S, 0))
        if now - last < _WARN_EVERY_S:
            self._warned[(peer, kind)] = (last, since + 1)
            return
        if len(self._warned) > 4096:  # a scan of many hosts must not grow this without bound
            self._warned.clear()
        self._warned[(peer, kind)] = (now, 0)
        more = f" ({since} more like it in the last {_WARN_EVERY_S:g} s)" if since else ""
        log.warning("transfer endpoint %s, peer %s: %s%s", self.address, peer or "-", message, more)

    async def _serve(self, sock: socket.socket) -> None:
        """One connection: header, payload, reply; repeat. A broken or stalled sender only loses its own
        transfer in progress; one that sends nothing for ``idle_timeout_s`` loses its connection."""
        conn = Conn(sock)
        try:
            if self.tls is not None:
                if await self._idle_wait(first_byte(sock), conn) is None:
                    return
                async with asyncio.timeout(self.io_timeout):
                    if (tls := await self._secure(sock)) is None:
                        return
                conn = tls
            while (prefix := await self._next_prefix(conn)) is not None:
                try:
                    async with asyncio.timeout(self.io_timeout):
                        header = await self._read_header(conn, prefix)
                except TransferRejected as e:  # unparseable: payload length unknown, so reply and close
                    self._count(conn, "?", e)
                    await conn.refuse_and_close(refusal_reply(e))
                    return
                if header.seal is not None and not conn.tls:  # its key travelled in clear: never take it
                    clear = TransferRejected("a sealed payload on a plain-text connection: a sender seals only "
                                             "under TLS", Refusal.MALFORMED)
                    self._count(conn, header.transfer_id, clear)
                    await conn.refuse_and_close(refusal_reply(clear))
                    return
                await self._receive(conn, header)
        except (ConnectionError, TimeoutError, OSError) as e:  # ssl.SSLError included: a failed handshake
            log.warning("transfer connection from %s dropped: %s", conn.peer, e or type(e).__name__)
        except Exception:  # a bug must cost one connection, not the server
            log.exception("transfer connection from %s failed", conn.peer)
        finally:
            conn.close()

    async def _next_prefix(self, conn: Conn) -> bytearray | None:
        """The next frame's prefix; None when the peer closed between frames or went idle (:meth:`_idle_wait`)."""
        buf = bytearray(PREFIX.size)
        got = await self._idle_wait(conn.read_some(memoryview(buf)), conn)
        if not got:
            return None
        async with asyncio.timeout(self.io_timeout):
            await conn.recv_into(memoryview(buf)[got:])
        return buf

    async def _idle_wait(self, first: Awaitable[T], conn: Conn) -> T | None:
        """``first`` (the wait for a frame's first byte), given at most ``idle_timeout_s``; None past it (the
        connection is then closed, counted as ``idle``). Meanwhile the connection is idle: the first one closed
        when the endpoint needs room."""
        task = asyncio.current_task()
        assert task is not None
        self._idle[task] = time.monotonic()
        try:
            async with asyncio.timeout(self.limits.idle_timeout_s):
                return await first
        except TimeoutError:
            self.refused[Refusal.IDLE] += 1
            self._warn(conn.peer.rpartition(":")[0], Refusal.IDLE,
                       f"connection closed: no frame within idle_timeout_s ({self.limits.idle_timeout_s:g} s)")
            return None
        finally:
            self._idle.pop(task, None)

    async def _secure(self, sock: socket.socket) -> TlsConn | None:
        """The TLS connection over ``sock``; None when the peer speaks plain text (told so in plain text), fails
        the handshake (counted as a ``tls`` refusal) or left before a byte."""
        assert self.tls is not None
        first = await first_byte(sock)
        if first is None:
            return None
        if first != TLS_RECORD:
            plain = Conn(sock)
            e = TransferRejected("this transfer endpoint takes TLS only: configure the sender's [shared] tls_ca "
                                 "(KVMESH_TLS_CA), tls_cert and tls_key", Refusal.TLS)
            self._count(plain, "?", e)
            await plain.refuse_and_close(refusal_reply(e))
            return None
        try:
            return await TlsConn.handshake(sock, self.tls, server_side=True)
        except ssl.SSLError as e:  # a certificate the mesh CA did not sign, or none
            self._count(Conn(sock), "?", TransferRejected(f"TLS handshake failed: {e}", Refusal.TLS))
            return None

    async def _read_header(self, conn: Conn, prefix: bytearray) -> TransferHeader:
        """The frame's header, read and parsed only when no larger than the widest push a grant expects."""
        magic, length = PREFIX.unpack(prefix)
        if magic[:2] == bytes((TLS_RECORD, 3)):  # a ClientHello
            raise TransferRejected("a TLS client at a plain-text transfer endpoint: give this endpoint's process "
                                   "the mesh's certificate ([shared] tls_cert, tls_key)", Refusal.TLS)
        if magic != MAGIC:
            raise TransferRejected(f"not a kvmesh transfer frame (magic {bytes(magic)!r})", Refusal.MALFORMED)
        limit = min(MAX_HEADER_BYTES, header_limit(self.grants.widest))
        if length > limit:
            raise TransferRejected(f"header of {length} bytes exceeds the {limit}-byte limit (the largest a push "
                                   f"of the {self.grants.widest} blocks granted at most can take)",
                                   Refusal.MALFORMED)
        return self.codec.decode(bytes(await conn.recv_bytes(length)))

    async def _receive(self, conn: Conn, header: TransferHeader) -> None:
        """Admit, receive and verify one transfer, then reply. Whoever holds no capability for it is refused
        before anything else is looked at, and its refusal is not recorded as the transfer's outcome: a forged
        push must not fail the genuine one."""
        tid = header.transfer_id
        backend = self._backends.get(header.backend)
        landing = None
        refused, record = self._unauthorized(header)
        if refused is None:
            in_place = isinstance(backend, ScatterBackend) and header.layout == self.expected_layout
            landing = self._landing(tid) if in_place else None
            refused, record = self._refusal(header, buffered=landing is None)
        if refused is not None:  # refused unread: drop an inline payload to keep the stream in sync
            if header.backend == TransferBackend.TCP:
                async with asyncio.timeout(self.io_timeout):
                    await skip_inline(conn, header)
        elif isinstance(backend, ScatterBackend) and landing is not None:
            refused = await self._land(conn, header, backend, landing)
        elif backend is not None:
            refused = await self._fetch(conn, header, backend)
        if refused is not None:
            self._count(conn, tid, refused)
            if record:
                self._settle(tid, refused, 0)
        await conn.sendall(refusal_reply(refused) if refused is not None else encode_reply(Reply(True)))

    def _unauthorized(self, header: TransferHeader) -> tuple[TransferRejected | None, bool]:
        """Why ``header`` may not be pushed at all (None: a capability covers it, or its id was discarded and
        :meth:`_refusal` says so), and whether that is the transfer's outcome: only when its sender proved to
        hold the capability (a late or misplaced push of the genuine sender)."""
        if self._discarded_id(header.transfer_id):
            return None, False
        refused = self.grants.check(header)
        return refused, refused is not None and refused.kind in (Refusal.EXPIRED, Refusal.BLOCKS)

    def _refusal(self, header: TransferHeader, buffered: bool = True) -> tuple[TransferRejected | None, bool]:
        """Why ``header`` is refused before its payload is read (None: admitted), and whether to record it
        as the transfer's outcome (not for duplicates, which must not overwrite the original). ``buffered``:
        it would be held here (not landed in place), so it counts against ``max_buffered_bytes``."""
        tid = header.transfer_id
        if self._discarded_id(tid):
            return _discarded(tid), False
        if tid in self._in_flight:
            return TransferRejected(f"transfer {tid} is already being received", Refusal.DUPLICATE), False
        if (slot := self._slots.get(tid)) and isinstance(slot.outcome, ReceivedBlocks):
            return TransferRejected(f"transfer {tid} was already received and not yet taken",
                                    Refusal.DUPLICATE), False
        if header.backend not in self._backends:
            return TransferRejected(f"backend {header.backend!r} is not served here (it takes "
                                    f"{sorted(self._backends)})", Refusal.BACKEND), True
        if (self.expected_layout is not None and header.layout not in self.convertible
                and (diff := layout_mismatch(self.expected_layout, header.layout))):
            return TransferRejected(f"layout mismatch: {diff}", Refusal.LAYOUT), True
        if buffered and self._buffered + header.nbytes > self.max_buffered_bytes:
            return TransferRejected(f"over capacity: {header.nbytes} bytes would exceed the "
                                    f"{self.max_buffered_bytes}-byte receive buffer ({self._buffered} bytes held)",
                                    Refusal.CAPACITY), True
        return None, True

    def _count(self, conn: Conn, tid: str, refused: TransferRejected) -> None:
        self.refused[refused.kind] += 1
        log.warning("transfer %s from %s refused (%s): %s", tid, conn.peer, refused.kind, refused.reason)

    async def _fetch(self, conn: Conn, header: TransferHeader, backend: Backend) -> TransferRejected | None:
        """Receive and verify an admitted transfer; returns the refusal, or None once delivered."""
        tid, nbytes = header.transfer_id, header.nbytes
        self._in_flight.add(tid)
        self._buffered += nbytes
        delivered = False
        started = time.perf_counter()
        try:
            view = np.empty(nbytes, dtype=np.uint8).data  # not zeroed: every byte is about to be written
            verifier = Verifier.flat(header, view)
            try:
                async with asyncio.timeout(self.io_timeout):
                    await backend.fetch(header, conn, view, verifier.upto)
            except TransferRejected as e:
                return e
            if bad := verifier.bad():
                return _mismatch(header, bad)
            if self._discarded_id(tid):  # given up on while it was being received
                return _discarded(tid)
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

    async def _land(self, conn: Conn, header: TransferHeader, backend: ScatterBackend,
                    landing: Landing) -> TransferRejected | None:
        """Receive an admitted transfer in place and verify it there; returns the refusal, or None once
        delivered. A refused part's cells stay claimed: its bytes are garbage, never taken."""
        tid = header.transfer_id
        try:
            views = landing.claim(header)
        except TransferRejected as e:
            if backend.inline:
                async with asyncio.timeout(self.io_timeout):
                    await skip_inline(conn, header)
            return e
        self._in_flight.add(tid)
        started = time.perf_counter()
        verifier = Verifier(header, views)
        try:
            try:
                async with asyncio.timeout(self.io_timeout):
                    landed = await backend.fetch_landed(header, conn, views, lambda: landing.open, verifier.upto)
            except TransferRejected as e:
                return e
            if not landed or not landing.open:
                return TransferRejected(f"transfer {tid}: the blocks reserved for it were released while it was "
                                        "received", Refusal.DISCARDED)
            if bad := verifier.bad():
                return _mismatch(header, bad)
            if self._discarded_id(tid):
                return _discarded(tid)
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


def _discarded(tid: str) -> TransferRejected:
    return TransferRejected(f"transfer {tid} was discarded by the receiver", Refusal.DISCARDED)


def _mismatch(header: TransferHeader, bad: list[int]) -> TransferRejected:
    """The refusal of a payload whose blocks ``bad`` do not hash to the header's checksums."""
    shown = ", ".join(map(str, bad[:8])) + (", ..." if len(bad) > 8 else "")
    return TransferRejected(f"checksum mismatch in {len(bad)} of {header.num_blocks} blocks ({shown})",
                            Refusal.CHECKSUM)
