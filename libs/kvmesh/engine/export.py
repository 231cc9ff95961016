"""How a request's KV leaves the engine: one strategy per request, chosen by its ``ExportPlan``.

- ``AtEnd``: the blocks from the plan's first block, read out when the request finishes (decode's write-back; a
  prefill without pieces).
- ``ByChunk``: after each prefill chunk's forward pass, its newly full blocks; the rest (at least the last block)
  when it finishes.
- ``ByLayerGroup``: during each chunk's forward pass, its blocks (the last chunk's partial block too) layer group by
  layer group, each as soon as the pass wrote those layers; nothing is left for the finish.

The engine asks the strategy three questions and reads out what it answers (``KVReader``): what to read out during
the pass (``during_pass``), after the pass (``after_pass``), and at the finish (``at_finish``). The strategy keeps
the one piece of state: the next block not read out yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.contracts.engine import ExportPieces, ExportPlan, layer_bounds
from kvmesh.contracts.keys import BlockKey, block_keys
from kvmesh.engine.sequence import Sequence


@dataclass
class KVReadout:
    """A request's blocks read out of the pool (torch, in the pool's storage dtype): ``blocks`` ``[n,
    *layout.block_shape]`` (or each block's slice of ``layers``) are its blocks ``first_block ..``."""

    blocks: torch.Tensor
    num_tokens: int                # tokens of the request whose KV is computed (from its start)
    block_keys: list[BlockKey]     # keys of all its full blocks up to num_tokens, from the first
    first_block: int = 0
    final: bool = True             # False: a piece read out mid-prefill; more follow
    layers: tuple[int, int] | None = None  # (first, end): the blocks' slice of these layers only; None: all


@dataclass
class LayerExport:
    """One chunk's blocks ``first .. end-1`` read out group by group during its forward pass: ``bounds`` are the
    groups' end layers, ``done`` the layers read out so far."""

    seq: Sequence
    first: int
    end: int
    num_tokens: int        # tokens of the request whose KV the chunk completes (from its start)
    block_keys: list[BlockKey]  # keys of the request's full blocks up to num_tokens
    bounds: tuple[int, ...]
    done: int = 0
    error: Exception | None = None


class Export:
    """``AtEnd``: the blocks from ``next_block`` on when the request finishes."""

    def __init__(self, plan: ExportPlan) -> None:
        self.next_block = plan.first_block  # the first block not read out yet

    def during_pass(self, seq: Sequence, n: int, block_size: int, num_layers: int) -> LayerExport | None:
        """The blocks of the chunk of ``n`` tokens about to be computed to read out during its pass, if any."""
        return None

    def after_pass(self, seq: Sequence, block_size: int) -> tuple[int, int] | None:
        """``(first block, tokens)`` to read out after a chunk that left the prompt unfinished, if any."""
        return None

    def passed(self, x: LayerExport) -> None:
        """A chunk's layer groups were all read out."""
        self.next_block = x.end

    def at_finish(self, seq: Sequence, block_size: int) -> int:
        """The first block to read out when the request finishes (through its last computed token): at least
        the last block (it holds the token the request finished on) unless everything left already."""
        last = -(-seq.num_computed_tokens // block_size)
        return min(self.next_block, max(0, last - 1))


class ByChunk(Export):
    def after_pass(self, seq: Sequence, block_size: int) -> tuple[int, int] | None:
        full = seq.num_computed_tokens // block_size
        if full <= self.next_block:
            return None
        first, self.next_block = self.next_block, full
        return first, full * block_size


class ByLayerGroup(ByChunk):
    def __init__(self, plan: ExportPlan) -> None:
        super().__init__(plan)
        self.groups = plan.layer_groups
        self.all_left = False  # the last chunk left in layer groups: nothing is left for the finish

    def during_pass(self, seq: Sequence, n: int, block_size: int, num_layers: int) -> LayerExport | None:
        after = seq.num_computed_tokens + n
        last = after == seq.num_tokens
        end = -(-after // block_size) if last else after // block_size  # the last chunk: its partial block too
        if end <= self.next_block:
            return None
        keys = block_keys(seq.namespace_seed, seq.all_token_ids[:after], block_size)
        return LayerExport(seq, self.next_block, end, after, keys, layer_bounds(num_layers, self.groups))

    def passed(self, x: LayerExport) -> None:
        super().passed(x)
        self.all_left = x.num_tokens == x.seq.num_tokens

    def at_finish(self, seq: Sequence, block_size: int) -> int:
        return -(-seq.num_computed_tokens // block_size) if self.all_left else super().at_finish(seq, block_size)


STRATEGIES: dict[ExportPieces, type[Export]] = {
    ExportPieces.AT_END: Export, ExportPieces.BY_CHUNK: ByChunk, ExportPieces.BY_LAYER_GROUP: ByLayerGroup}


def make_export(plan: ExportPlan | None) -> Export | None:
    """The strategy of ``plan`` (None: the request's KV is not read out). ``BY_LAYER_GROUP`` with one group is
    ``BY_CHUNK``: whole blocks after each chunk."""
    if plan is None:
        return None
    pieces = plan.pieces
    if pieces is ExportPieces.BY_LAYER_GROUP and plan.layer_groups < 2:
        pieces = ExportPieces.BY_CHUNK
    return STRATEGIES[pieces](plan)
