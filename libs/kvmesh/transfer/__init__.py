"""KV transfer engine (Mooncake Transfer Engine's role): prefill pushes a request's KV blocks, decode receives
and verifies them before anything is consumed.

    server = await TransferServer.start(layout)                     # decode side
    grant = server.grant("req-1", 0, 3, timeout_s=10.0)             # it expects 3 blocks under "req-1"
    stats = await TransferClient().push(server.address, "req-1", layout, blocks, keys, num_tokens,
                                        token=grant.token)          # prefill, handed the token
    received = await server.take("req-1", timeout=5.0)              # verified blocks, or TransferRejected

A push needs the capability its receiver issued (:mod:`kvmesh.transfer.grants`); the control connection is TLS
when both ends are given the mesh's certificates (:mod:`kvmesh.transfer.conn`). Backends (``tcp``, ``shm``,
``mooncake``) are chosen by the server and travel in its address (``"<backend>://host:port"``); see
:mod:`kvmesh.transfer.backends`.
"""

from kvmesh.transfer.client import TransferClient, TransferStats
from kvmesh.transfer.conn import ClientTLS
from kvmesh.transfer.errors import Refusal, TransferRejected
from kvmesh.transfer.grants import Grant
from kvmesh.transfer.server import Limits, ReceivedBlocks, TransferServer

__all__ = ["ClientTLS", "Grant", "Limits", "ReceivedBlocks", "Refusal", "TransferClient", "TransferRejected",
           "TransferServer", "TransferStats"]
