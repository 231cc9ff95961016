"""The blocks a Decode call reserves for the KV prefill will push, so the push lands straight in the KV pool:
no receive buffer, no copy at import (the engine adopts the blocks as they are).

Lifecycle (one per Decode call that expects a push; its lease is the call's own):
1. :meth:`Reservation.acquire`: the engine sets the blocks aside (``Engine.reserve``) and lends their memory as a
   ``Landing``; the transfer server gets it under the request's hand-off prefix; parts land in it from then on.
2. :meth:`Reservation.hand_over`, once every (block, layer) is verified: the landing is revoked (no more writes)
   and the import adopts the blocks (``ImportedKV.reservation``).
3. :meth:`Reservation.release`, always, as the call ends (after a deadline, a rejected or missing part, a failed
   prefill, a cancelled client, or the import): the landing is revoked first, on the event loop, which is
   where every write into it happens, so no byte reaches those blocks after it returns; then the engine frees
   the blocks (``Engine.release``, queued in order with its other commands: nothing when the import adopted
   them). A reserve still on its way to the engine when the call was cancelled is released the same way."""

from __future__ import annotations

import itertools

from kvmesh.contracts.engine import EngineRequest
from kvmesh.contracts.ids import handoff_prefix
from kvmesh.instance.host import EngineHost
from kvmesh.transfer.landing import Landing

_calls = itertools.count()


class Reservation:
    """Blocks ``first_block ..`` of ``request``'s prompt, for its push."""

    def __init__(self, host: EngineHost, request: EngineRequest, first_block: int) -> None:
        self.w, self.request, self.first_block = host, request, first_block
        self.request_id = request.request_id
        self.lease = f"{self.request_id}#reserve{next(_calls)}"  # this call's own, even if the request id repeats
        self.num_blocks = -(-len(request.prompt) // host.layout.block_size) - first_block
        self.block_ids: list[int] = []
        self.landing: Landing | None = None
        self._asked = False

    async def acquire(self) -> bool:
        """Reserve the blocks and open the landing; False (the push is buffered, as without) when receiving in
        place is off, the engine's memory cannot be written from outside, or it has no room."""
        w, transfer = self.w, self.w.transfer_server
        if not w.cfg.receive_in_place or transfer is None or self.num_blocks <= 0:
            return False
        self._asked = True
        reserved = await w.engine.reserve(self.lease, self.request, self.first_block)
        if reserved is None or reserved.landing is None:
            return False
        self.block_ids = list(reserved.block_ids)
        self.landing = reserved.landing
        transfer.land(handoff_prefix(self.request_id), self.landing)
        return True

    def hand_over(self) -> None:
        """Nothing more lands in the blocks: the engine may adopt them."""
        self._unland()

    def release(self) -> None:
        """Stop every write into the blocks, then free them (unless adopted). Idempotent."""
        self._unland()
        if self._asked:
            self.w.engine.release(self.lease)
            self._asked = False

    def _unland(self) -> None:
        if self.landing is not None and self.w.transfer_server is not None:
            self.w.transfer_server.unland(handoff_prefix(self.request_id), self.landing)
