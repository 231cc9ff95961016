"""Transfer backends: how the payload's bytes get from the sender's memory into the receiver's buffer.

The control connection (header, reply) is always TCP (TLS when configured: :mod:`kvmesh.transfer.conn`); a
backend decides only where the payload travels.

| backend | sender | receiver |
|---|---|---|
| ``tcp`` | streams the bytes after the header | ``recv_into`` straight into the result |
| ``shm`` | copies them into a shared-memory segment it reuses, sends its name | reads the segment |
| ``mooncake`` | registers its buffer with the Mooncake Transfer Engine | one-sided read from the sender |

In place (a ``ScatterBackend``; see :mod:`kvmesh.transfer.landing`): ``tcp`` scatters the stream into the
destination views with ``recvmsg_into`` (under TLS: opens each sealed chunk, or decrypts TLS records, into a staging
buffer and copies from there), ``shm`` reads the segment into them with ``preadv`` (one copy either way);
``mooncake`` receives into a buffer of its own (its reads need registered memory). Under TLS a ``tcp`` payload is
sealed (header version 3 and later, :mod:`kvmesh.transfer.seal`) or sent in TLS records (a version 2 peer); only
the control connection is encrypted for ``shm`` (the segment never leaves the host) and ``mooncake`` (its own data
path is plain).

Payloads are plain byte buffers (memoryviews): the library never needs to know what the bytes hold, so
cachesvc moves blocks without a model framework; the engine hands over zero-copy views of its tensors.

Ownership: the sender owns whatever it staged. After the reply the receiver is done with it, so ``release``
may reuse it; after a broken push the receiver may still be reading, so ``abandon`` never reuses it (shm
unlinks the segment, mooncake keeps the memory registered a while longer).
"""

from __future__ import annotations

import io
import os
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any, ClassVar

from kvmesh.contracts.ids import TransferBackend
from kvmesh.transfer.conn import Conn
from kvmesh.transfer.errors import Refusal, TransferRejected
from kvmesh.transfer.header import TransferHeader
from kvmesh.transfer.wire import IOV_MAX

Progress = Callable[[int], None]  # bytes of the payload in place so far


def _nothing() -> None:
    pass


@dataclass
class Staged:
    """A payload made reachable by the receiver: ``source`` goes into the header, ``inline`` bytes (if any)
    follow it on the control connection. Exactly one of ``release`` (a reply came) or ``abandon`` (the push
    broke; defaults to ``release``) is called."""

    source: dict[str, Any] = field(default_factory=dict)
    inline: memoryview | None = None
    release: Callable[[], None] = _nothing
    abandon: Callable[[], None] | None = None


class Backend(ABC):
    """One instance per client or server; the sender side is used from one event loop only."""

    name: ClassVar[TransferBackend]
    inline: ClassVar[bool] = False  # does the payload follow the header on the control connection?

    @abstractmethod
    def stage(self, payload: memoryview, local_host: str) -> Staged:
        """Sender side. ``payload`` is a flat byte view whose buffer stays alive until release."""

    @abstractmethod
    async def fetch(self, header: TransferHeader, conn: Conn, view: memoryview,
                    progress: Progress | None = None) -> None:
        """Receiver side: fill ``view`` (flat, writable, ``header.nbytes``). Raises TransferRejected when the
        source cannot be read (the connection stays usable), ConnectionError or TimeoutError when it broke.
        ``progress``: told how many of the payload's first bytes are in place, whenever a backend that fills it
        in steps completes one (the receiver verifies those blocks meanwhile)."""

    def close(self) -> None:
        """Free what the sender side keeps between pushes."""


class ScatterBackend(Backend):
    """A backend that can also receive in place, into memory the receiver lends (``tcp``, ``shm``)."""

    @abstractmethod
    async def fetch_landed(self, header: TransferHeader, conn: Conn, views: list[memoryview],
                           still_open: Callable[[], bool], progress: Progress | None = None) -> bool:
        """Receiver side, in place: fill ``views`` (the payload's destinations in wire order), asking
        ``still_open`` before every write with no ``await`` in between; False when it said no (nothing written
        after that, the payload consumed). Raises like :meth:`fetch`."""


class TcpBackend(ScatterBackend):
    name = TransferBackend.TCP
    inline = True

    def stage(self, payload: memoryview, local_host: str) -> Staged:
        return Staged(inline=payload)

    async def fetch(self, header: TransferHeader, conn: Conn, view: memoryview,
                    progress: Progress | None = None) -> None:
        if header.seal is not None:
            await conn.recv_sealed(view, header.seal, progress)
            return
        with conn.read_ahead():
            await conn.recv_into(view)

    async def fetch_landed(self, header: TransferHeader, conn: Conn, views: list[memoryview],
                           still_open: Callable[[], bool], progress: Progress | None = None) -> bool:
        if header.seal is not None:
            return await conn.recv_sealed_scatter(views, header.seal, still_open, progress)
        with conn.read_ahead():
            return await conn.recv_scatter(views, still_open)


