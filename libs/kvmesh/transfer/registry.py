"""Transfer backends by name: ``tcp`` and ``shm`` here, ``mooncake`` imported only when asked for (its package is an
optional extra), so the backends module never imports its own extension back."""

from __future__ import annotations

from kvmesh.contracts.ids import TransferBackend, choices
from kvmesh.transfer.backends import Backend, ShmBackend, TcpBackend


def get_backend(name: TransferBackend | str) -> Backend:
    """A backend by name; ``mooncake`` is imported only when asked for."""
    if name == TransferBackend.TCP:
        return TcpBackend()
    if name == TransferBackend.SHM:
        return ShmBackend()
    if name == TransferBackend.MOONCAKE:
        from kvmesh.transfer.mooncake_backend import MooncakeBackend

        return MooncakeBackend()
    raise ValueError(f"unknown transfer backend {name!r}; choose one of {choices(TransferBackend)}")
