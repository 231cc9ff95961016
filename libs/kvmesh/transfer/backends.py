"""Transfer backends: how the payload's bytes get from the sender's memory into the receiver's buffer.

The control connection (header, reply) is always TCP; a backend decides only where the payload travels.

| backend | sender | receiver |
|---|---|---|
| ``tcp`` | streams the bytes after the header | ``recv_into`` straight into the result tensor |
| ``shm`` | copies them into a POSIX shared-memory segment, sends its name | reads the segment into the result, unlinks it |
| ``mooncake`` | registers its tensor with the Mooncake Transfer Engine | one-sided read from the sender's memory |

Ownership: the sender owns whatever it staged and releases it after the reply, whatever the outcome; a receiver
that consumed a shm segment unlinks it early. So no segment outlives a push, failed or not.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any, ClassVar

import torch

from kvmesh.transfer.errors import TransferRejected
from kvmesh.transfer.header import TransferHeader
from kvmesh.transfer.wire import recv_into, tensor_bytes

BACKENDS = ("tcp", "shm", "mooncake")


@dataclass
class Staged:
    """A payload made reachable by the receiver: ``source`` goes into the header, ``inline`` bytes (if any)
    follow it on the control connection, ``release`` frees what staging took."""

    source: dict[str, Any] = field(default_factory=dict)
    inline: memoryview | None = None
    release: Callable[[], None] = lambda: None


class Backend(ABC):
    name: ClassVar[str]
    inline: ClassVar[bool] = False  # does the payload follow the header on the control connection?

    @abstractmethod
    def stage(self, payload: torch.Tensor, local_host: str) -> Staged:
        """Sender side. ``payload`` is a flat contiguous uint8 CPU tensor that stays alive until release."""

    @abstractmethod
    async def fetch(self, header: TransferHeader, sock: socket.socket, into: torch.Tensor,
                    view: memoryview) -> None:
        """Receiver side: fill ``into`` (flat uint8, ``header.nbytes``; ``view`` is its bytes). Raises TransferRejected when the
        source cannot be read (the connection stays usable), ConnectionError/TimeoutError when it broke."""


class TcpBackend(Backend):
    name = "tcp"
    inline = True

    def stage(self, payload: torch.Tensor, local_host: str) -> Staged:
        return Staged(inline=tensor_bytes(payload))

    async def fetch(self, header: TransferHeader, sock: socket.socket, into: torch.Tensor,
                    view: memoryview) -> None:
        await recv_into(sock, view)


class ShmBackend(Backend):
    """Same host only (Linux ``/dev/shm``). The receiver reads the segment as a file, so it never registers it
    with multiprocessing's resource tracker; the sender's tracker still unlinks it if the sender dies."""

    name = "shm"
    SEGMENT = re.compile(r"kvmesh_[0-9a-f]{32}")
    ROOT = "/dev/shm"

    def stage(self, payload: torch.Tensor, local_host: str) -> Staged:
        n = payload.numel()
        shm = SharedMemory(name=f"kvmesh_{uuid.uuid4().hex}", create=True, size=n)
        try:
            shm.buf[:n] = tensor_bytes(payload)
        except BaseException:
            _unlink(shm)
            raise
        return Staged(source={"segment": shm.name}, release=lambda: _unlink(shm))

    async def fetch(self, header: TransferHeader, sock: socket.socket, into: torch.Tensor,
                    view: memoryview) -> None:
        name = header.source.get("segment")
        if not isinstance(name, str) or not self.SEGMENT.fullmatch(name):
            raise TransferRejected(f"shm source names no valid segment: {header.source!r}")
        path = os.path.join(self.ROOT, name)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if size < header.nbytes:
                    raise TransferRejected(f"shm segment {name} holds {size} bytes, header says {header.nbytes}")
                while view:  # a tmpfs read of the whole segment normally returns at once
                    view = view[f.readinto(view):]
        except FileNotFoundError:
            raise TransferRejected(f"shm segment {name} not found: shm needs sender and receiver on one host")
        finally:
            _unlink_path(path)


def _unlink(shm: SharedMemory) -> None:
    shm.close()
    try:
        shm.unlink()
    except FileNotFoundError:  # the receiver consumed it; balance our resource-tracker registration
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


def _unlink_path(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def get_backend(name: str) -> Backend:
    """A backend by name; ``mooncake`` is imported only when asked for."""
    if name == "tcp":
        return TcpBackend()
    if name == "shm":
        return ShmBackend()
    if name == "mooncake":
        from kvmesh.transfer.mooncake_backend import MooncakeBackend

        return MooncakeBackend()
    raise ValueError(f"unknown transfer backend {name!r}; choose one of {BACKENDS}")
