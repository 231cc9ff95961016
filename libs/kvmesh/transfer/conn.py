"""One control connection of the transfer engine, plain TCP or TLS, read and written on the event loop.

Both ends read and write through a :class:`Conn`: plain, it is the socket itself (the kernel copies straight
into the caller's buffers; receiving in place scatters with ``recvmsg_into``). :class:`TlsConn` runs TLS over
the same non-blocking socket with an ``ssl.SSLObject`` and two memory BIOs (asyncio's ``sock_*`` calls do not
take an ``SSLSocket``): ciphertext is read into the incoming BIO and decrypted into the caller's buffer. Receiving
in place has no ``recvmsg_into`` scatter under TLS: the plaintext is decrypted into a small staging buffer and
copied into the views from there (one extra copy of cache-hot bytes, far fewer calls than decrypting into each
view). TLS 1.3 only, no session tickets, no renegotiation: both ends are kvmesh.

Sealed payloads (:mod:`kvmesh.transfer.seal`, header version 3): a TLS sender sends the payload on the socket
itself, outside TLS, as AES-GCM chunks under the key its header carried, and the receiver opens them straight into
its buffers (:meth:`Conn.send_sealed`, :meth:`Conn.recv_sealed`, :meth:`Conn.recv_sealed_scatter`). So that no
sealed byte enters the TLS layer, a server-side :class:`TlsConn` reads TLS record by record (``exact``) except
inside :meth:`Conn.read_ahead`, which the receiver opens only for a payload sent in TLS records: nothing follows
one of those before the receiver's reply.

A TLS endpoint refuses a plain-text peer with a plain-text reply saying so (``Refusal.TLS``) before it
closes; a TLS client at a plain-text endpoint fails its handshake with a message saying which side lacks TLS.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import ssl
import struct
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from typing import cast

import numpy as np
from cryptography.exceptions import InvalidTag

from kvmesh.transfer.errors import Refusal, TransferRejected
from kvmesh.transfer.seal import TAG, Seal
from kvmesh.transfer.wire import IOV_MAX, PeerClosed

_DRAIN_CHUNK = 1 << 20
_LINGER_S = 2.0      # how long a refusing end waits for the peer to stop sending before it closes
_TLS_READ = 256 << 10   # ciphertext read per syscall
_TLS_WRITE = 256 << 10  # plaintext encrypted per step (the outgoing BIO never holds more)
_TLS_STAGING = 64 << 10  # plaintext decrypted before it is copied into the views (receiving in place)
TLS_RECORD = 0x16       # the first byte of a TLS handshake record (a ClientHello)
_RECORD_HEAD = struct.Struct(">BHH")  # a TLS record's type, legacy version and length


@dataclass(frozen=True)
class ClientTLS:
    """How a transfer client speaks TLS: the context (CA to verify servers with, the client's certificate) and
    the name expected in servers' certificates ("" = the host dialled)."""

    context: ssl.SSLContext
    server_name: str = ""


class Conn:
    """A plain TCP control connection over a non-blocking socket."""

    tls = False

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @property
    def peer(self) -> str:
        """``host:port`` of the other end (what a refusal is logged with)."""
        try:
            host, port = self.sock.getpeername()[:2]
        except OSError:
            return "?"
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def local_host(self) -> str:
        return self.sock.getsockname()[0]

    async def read_some(self, view: memoryview) -> int:
        """Read what is there (at least a byte) into ``view``; 0 when the peer closed."""
        return await asyncio.get_running_loop().sock_recv_into(self.sock, view)

    async def sendall(self, data: bytes | memoryview) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def recv_scatter(self, views: list[memoryview], still_open: Callable[[], bool]) -> bool:
        """Fill ``views`` in order, up to ``IOV_MAX`` of them per ``recvmsg_into`` (the kernel copies straight
        into each). ``still_open`` is asked before every syscall, with no ``await`` in between: once it says
        False, nothing more is written into ``views``; the rest of the payload is read into scratch and dropped
        (the connection stays in sync) and the result is False. True: every view filled."""
        sock = self.sock
        i, offset = 0, 0  # the first view not yet full, and how much of it is
        left = sum(len(v) for v in views)
        while left:
            if not still_open():
                await self.drain(left)
                return False
            batch = views[i:i + IOV_MAX]
            if offset:
                batch[0] = batch[0][offset:]
            try:
                n = sock.recvmsg_into(batch)[0]
            except (BlockingIOError, InterruptedError):
                await readable(sock)
                continue
            if n == 0:
                raise PeerClosed(f"peer closed the connection with {left} bytes of the frame missing")
            left -= n
            n += offset
            while i < len(views) and n >= len(views[i]):
                n -= len(views[i])
                i += 1
            offset = n
        return True

    async def recv_into(self, view: memoryview) -> None:
        """Fill ``view`` from the connection."""
        await _fill(self.read_some, view)

    async def recv_bytes(self, n: int) -> bytearray:
        buf = bytearray(n)
        await self.recv_into(memoryview(buf))
        return buf

    async def drain(self, n: int) -> None:
        """Read and drop ``n`` bytes, so a refused inline payload leaves the connection usable."""
        await _drop(self.recv_into, n)

    async def drain_raw(self, n: int) -> None:
        """Read and drop ``n`` bytes of the socket itself (under TLS: sealed bytes, outside the records)."""
        self._before_raw()
        await _drop(self._recv_raw, n)

    @contextmanager
    def read_ahead(self) -> Iterator[None]:
        """Inside: a payload sent in TLS records is read in large steps (see the module). Plain: nothing to do."""
        yield

    async def send_sealed(self, payload: memoryview, seal: Seal) -> None:
        """Send ``payload`` sealed (:mod:`kvmesh.transfer.seal`) on the socket itself, chunk by chunk, each
        encrypted from ``payload`` straight into one buffer lent for the push (:data:`BUFFERS`). Overlapping the
        two measured slower, either way round: encrypting the next chunk on a worker thread while this one is sent
        0.5-0.7x of this; sending on a worker thread (the kernel's copy runs without the GIL) while the next chunk
        is encrypted 0.75-0.85x of it. Each chunk's hand-over between threads costs more than it overlaps."""
        self._before_raw()
        aead, n, count = seal.aead(), len(payload), seal.chunks(len(payload))
        loop = asyncio.get_running_loop()
        with BUFFERS.lend(min(n, seal.chunk) + TAG) as out:
            for i in range(count):
                lo, hi = i * seal.chunk, min(n, (i + 1) * seal.chunk)
                sealed = out[:hi - lo + TAG]
                aead.encrypt_into(seal.nonce(i), payload[lo:hi], seal.aad(i, i == count - 1), sealed)
                await loop.sock_sendall(self.sock, sealed)

    async def recv_sealed(self, view: memoryview, seal: Seal, progress: Callable[[int], None] | None = None) -> None:
        """Fill ``view`` with a sealed payload, each chunk opened straight into its place. TransferRejected
        (``checksum``) when a chunk fails authentication: the rest of the payload is read and dropped, so the
        connection stays in sync. ``progress``: told the bytes in place after each chunk."""
        async with aclosing(self._opened(seal, len(view), view)) as chunks:
            async for _, hi, _ in chunks:
                if progress is not None:
                    progress(hi)

    async def recv_sealed_scatter(self, views: list[memoryview], seal: Seal, still_open: Callable[[], bool],
                                  progress: Callable[[int], None] | None = None) -> bool:
        """As :meth:`recv_scatter` for a sealed payload: each chunk is opened into a staging buffer, then copied
        into the views after ``still_open`` said yes, with no ``await`` in between (nothing of a chunk that
        fails authentication is copied)."""
        left = sum(len(v) for v in views)
        i, offset = 0, 0  # the first view not yet full, and how much of it is
        with BUFFERS.lend(min(left, seal.chunk)) as staging:
            async with aclosing(self._opened(seal, left, staging=staging)) as chunks:
                async for lo, hi, opened in chunks:
                    if not still_open():
                        await self.drain_raw(seal.sealed_nbytes(left) - seal.sealed_nbytes(hi))
                        return False
                    i, offset = scatter(opened[:hi - lo], views, i, offset)  # no await from the check to here
                    if progress is not None:
                        progress(hi)
        return True

    async def _opened(self, seal: Seal, n: int, dest: memoryview | None = None,
                      staging: memoryview | None = None) -> AsyncGenerator[tuple[int, int, memoryview], None]:
        """Each chunk of a sealed payload of ``n`` bytes, read and opened: ``(first byte, end, its plaintext)``,
        the plaintext in ``dest[first:end]`` when ``dest`` is given, else at the start of ``staging``."""
        self._before_raw()
        aead, count = seal.aead(), seal.chunks(n)
        with BUFFERS.lend(min(n, seal.chunk) + TAG) as sealed:
            for i in range(count):
                lo, hi = i * seal.chunk, min(n, (i + 1) * seal.chunk)
                chunk = sealed[:hi - lo + TAG]
                await self._recv_raw(chunk)
                out = dest[lo:hi] if dest is not None else cast(memoryview, staging)[:hi - lo]
                try:
                    aead.decrypt_into(seal.nonce(i), chunk, seal.aad(i, i == count - 1), out)
                except InvalidTag:
                    await self.drain_raw(seal.sealed_nbytes(n) - seal.sealed_nbytes(hi))
                    raise TransferRejected(f"sealed payload: chunk {i} of {count} failed authentication (altered "
                                           "in flight, or not sealed under the key its header carried)",
                                           Refusal.CHECKSUM) from None
                yield lo, hi, out

    def _before_raw(self) -> None:
        """Checked before the socket itself is read or written past the connection's own framing."""

    async def _recv_raw(self, view: memoryview) -> None:
        """Fill ``view`` from the socket itself."""
        await _fill(functools.partial(asyncio.get_running_loop().sock_recv_into, self.sock), view)

    def reusable(self) -> bool:
        """An idle pooled connection is reusable when the peer has neither closed it nor sent anything."""
        try:
            self.sock.recv(1, socket.MSG_PEEK)  # EOF, or bytes nobody asked for: either way not reusable
            return False
        except BlockingIOError:
            return True
        except OSError:
            return False

    def close(self) -> None:
        self.sock.close()

    async def refuse_and_close(self, reply: bytes, linger: float = _LINGER_S) -> None:
        """Send a last ``reply`` and close without resetting the peer: closing with the sender's unread bytes
        in the receive buffer makes the kernel answer with a reset, which can reach the sender while it is
        still writing, before it read the reply. So: half-close, then read and drop what still arrives until
        the peer closes, at most ``linger`` seconds."""
        try:
            await self.sendall(reply)
            self.sock.shutdown(socket.SHUT_WR)
            scratch = memoryview(bytearray(_DRAIN_CHUNK))
            async with asyncio.timeout(linger):
                while await self.read_some(scratch):
                    pass
        except (OSError, TimeoutError):  # the peer reset or lingered: the reply went out as far as it could
            pass
        finally:
            self.close()


class TlsConn(Conn):
    """TLS over a non-blocking socket (see the module): made by :meth:`handshake`."""

    tls = True

    def __init__(self, sock: socket.socket, tls: ssl.SSLObject, incoming: ssl.MemoryBIO,
                 outgoing: ssl.MemoryBIO, *, exact: bool = False) -> None:
        super().__init__(sock)
        self._tls, self._in, self._out = tls, incoming, outgoing
        self.exact = exact  # read TLS record by record (a server: a sealed payload may follow the header)

    @classmethod
    async def handshake(cls, sock: socket.socket, context: ssl.SSLContext, *, server_side: bool,
                        server_name: str | None = None) -> TlsConn:
        """Run the TLS handshake over ``sock``; ``ssl.SSLError`` (an ``OSError``) when it fails (a certificate
        not signed by the CA, a name that does not match, a peer without TLS), ``PeerClosed`` when the peer
        hung up."""
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        conn = cls(sock, context.wrap_bio(incoming, outgoing, server_side=server_side,
                                          server_hostname=server_name), incoming, outgoing, exact=server_side)
        while True:
            try:
                conn._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                if not await conn._fill():
                    raise PeerClosed("the peer closed the connection during the TLS handshake") from None
            except ssl.SSLError:
                await conn._flush()  # the alert that tells the peer why
                raise
        await conn._flush()
        return conn

    async def read_some(self, view: memoryview) -> int:
        while (n := self._read_now(view)) is None:
            await self._fill()
        return n

    async def sendall(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        for i in range(0, len(view), _TLS_WRITE):
            self._tls.write(view[i:i + _TLS_WRITE])
            await self._flush()

    async def recv_scatter(self, views: list[memoryview], still_open: Callable[[], bool]) -> bool:
        """As :meth:`Conn.recv_scatter`: up to ``_TLS_STAGING`` bytes at a time are decrypted into a small staging
        buffer (a TLS record holds at most 16 KiB, so decrypting into each view directly costs a call per record
        piece of every view), then copied into the views, after ``still_open`` said yes, with no ``await``
        in between."""
        left = sum(len(v) for v in views)
        staging = memoryview(bytearray(min(left, _TLS_STAGING)))
        i, offset = 0, 0  # the first view not yet full, and how much of it is
        while left:
            want, got = min(len(staging), left), 0
            while got < want:
                n = self._read_now(staging[got:want])
                if n is None:
                    await self._fill()
                elif n == 0:
                    raise PeerClosed(f"peer closed the connection with {left - got} bytes of the frame missing")
                else:
                    got += n
            left -= got
            if not still_open():
                await self.drain(left)
                return False
            i, offset = scatter(staging[:got], views, i, offset)  # no await from the check to here
        return True

    def _read_now(self, view: memoryview) -> int | None:
        """Decrypt what the incoming BIO holds into ``view`` (no await): bytes written, 0 at the end of the
        stream, None when more ciphertext is needed first."""
        try:
            return cast(int, self._tls.read(len(view), view))  # with a buffer: the bytes written into it
        except ssl.SSLWantReadError:
            return None
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            return 0

    @contextmanager
    def read_ahead(self) -> Iterator[None]:
        exact, self.exact = self.exact, False
        try:
            yield
        finally:
            self.exact = exact

    def _before_raw(self) -> None:
        """No TLS byte may be left unread where the sealed bytes start (the peer broke the framing)."""
        if self._in.pending or self._tls.pending() or self._out.pending:
            raise ConnectionError("TLS bytes where a sealed payload starts: the transfer framing is broken")

    async def _fill(self) -> bool:
        """Read ciphertext into the incoming BIO (``exact``: one whole TLS record, nothing past it); False (and
        the BIO at its end) when the peer closed."""
        await self._flush()  # anything the TLS layer owes the peer first (a handshake step, an alert)
        loop = asyncio.get_running_loop()
        if self.exact:
            head = bytearray(_RECORD_HEAD.size)
            got = await loop.sock_recv_into(self.sock, head)
            if not got:
                self._in.write_eof()
                return False
            await self._recv_raw(memoryview(head)[got:])
            body = bytearray(_RECORD_HEAD.unpack(head)[2])
            await self._recv_raw(memoryview(body))
            self._in.write(head)
            self._in.write(body)
            return True
        data = await loop.sock_recv(self.sock, _TLS_READ)
        if not data:
            self._in.write_eof()
            return False
        self._in.write(data)
        return True

    async def _flush(self) -> None:
        if self._out.pending:
            await asyncio.get_running_loop().sock_sendall(self.sock, self._out.read())


async def _fill(read: Callable[[memoryview], Awaitable[int]], view: memoryview) -> None:
    """Fill ``view`` with ``read`` (what it read, at least a byte; 0 when the peer closed)."""
    while view:
        n = await read(view)
        if n == 0:
            raise PeerClosed(f"peer closed the connection with {len(view)} bytes of the frame missing")
        view = view[n:]


async def _drop(fill: Callable[[memoryview], Awaitable[None]], n: int) -> None:
    """Read ``n`` bytes with ``fill`` and drop them."""
    scratch = memoryview(bytearray(min(n, _DRAIN_CHUNK)))
    while n > 0:
        step = min(n, len(scratch))
        await fill(scratch[:step])
        n -= step


def scatter(data: memoryview, views: list[memoryview], i: int, offset: int) -> tuple[int, int]:
    """Copy ``data`` into ``views`` from view ``i``'s byte ``offset`` on; where the next byte goes after it."""
    at = 0
    while at < len(data):
        view = views[i]
        n = min(len(view) - offset, len(data) - at)
        view[offset:offset + n] = data[at:at + n]
        at += n
        offset += n
        if offset == len(view):
            i, offset = i + 1, 0
    return i, offset


class BufferPool:
    """Buffers for sealed chunks, lent for one push and taken back. Memory written before costs no page faults
    (a fresh 1 MiB buffer per push measured as costly as the copy into it), and lending per push rather than per
    connection bounds what a process holds to its pushes in flight plus ``max_idle_bytes`` (cachesvc keeps a
    connection from every engine that writes back). Sizes round up to ``GRAIN``; thread-safe."""

    GRAIN = 64 << 10

    def __init__(self, max_idle_bytes: int = 64 << 20) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.idle_bytes = 0
        self._idle: dict[int, list[memoryview]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def lend(self, n: int) -> Iterator[memoryview]:
        """A buffer of at least ``n`` bytes until the block ends (not zeroed)."""
        size = -(-n // self.GRAIN) * self.GRAIN
        with self._lock:
            free = self._idle.get(size)
            buf = free.pop() if free else None
            if buf is not None:
                self.idle_bytes -= size
        if buf is None:
            buf = np.empty(size, dtype=np.uint8).data
        try:
            yield buf
        finally:
            with self._lock:
                if self.idle_bytes + size <= self.max_idle_bytes:
                    self._idle.setdefault(size, []).append(buf)
                    self.idle_bytes += size


BUFFERS = BufferPool()


async def readable(sock: socket.socket) -> None:
    """Until ``sock`` has bytes to read (or is closed)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    fd = sock.fileno()
    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


async def first_byte(sock: socket.socket) -> int | None:
    """The first byte the peer sent, left unread (None: it closed without sending any)."""
    while True:
        try:
            peek = sock.recv(1, socket.MSG_PEEK)
            return peek[0] if peek else None
        except (BlockingIOError, InterruptedError):
            await readable(sock)
