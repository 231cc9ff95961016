"""A request's pushed KV put back together from its parts, each a verified transfer that holds some of the
prompt's blocks (from its header's ``first_block``): whole, or (``layers``) their slice of a layer group, as
prefill pushes them while the forward pass computes.

The request is loadable only when every (block, layer) from the push's first block to the prompt's last block
is covered exactly once, and every part's block keys are this prompt's: a missing layer group is a reason to
recompute, never a half-loaded block.

A part received in place (``landed``) is already where the import wants it (the blocks the request reserved):
it only covers its cells. A buffered one is handed to the engine with its bytes (``KVPart``), to be copied in."""

from __future__ import annotations

import numpy as np

from kvmesh.contracts.engine import KVPart
from kvmesh.contracts.ids import BlockKey
from kvmesh.contracts.layout import KVLayout
from kvmesh.transfer.server import ReceivedBlocks


class Assembly:
    """Blocks ``first_block ..`` of a prompt of ``prompt_tokens`` tokens whose full blocks have keys
    ``keys`` (all of them, from the prompt's first block), filled in part by part."""

    def __init__(self, layout: KVLayout, first_block: int, prompt_tokens: int, keys: list[BlockKey]) -> None:
        self.layout, self.first, self.prompt_tokens, self.keys = layout, first_block, prompt_tokens, keys
        self.end = -(-prompt_tokens // layout.block_size)
        self.covered = np.zeros((max(0, self.end - first_block), layout.num_layers), dtype=bool)
        self.parts: list[KVPart] = []
        self.landed_bytes = 0

    def add(self, got: ReceivedBlocks) -> None:
        """Place one part; ValueError saying why it does not belong to this prompt's push."""
        bs, b0, n = self.layout.block_size, got.first_block, got.num_blocks
        lo, hi = got.layers or (0, self.layout.num_layers)
        if b0 < self.first or b0 + n > self.end:
            raise ValueError(f"part {got.transfer_id} holds blocks {b0}..{b0 + n - 1}, outside the push's "
                             f"{self.first}..{self.end - 1}")
        tokens_end = b0 * bs + got.num_tokens  # only the prompt's last block may be partly filled
        if tokens_end > self.prompt_tokens or (tokens_end != self.prompt_tokens and tokens_end != (b0 + n) * bs):
            raise ValueError(f"part {got.transfer_id} ends at token {tokens_end}, not at a block's end or the "
                             f"prompt's ({self.prompt_tokens})")
        if list(got.block_keys) != self.keys[b0:tokens_end // bs]:
            raise ValueError(f"part {got.transfer_id}: block keys differ")
        cells = self.covered[b0 - self.first:b0 - self.first + n, lo:hi]
        if cells.any():
            raise ValueError(f"part {got.transfer_id} holds layers {lo}..{hi - 1} of blocks another part holds")
        cells[:] = True
        if got.landed:
            self.landed_bytes += got.nbytes
            self.parts.append(KVPart(b0, n, got.layers))
        else:
            self.parts.append(KVPart(b0, n, got.layers, memoryview(got.data)))

    def missing(self) -> str:
        """What is not covered yet ("" when every (block, layer) is)."""
        if self.covered.all():
            return ""
        blocks, layers = np.nonzero(~self.covered)
        return (f"{len(blocks)} (block, layer) slices never arrived (first: block {self.first + int(blocks[0])}, "
                f"layer {int(layers[0])})")
