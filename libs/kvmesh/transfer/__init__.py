"""KV transfer engine (Mooncake Transfer Engine's role): prefill pushes a request's KV blocks, decode receives
and verifies them before anything is consumed.

    server = await TransferServer.start(layout)                     # decode side
    stats = await TransferClient().push(server.address, "req-1", layout, blocks, keys, num_tokens)  # prefill
    received = await server.take("req-1", timeout=5.0)              # verified blocks, or TransferRejected

Backends (``tcp``, ``shm``, ``mooncake``) are chosen by the server and travel in its address
(``"<backend>://host:port"``); see :mod:`kvmesh.transfer.backends`.
"""

from kvmesh.transfer.client import TransferClient, TransferStats
from kvmesh.transfer.errors import TransferRejected
from kvmesh.transfer.server import ReceivedBlocks, TransferServer

__all__ = ["ReceivedBlocks", "TransferClient", "TransferRejected", "TransferServer", "TransferStats"]
