"""The pushing end (prefill side): send a request's KV blocks to a decode instance's :class:`TransferServer`.

Connections are pooled per address: a push takes an idle connection (or opens one), owns it exclusively until
the reply, then returns it, so concurrent pushes are safe and each uses its own connection (at most
``max_connections_per_address`` at once; further pushes wait). A connection that failed mid-push is closed,
never reused; one idle for ``IDLE_REUSE_S`` is closed too, well before the receiver's idle timeout
(``[shared] transfer_idle_timeout_s``, at least 30 s) could close it under a push. With ``tls``
(``kvmesh.tls.transfer_client_tls``) every connection is TLS, the server's certificate verified against the CA
(and the client's own presented).

Every push carries the capability (``token``) its receiver issued for it (:mod:`kvmesh.transfer.grants`): the
receiver refuses a push without it. Its header is written in the highest version both ends speak: the client's
``codec`` and the ``versions`` its receiver advertised beside the token (:mod:`kvmesh.transfer.header`). From
version 3 a ``tcp`` payload on a TLS connection is sealed under a key of its own (:mod:`kvmesh.transfer.seal`)
rather than sent in TLS records.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Sequence
from typing import NamedTuple, Self

from kvmesh.contracts.ids import BlockKey, TransferId
from kvmesh.contracts.layout import KVLayout
from kvmesh.transfer.backends import Backend, Staged
from kvmesh.transfer.conn import ClientTLS, Conn, TlsConn
from kvmesh.transfer.errors import TransferRejected
from kvmesh.transfer.header import (
    CODEC,
    SEALED,
    UNSAID,
    HeaderCodec,
    TransferHeader,
    Versions,
    block_checksums,
    negotiate,
)
from kvmesh.transfer.registry import get_backend
from kvmesh.transfer.seal import Seal
from kvmesh.transfer.wire import (
    MAGIC,
    PREFIX,
    Address,
    Reply,
    configure,
    flat_bytes,
    parse_address,
    read_reply,
)

IDLE_REUSE_S = 20.0


class TransferStats(NamedTuple):
    nbytes: int
    seconds: float  # push called -> receiver replied "verified"
    gbps: float     # GB/s (1e9 bytes per second)


class TransferClient:
    def __init__(self, *, max_connections_per_address: int = 8, max_idle_per_address: int = 4,
                 connect_timeout: float = 5.0, reply_timeout: float = 60.0, tls: ClientTLS | None = None,
                 codec: HeaderCodec = CODEC, seal: bool = True) -> None:
        """``seal``: under TLS, seal a ``tcp`` payload when the receiver reads header version 3 (False: send it
        in TLS records, as version 2 does; for measuring one against the other)."""
        self.max_connections_per_address = max_connections_per_address
        self.max_idle_per_address = max_idle_per_address
        self.connect_timeout = connect_timeout
        self.reply_timeout = reply_timeout
        self.tls = tls
        self.codec = codec
        self.seal = seal
        self._idle: dict[Address, list[tuple[Conn, float]]] = {}  # -> (connection, idle since)
        self._slots: dict[Address, asyncio.Semaphore] = {}  # bounds the pushes in flight per address
        self._backends: dict[str, Backend] = {}

    async def push(self, address: str, transfer_id: TransferId | str, layout: KVLayout,
                   payload: bytes | bytearray | memoryview, block_keys: Sequence[BlockKey], num_tokens: int,
                   checksums: Sequence[int] | None = None, layers: tuple[int, int] | None = None,
                   first_block: int = 0, *, token: str, versions: Versions = UNSAID) -> TransferStats:
        """Send the bytes of ``n`` whole blocks in ``layout`` (``payload``: any C-contiguous buffer of
        ``n * layout.block_nbytes`` bytes; the engine passes ``kv_cache.block_bytes(tensor)``, a zero-copy
        view) and wait until the receiver verified them. ``block_keys`` are the keys of the full blocks, in order.
        ``checksums``: the blocks' xxh3_64 when the caller has them already (e.g. stored with the blocks): the receiver
        verifies the bytes against them and they are not computed again here. ``layers`` (``(first, end)``): each block
        of the payload is only its slice of those layers (a hand-off pushed layer group by layer group);
        ``first_block``: where the payload's first block sits in the sender's sequence. ``token``: the push
        capability the receiver issued for this transfer; ``versions``: the header versions the receiver advertised
        with it (none advertised: :data:`~kvmesh.transfer.header.UNSAID`). Raises TransferRejected with the
        receiver's reason (and its ``kind``; ``version`` before connecting when no header version is common);
        ConnectionError (or OSError/TimeoutError, ``ssl.SSLError`` among them) when it cannot
        be reached, the TLS handshake fails or the connection breaks."""
        started = time.perf_counter()
        version = negotiate(self.codec.speaks, versions)
        addr = parse_address(address)
        backend = self._backend(addr.backend)
        payload = flat_bytes(payload)
        n = _num_blocks(layout, payload, layers)
        _check_request(transfer_id, layout, n, block_keys, num_tokens)
        if checksums is None:
            checksums = block_checksums(payload, layout.layers_nbytes(layers))
        elif len(checksums) != n:
            raise ValueError(f"{len(checksums)} checksums for {n} blocks")
        async with self._slots.setdefault(addr, asyncio.Semaphore(self.max_connections_per_address)):
            conn = await self._checkout(addr)
            staged: Staged | None = None
            try:
                staged = self._stage(backend, payload, conn.local_host)
                sealed = self.seal and conn.tls and staged.inline is not None and version >= SEALED
                header = TransferHeader(TransferId(transfer_id), backend.name, layout, tuple(block_keys), num_tokens,
                                        tuple(checksums), staged.source, layers, first_block, token,
                                        Seal.new(len(payload)) if sealed else None)
                reply = await self._exchange(conn, self.codec.encode(header, version), staged, header.seal)
            except BaseException as e:
                conn.close()
                if staged is not None:
                    (staged.abandon or staged.release)()
                if isinstance(e, ssl.SSLError):  # the server refused our certificate after the handshake
                    raise _tls_failed(addr, e) from e
                raise
            staged.release()
            self._checkin(addr, conn)
        if not reply.ok:
            raise TransferRejected(reply.reason, reply.kind)
        seconds = time.perf_counter() - started
        return TransferStats(len(payload), seconds, len(payload) / seconds / 1e9)

    async def close(self) -> None:
        for backend in self._backends.values():
            backend.close()
        for conns in self._idle.values():
            for conn, _ in conns:
                conn.close()
        self._idle.clear()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _stage(self, backend: Backend, payload: memoryview, local_host: str) -> Staged:
        """Make the (already checksummed) payload reachable by the receiver. Tests override this to corrupt
        bytes in flight."""
        return backend.stage(payload, local_host)

    async def _exchange(self, conn: Conn, raw: bytes, staged: Staged, seal: Seal | None = None) -> Reply:
        try:
            await conn.sendall(PREFIX.pack(MAGIC, len(raw)) + raw)
            if staged.inline is not None and seal is not None:
                await conn.send_sealed(staged.inline, seal)
            elif staged.inline is not None:
                await conn.sendall(staged.inline)
        except (ConnectionResetError, BrokenPipeError) as e:
            # a receiver that refuses up front (a plain-text sender at a TLS endpoint, an unreadable header)
            # replies and closes while the payload is still going out: its reply is what to raise, if it came
            try:
                async with asyncio.timeout(1.0):
                    return await read_reply(conn)
            except (OSError, EOFError, TimeoutError, ValueError):
                raise e from None
        async with asyncio.timeout(self.reply_timeout):
            return await read_reply(conn)

    def _backend(self, name: str) -> Backend:
        if name not in self._backends:
            self._backends[name] = get_backend(name)
        return self._backends[name]

    async def _checkout(self, addr: Address) -> Conn:
        idle = self._idle.get(addr, [])
        while idle:
            conn, since = idle.pop()
            if time.monotonic() - since < IDLE_REUSE_S and conn.reusable():
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM)
        family, type_, proto, _, sockaddr = infos[0]
        sock = socket.socket(family, type_, proto)
        try:
            configure(sock)
            async with asyncio.timeout(self.connect_timeout):
                await loop.sock_connect(sock, sockaddr)
                if self.tls is None:
                    return Conn(sock)
                return await TlsConn.handshake(sock, self.tls.context, server_side=False,
                                               server_name=self.tls.server_name or addr.host)
        except ssl.SSLError as e:
            sock.close()
            raise _tls_failed(addr, e) from e
        except BaseException:
            sock.close()
            raise

    def _checkin(self, addr: Address, conn: Conn) -> None:
        idle = self._idle.setdefault(addr, [])
        if len(idle) < self.max_idle_per_address:
            idle.append((conn, time.monotonic()))
        else:
            conn.close()


def _tls_failed(addr: Address, e: ssl.SSLError) -> ConnectionError:
    return ConnectionError(f"TLS with the transfer endpoint {addr} failed: {e} (both ends need certificates from "
                           "the same CA: [shared] tls_ca, tls_cert, tls_key)")


def _num_blocks(layout: KVLayout, payload: memoryview, layers: tuple[int, int] | None = None) -> int:
    """How many whole blocks (or block slices of ``layers``) ``payload`` holds; ValueError when none, when it
    ends inside one, or when ``layers`` is no range of the layout's layers."""
    if layers is not None and not 0 <= layers[0] < layers[1] <= layout.num_layers:
        raise ValueError(f"layers {layers} is no range of the layout's {layout.num_layers} layers")
    unit = layout.layers_nbytes(layers)
    n, rest = divmod(len(payload), unit)
    if n == 0 or rest:
        raise ValueError(f"a payload of {len(payload)} bytes is not n>0 whole blocks of {unit} "
                         f"bytes ({layout.block_shape} x {layout.dtype}, layers {layers or 'all'})")
    return n


def _check_request(transfer_id: str, layout: KVLayout, n: int, block_keys: Sequence[BlockKey],
                   num_tokens: int) -> None:
    if not transfer_id:
        raise ValueError("transfer_id must not be empty")
    if len(block_keys) > n:
        raise ValueError(f"{len(block_keys)} block keys for {n} blocks (keys name full blocks only)")
    if not 0 < num_tokens <= n * layout.block_size:
        raise ValueError(f"num_tokens {num_tokens} does not fit {n} blocks of {layout.block_size} tokens")
