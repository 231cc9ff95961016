"""Framing on the control connection, and the zero-copy socket helpers both ends use.

Request: ``b"KVMT" | u32 header length (LE) | header JSON | payload`` (the payload only for backends that
stream it inline, i.e. ``tcp``). Reply: ``u32 length | {"ok": bool, "reason": str}``. One request, one reply,
in order; a connection carries any number of them.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
from collections.abc import Callable
from typing import NamedTuple

from kvmesh.contracts.ids import TransferBackend

MAGIC = b"KVMT"
PREFIX = struct.Struct("<4sI")
REPLY_PREFIX = struct.Struct("<I")
MAX_REPLY_BYTES = 64 << 10
_DRAIN_CHUNK = 1 << 20
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers one scatter syscall takes


class PeerClosed(ConnectionError):
    """The peer closed the connection before a whole frame arrived."""


class Reply(NamedTuple):
    ok: bool
    reason: str = ""


class Address(NamedTuple):
    backend: TransferBackend | str
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6
        return f"{self.backend}://{host}:{self.port}"


def parse_address(address: str) -> Address:
    """``"<backend>://<host>:<port>"``, as :attr:`TransferServer.address` prints it."""
    backend, sep, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"transfer address {address!r} is not '<backend>://<host>:<port>'")
    return Address(backend, host.strip("[]"), int(port))


def flat_bytes(payload: bytes | bytearray | memoryview) -> memoryview:
    """Any C-contiguous buffer (bytes, a memoryview, a numpy array) as a flat byte view, without copying."""
    view = memoryview(payload)
    if not view.c_contiguous:
        raise ValueError("the payload must be one C-contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def encode_reply(reply: Reply) -> bytes:
    body = json.dumps({"ok": reply.ok, "reason": reply.reason}).encode()
    return REPLY_PREFIX.pack(len(body)) + body


def decode_reply(body: bytes) -> Reply:
    doc = json.loads(body)
    return Reply(bool(doc["ok"]), str(doc.get("reason", "")))


def configure(sock: socket.socket) -> None:
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``: the kernel copies straight into it, no intermediate bytes objects."""
    loop = asyncio.get_running_loop()
    while view:
        n = await loop.sock_recv_into(sock, view)
        if n == 0:
            raise PeerClosed(f"peer closed the connection with {len(view)} bytes of the frame missing")
        view = view[n:]


async def recv_scatter(sock: socket.socket, views: list[memoryview], still_open: Callable[[], bool]) -> bool:
    """Fill ``views`` in order from ``sock``, up to ``IOV_MAX`` of them per ``recvmsg_into`` (the kernel copies
    straight into each). ``still_open`` is asked before every syscall, with no ``await`` in between: once it says
    False, nothing more is written into ``views``; the rest of the payload is read into scratch and dropped (the
    connection stays in sync) and the result is False. True: every view filled."""
    loop = asyncio.get_running_loop()
    i, offset = 0, 0  # the first view not yet full, and how much of it is
    left = sum(len(v) for v in views)
    while left:
        if not still_open():
            await drain(sock, left)
            return False
        batch = views[i:i + IOV_MAX]
        if offset:
            batch[0] = batch[0][offset:]
        try:
            n = sock.recvmsg_into(batch)[0]
        except (BlockingIOError, InterruptedError):
            await _readable(loop, sock)
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


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Until ``sock`` has bytes to read (or is closed)."""
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


async def recv_bytes(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    await recv_into(sock, memoryview(buf))
    return buf


async def drain(sock: socket.socket, n: int) -> None:
    """Read and drop ``n`` bytes, so a refused inline payload leaves the connection usable."""
    scratch = memoryview(bytearray(min(n, _DRAIN_CHUNK)))
    while n > 0:
        step = min(n, len(scratch))
        await recv_into(sock, scratch[:step])
        n -= step


async def read_reply(sock: socket.socket) -> Reply:
    (length,) = REPLY_PREFIX.unpack(await recv_bytes(sock, REPLY_PREFIX.size))
    if length > MAX_REPLY_BYTES:
        raise ConnectionError(f"reply of {length} bytes: the peer is no kvmesh transfer server")
    return decode_reply(bytes(await recv_bytes(sock, length)))
