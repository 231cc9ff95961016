"""Framing on the control connection (the connection itself: :mod:`kvmesh.transfer.conn`).

Request: ``b"KVMT" | u32 header length (LE) | header JSON | payload`` (the payload only for backends that
stream it inline, i.e. ``tcp``). Reply: ``u32 length | {"ok": bool, "reason": str, "kind": str}`` (``kind``: a
refusal's :class:`~kvmesh.transfer.errors.Refusal`). One request, one reply, in order; a connection carries any
number of them.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import TYPE_CHECKING, NamedTuple

from kvmesh.contracts.ids import TransferBackend
from kvmesh.transfer.errors import Refusal, TransferRejected

if TYPE_CHECKING:
    from kvmesh.transfer.conn import Conn

MAGIC = b"KVMT"
PREFIX = struct.Struct("<4sI")
REPLY_PREFIX = struct.Struct("<I")
MAX_REPLY_BYTES = 64 << 10
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers one scatter syscall takes


class PeerClosed(ConnectionError):
    """The peer closed the connection before a whole frame arrived."""


class Reply(NamedTuple):
    ok: bool
    reason: str = ""
    kind: Refusal = Refusal.OTHER  # a refusal's label


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
    body = json.dumps({"ok": reply.ok, "reason": reply.reason, "kind": reply.kind}).encode()
    return REPLY_PREFIX.pack(len(body)) + body


def refusal_reply(e: TransferRejected) -> bytes:
    return encode_reply(Reply(False, e.reason, e.kind))


_KINDS = frozenset(Refusal)  # a set made per reply cost 2.5 µs of every push


def decode_reply(body: bytes) -> Reply:
    doc = json.loads(body)
    kind = doc.get("kind")
    return Reply(bool(doc["ok"]), str(doc.get("reason", "")),
                 Refusal(kind) if kind in _KINDS else Refusal.OTHER)


def configure(sock: socket.socket) -> None:
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def read_reply(conn: Conn) -> Reply:
    (length,) = REPLY_PREFIX.unpack(await conn.recv_bytes(REPLY_PREFIX.size))
    if length > MAX_REPLY_BYTES:
        raise ConnectionError(f"reply of {length} bytes: the peer is no kvmesh transfer server")
    return decode_reply(bytes(await conn.recv_bytes(length)))
