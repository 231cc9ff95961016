"""Receiving in place: the parts of one request's KV hand-off land straight in the receiver's own memory (decode:
the blocks of its KV pool it reserved for the request), never in a buffer of their own.

Byte order. A part holds its blocks one after another; each block its layers (all, or the header's ``layers``
slice), each layer K then V (``KVLayout.block_shape``: ``[layers, 2, block_size, heads, dim]``). The pool keeps K
and V apart, each ``[layers, pool blocks, block_size * heads * dim]``, so a part lands as one run of bytes per
(block, layer, K|V): :meth:`Landing.claim` lists those runs in wire order and the backend scatters the payload
into them (tcp: ``recvmsg_into``; shm: ``preadv``). The wire format is the buffered path's, unchanged.

Ownership (the rule that keeps late bytes out of reused blocks). The memory belongs to the receiver's owner
(decode's reservation); a :class:`Landing` only lends it to the transfer server until :meth:`Landing.revoke`.
Every write into it happens on the server's event loop, inside a non-blocking syscall that is issued only after
checking :attr:`Landing.open` with no ``await`` in between. ``revoke`` runs on that loop too, so once it returns
no write is in progress and none will start: a receive still under way reads the rest of its payload into a
scratch buffer and is refused. The owner may then give the memory to someone else."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmesh.transfer.errors import Refusal, TransferRejected
from kvmesh.transfer.header import TransferHeader


class Landing:
    """Destination memory for the blocks ``first_block ..`` of one request's hand-off: ``block_ids[i]`` is where
    block ``first_block + i`` lands in ``k`` and ``v`` (``uint8`` arrays ``[layers, pool blocks, bytes of one
    layer's K (or V) of a block]``, writable, kept alive by the owner until it revoked the landing).

    Each (block, layer) is claimed by at most one part, once: a part that overlaps one claimed before (a
    duplicate, or a retry after a corrupted one, whose bytes are garbage) is refused, so nothing ever writes
    over bytes another part landed."""

    def __init__(self, k: np.ndarray, v: np.ndarray, block_ids: Sequence[int], first_block: int) -> None:
        if k.shape != v.shape or k.dtype != np.uint8 or k.ndim != 3:
            raise ValueError("k and v must be uint8 arrays of one shape [layers, blocks, bytes]")
        self.first_block = first_block
        self.block_ids = list(block_ids)
        self.num_layers, self._pool_blocks, self.unit = k.shape
        self._k: memoryview | None = k.reshape(-1).data  # flat: a view of the pool, never a copy
        self._v: memoryview | None = v.reshape(-1).data
        self.claimed = np.zeros((len(self.block_ids), self.num_layers), dtype=bool)
        self.landed_bytes = 0  # verified parts' bytes (the server counts them)
        self.handoff: str | None = None  # the hand-off whose parts land here (the first to arrive)

    @property
    def open(self) -> bool:
        """True until :meth:`revoke`: writes into the memory are allowed."""
        return self._k is not None

    @property
    def end_block(self) -> int:
        return self.first_block + len(self.block_ids)

    def admits(self, transfer_id: str) -> bool:
        """Whether the part ``transfer_id`` (``<hand-off id>#<n>``) lands here: the first hand-off to arrive
        binds the landing, another one's parts (a retry on another prefill, say) are received into buffers."""
        handoff = transfer_id.rpartition("#")[0] or transfer_id
        if self.handoff is None:
            self.handoff = handoff
        return self.handoff == handoff

    def claim(self, header: TransferHeader) -> list[memoryview]:
        """Where ``header``'s payload lands, as views in wire order (one per block, layer and K|V), its cells
        claimed for it. TransferRejected (nothing claimed) when it cannot land here."""
        k, v = self._k, self._v
        if k is None or v is None:
            raise TransferRejected(f"transfer {header.transfer_id}: the blocks reserved for it were released",
                                   Refusal.DISCARDED)
        lo, hi = header.layers or (0, header.layout.num_layers)
        b0, n = header.first_block - self.first_block, header.num_blocks
        if header.layout.num_layers != self.num_layers or header.block_nbytes != (hi - lo) * 2 * self.unit:
            raise TransferRejected(f"transfer {header.transfer_id}: {header.block_nbytes} bytes per block do not "
                                   f"match the reserved blocks' {(hi - lo) * 2 * self.unit}", Refusal.LAYOUT)
        if b0 < 0 or b0 + n > len(self.block_ids):
            raise TransferRejected(f"transfer {header.transfer_id} holds blocks {header.first_block}.."
                                   f"{header.first_block + n - 1}, outside the ones reserved for it "
                                   f"({self.first_block}..{self.end_block - 1})", Refusal.BLOCKS)
        cells = self.claimed[b0:b0 + n, lo:hi]
        if cells.any():
            raise TransferRejected(f"transfer {header.transfer_id}: layers {lo}..{hi - 1} of its blocks were "
                                   "claimed by another part", Refusal.DUPLICATE)
        cells[:] = True
        unit, layer_stride = self.unit, self._pool_blocks * self.unit
        starts = [b * unit + layer * layer_stride for b in self.block_ids[b0:b0 + n] for layer in range(lo, hi)]
        return [m[s:s + unit] for s in starts for m in (k, v)]

    def revoke(self) -> None:
        """Take the memory back (call on the server's event loop): no write into it starts after this returns."""
        self._k = self._v = None