async def skip_inline(conn: Conn, header: TransferHeader) -> None:
    """Read and drop the payload that follows ``header`` on ``conn`` (a refused ``tcp`` push), sealed or not, so the
    connection stays in sync."""
    if header.seal is not None:
        await conn.drain_raw(header.seal.sealed_nbytes(header.nbytes))
        return
    with conn.read_ahead():
        await conn.drain(header.nbytes)


class ShmBackend(ScatterBackend):
    """Same host only (Linux ``/dev/shm``). Fresh tmpfs pages cost a page fault each, so the sender keeps
    the segments it filled before and reuses them (at most ``max_idle_segments`` / ``max_idle_bytes`` idle;
    all unlinked by :meth:`close`, and by multiprocessing's resource tracker if the sender dies). The receiver
    reads a segment as a file, never registering or unlinking it."""

    name = TransferBackend.SHM
    SEGMENT = re.compile(r"kvmesh_[0-9a-f]{32}")
    ROOT = "/dev/shm"

    def __init__(self, max_idle_segments: int = 4, max_idle_bytes: int = 256 << 20) -> None:
        self.max_idle_segments = max_idle_segments
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[SharedMemory] = []

    def stage(self, payload: memoryview, local_host: str) -> Staged:
        n = len(payload)
        shm = self._checkout(n)
        try:
            assert shm.buf is not None
            shm.buf[:n] = payload
        except BaseException:
            _unlink(shm)
            raise
        return Staged(source={"segment": shm.name}, release=lambda: self._checkin(shm),
                      abandon=lambda: _unlink(shm))

    async def fetch(self, header: TransferHeader, conn: Conn, view: memoryview,
                    progress: Progress | None = None) -> None:
        with self._segment(header) as f:
            while view:  # a tmpfs read of the whole segment normally returns at once
                if not (got := f.readinto(view)):
                    raise TransferRejected(f"shm segment {header.source['segment']} shrank while being read",
                                           Refusal.BACKEND)
                view = view[got:]

    async def fetch_landed(self, header: TransferHeader, conn: Conn, views: list[memoryview],
                           still_open: Callable[[], bool], progress: Progress | None = None) -> bool:
        # no await from here to the end: every preadv runs in this one step of the event loop
        with self._segment(header) as f:
            at, fd = 0, f.fileno()
            for i in range(0, len(views), IOV_MAX):
                if not still_open():
                    return False
                batch = views[i:i + IOV_MAX]
                want = sum(len(v) for v in batch)
                if os.preadv(fd, batch, at) != want:  # tmpfs fills the whole batch (a memcpy) or the file shrank
                    raise TransferRejected(f"shm segment {header.source['segment']} shrank while being read",
                                           Refusal.BACKEND)
                at += want
        return True

    def _segment(self, header: TransferHeader) -> io.FileIO:
        """The segment ``header`` names, open for reading (at least ``header.nbytes`` long)."""
        name = header.source.get("segment")
        if not isinstance(name, str) or not self.SEGMENT.fullmatch(name):
            raise TransferRejected(f"shm source names no valid segment: {header.source!r}", Refusal.BACKEND)
        try:
            f = open(os.path.join(self.ROOT, name), "rb", buffering=0)  # noqa: SIM115 (the caller closes it)
        except FileNotFoundError:
            raise TransferRejected(f"shm segment {name} not found: shm needs both ends on one host",
                                   Refusal.BACKEND) from None
        size = os.fstat(f.fileno()).st_size
        if size < header.nbytes:
            f.close()
            raise TransferRejected(f"shm segment {name} holds {size} bytes, not {header.nbytes}", Refusal.BACKEND)
        return f

    def close(self) -> None:
        while self._idle:
            _unlink(self._idle.pop())

    def _checkout(self, n: int) -> SharedMemory:
        fits = [shm for shm in self._idle if shm.size >= n]
        if fits:
            best = min(fits, key=lambda shm: shm.size)
            self._idle.remove(best)
            return best
        size = max(64 << 10, 1 << (n - 1).bit_length())  # powers of two, so varying sizes still reuse
        return SharedMemory(name=f"kvmesh_{uuid.uuid4().hex}", create=True, size=size)

    def _checkin(self, shm: SharedMemory) -> None:
        idle_bytes = sum(s.size for s in self._idle) + shm.size
        if len(self._idle) < self.max_idle_segments and idle_bytes <= self.max_idle_bytes:
            self._idle.append(shm)
        else:
            _unlink(shm)


def _unlink(shm: SharedMemory) -> None:
    shm.close()
    try:
        shm.unlink()
    except FileNotFoundError:  # someone else removed it; still balance our resource-tracker registration
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
