"""The blocks a Decode call reserves for the KV prefill will push, so the push lands straight in the KV pool:
no receive buffer, no copy at import (the engine adopts the blocks as they are).

Lifecycle (one per Decode call that expects a push; its lease is the call's own):
1. :meth:`Reservation.acquire`: the engine thread takes the blocks (``BlockManager.reserve``), then the transfer
   server gets a ``Landing`` over them under the request's hand-off prefix; its parts land in them from then on.
2. :meth:`Reservation.hand_over`, once every (block, layer) is verified: the landing is revoked (no more writes)
   and the import adopts the blocks (``kv_cache.Landed``).
3. :meth:`Reservation.release`, always, as the call ends (after a deadline, a rejected or missing part, a failed
   prefill, a cancelled client, or the import): the landing is revoked first, on the event loop, which is
   where every write into it happens, so no byte reaches those blocks after it returns; then, in order on
   the engine thread, the blocks are freed (nothing when the import adopted them). A reserve still on its way
   to the engine when the call was cancelled is released the same way: commands run in order."""

from __future__ import annotations

import itertools

from kvmesh.contracts.ids import handoff_prefix
from kvmesh.instance.host import EngineHost
from kvmesh.transfer.landing import Landing

_calls = itertools.count()


class Reservation:
    """Blocks ``first_block ..`` of a prompt of ``prompt_tokens`` tokens, for the request ``request_id``."""

    def __init__(self, host: EngineHost, request_id: str, first_block: int, prompt_tokens: int) -> None:
        self.w, self.request_id, self.first_block = host, request_id, first_block
        self.lease = f"{request_id}#reserve{next(_calls)}"  # this call's own, even if the request id repeats
        self.num_blocks = -(-prompt_tokens // host.layout.block_size) - first_block
        self.block_ids: list[int] = []
        self.landing: Landing | None = None
        self._asked = False

    async def acquire(self) -> bool:
        """Reserve the blocks and open the landing; False (the push is buffered, as without) when receiving in
        place is off, the pool is not in process memory, or it has no room."""
        w, transfer = self.w, self.w.transfer_server
        arrays = w.engine.engine.kv.landing_arrays()
        if not w.cfg.receive_in_place or transfer is None or arrays is None or self.num_blocks <= 0:
            return False
        self._asked = True
        lease, n = self.lease, self.num_blocks
        ids = await w.engine.call(lambda e: e.blocks.reserve(lease, n))
        if ids is None:
            return False
        self.block_ids = ids
        self.landing = Landing(*arrays, ids, self.first_block)
        transfer.land(handoff_prefix(self.request_id), self.landing)
        return True

    def hand_over(self) -> None:
        """Nothing more lands in the blocks: the engine may adopt them."""
        self._unland()

    def release(self) -> None:
        """Stop every write into the blocks, then free them (unless adopted). Idempotent."""
        self._unland()
        if self._asked:
            lease = self.lease
            self.w.engine.submit(lambda e: e.blocks.release_reserved(lease))
            self._asked = False

    def _unland(self) -> None:
        if self.landing is not None and self.w.transfer_server is not None:
            self.w.transfer_server.unland(handoff_prefix(self.request_id), self.landing)
