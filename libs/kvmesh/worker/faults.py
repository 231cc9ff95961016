"""Fault injection for the fault tests (``fault_*`` worker settings): what a broken network or a stuck peer does
to a KV push, produced on purpose so the tests can show decode never consumes it and never waits forever."""

from __future__ import annotations

import asyncio

from kvmesh.transfer import TransferClient
from kvmesh.transfer.backends import Backend, Staged

STALL_S = 60.0  # longer than any kv_timeout_s a test uses: the push is as good as lost


class FaultyTransferClient(TransferClient):
    """Flips one byte of the first ``corrupt`` payloads after they were checksummed, i.e. on the wire."""

    def __init__(self, corrupt: int) -> None:
        super().__init__()
        self.corrupt = corrupt

    def _stage(self, backend: Backend, payload: memoryview, local_host: str) -> Staged:
        if self.corrupt > 0:
            self.corrupt -= 1
            raw = bytearray(payload)
            raw[len(raw) // 2] ^= 0x5A
            payload = memoryview(raw)
        return super()._stage(backend, payload, local_host)


class Stalls:
    """The first ``n`` pushes stall for ``STALL_S`` after their ``kv.ready`` went out."""

    def __init__(self, n: int) -> None:
        self.n = n

    def take(self) -> bool:
        if self.n <= 0:
            return False
        self.n -= 1
        return True

    @staticmethod
    async def stall() -> None:
        await asyncio.sleep(STALL_S)
