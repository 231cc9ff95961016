"""Blocks held for someone outside the engine, by lease id: pins (cached blocks a decode call keeps on the device
until its delta push is imported) and reservations (device blocks set aside for a push received in place).

- A pin holds a reference on each pinned node, so eviction cannot take it; ``unpin`` lets go.
- A reserved block belongs to its lease alone: not free, in no sequence, not in the tree, so the engine never
  reads or writes it; someone else fills it until an import ``take``s it into a sequence or ``release`` frees
  it, its bytes unpublished.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from kvmesh.engine.radix import Node, RadixTree
from kvmesh.engine.tiers import Tiers


class Leases:
    def __init__(self, tree: RadixTree, tiers: Tiers) -> None:
        self.tree = tree
        self.tiers = tiers
        self._pins: dict[str, list[Node]] = {}  # lease id -> the device nodes it holds a reference on
        self._reserved: dict[str, list[int]] = {}  # lease id -> device blocks reserved for it

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks held by pins, counted once per lease."""
        return sum(len(nodes) for nodes in self._pins.values())

    @property
    def num_reserved_blocks(self) -> int:
        return sum(len(ids) for ids in self._reserved.values())

    @property
    def num_leases(self) -> int:
        return len(self._pins) + len(self._reserved)

    def pin(self, lease: str, seed: int, tokens: Seq[int], max_blocks: int) -> int:
        """Hold the leading full blocks of ``tokens`` that are on the device (at most ``max_blocks``) under
        ``lease`` until :meth:`unpin`. Returns how many are held; a lease id already held is released first."""
        self.unpin(lease)
        m = self.tree.match(seed, tokens, max_blocks * self.tree.block_size)
        nodes: list[Node] = []
        for node in m.nodes[:max_blocks]:
            if node.block_id is None:  # on the host only: a later import would have to load it; stop here
                break
            node.ref_count += 1
            nodes.append(node)
        if nodes:
            self._pins[lease] = nodes
        return len(nodes)

    def unpin(self, lease: str) -> None:
        """Release a pin (nothing when it is not held)."""
        for node in self._pins.pop(lease, ()):
            self.tiers.unref(node)

    def reserve(self, lease: str, n: int) -> list[int] | None:
        """Take ``n`` device blocks (evicting cached ones if needed) for KV written into them from outside the
        engine, held under ``lease`` until :meth:`take` or :meth:`release`. Their ids, or None (nothing held)
        when the pool cannot make room. A lease already holding a reservation releases it first."""
        self.release(lease)
        ids = self.tiers.allocate(n)
        if not ids:
            return None
        self._reserved[lease] = ids
        return list(ids)

    def take(self, lease: str) -> list[int] | None:
        """The reservation's blocks, handed over (the lease ends); None when ``lease`` holds none."""
        return self._reserved.pop(lease, None)

    def release(self, lease: str) -> None:
        """Free a reservation's blocks (nothing when ``lease`` holds none). What landed in them was never
        published: it is garbage from now on. The caller has stopped every write into them first."""
        self.tiers.free_blocks.extend(self._reserved.pop(lease, ()))
