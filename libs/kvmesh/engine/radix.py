"""The prefix cache's index: per namespace, a radix tree of token blocks (one ``Node`` per cached block).

A full node holds ``block_size`` tokens and is keyed by its chained block key (``chain``); a *partial* node holds
fewer tokens (the computed tail of a finished request), is always a leaf, and is only ever copied, never shared.
Matching walks full blocks by their tokens, then takes the longest partial match among the last node's children,
so a prefix is reused at any token boundary. Where a node's block lives (device, host) is the tiers' business
(``engine/tiers.py``); the tree only says what is cached and under which parent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import NamedTuple

from kvmesh.contracts.ids import BlockKey
from kvmesh.contracts.keys import chain_key


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]
    parent: Node | None
    chain: int                      # the BlockKey of a full block; the namespace seed at a root
    full: bool
    block_id: int | None = None     # device block (L1)
    host_slot: int | None = None    # host block (L2)
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    ref_count: int = 0
    last_access: float = 0.0
    hit_count: int = 0
    priority: int = 0
    priority_until: float = math.inf
    depth: int = 0                  # full blocks before it in its chain
    extended: bool = False          # has had a child (not a request's tail)
    session_owner: str = ""         # the session that used it ("" none, ``sessions.SHARED`` several)
    replicated: bool = False        # another copy is in the cluster (cachesvc's word)
    prefetched: bool = False        # warmed back from the host for a paused session, not hit since

    @property
    def key(self) -> BlockKey:
        return BlockKey(self.chain)

    @property
    def parent_key(self) -> BlockKey | None:
        """The key of the full block before it (None at the start of a chain)."""
        return BlockKey(self.parent.chain) if self.parent is not None and self.parent.full else None

    def detach(self) -> Node:
        """Take this leaf out of its parent's children; returns the parent."""
        assert not self.children and self.parent is not None
        del self.parent.children[self.tokens]
        return self.parent


class PrefixMatch(NamedTuple):
    nodes: list[Node]        # matched full blocks, in order (device or host resident)
    partial: Node | None     # a block whose first ``partial_tokens`` tokens also match
    partial_tokens: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.nodes) * self.block_size + self.partial_tokens


def _common_prefix(a: tuple[int, ...], b: Seq[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class RadixTree:
    """The cached blocks of every namespace (a root per namespace seed)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._roots: dict[int, Node] = {}
        self.by_key: dict[int, Node] = {}  # every full node by its block key (what sessions and cachesvc name)
        self.quarantined: set[int] = set()  # keys whose KV the canary caught diverging, until they are rewritten

    def root(self, seed: int) -> Node:
        root = self._roots.get(seed)
        if root is None:
            root = self._roots[seed] = Node((), None, seed, False)
        return root

    def match(self, seed: int, tokens: Seq[int], max_tokens: int | None = None) -> PrefixMatch:
        """Longest cached prefix of ``tokens`` (at most ``max_tokens``), at any token boundary."""
        bs = self.block_size
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        node = self._roots.get(seed)
        nodes: list[Node] = []
        if node is None:
            return PrefixMatch(nodes, None, 0, bs)
        pos = 0
        while pos + bs <= limit:
            child = node.children.get(tuple(tokens[pos:pos + bs]))
            if child is None:
                break
            if child.chain in self.quarantined:  # its KV diverged from a recompute: never served again
                return PrefixMatch(nodes, None, 0, bs)
            nodes.append(child)
            node, pos = child, pos + bs
        best, best_len = None, 0
        rest = tokens[pos:limit]
        for child in node.children.values():
            n = _common_prefix(child.tokens, rest)
            if n > best_len and (child.block_id is not None or child.host_slot is not None):
                best, best_len = child, n
        return PrefixMatch(nodes, best, best_len, bs)

    def add_full(self, parent: Node, tokens: tuple[int, ...], block_id: int, t: float, depth: int) -> Node:
        """A new full block under ``parent``, on the device in ``block_id``. The caller removes the partial
        siblings it dominates first (``dominated_partials``)."""
        node = Node(tokens, parent, chain_key(parent.chain, tokens), True, block_id=block_id, last_access=t,
                    depth=depth)
        parent.children[tokens] = node
        parent.extended = True
        self.by_key[node.chain] = node
        self.quarantined.discard(node.chain)  # a fresh block under that key: rewritten
        return node

    def remove(self, node: Node) -> Node:
        """Take leaf ``node`` out of the tree; returns its parent."""
        if node.full:
            self.by_key.pop(node.chain, None)
        return node.detach()

    def add_partial(self, parent: Node, tokens: tuple[int, ...], block_id: int, t: float) -> Node | None:
        """A request's computed tail under ``parent``, in ``block_id``; None (nothing added: the caller frees
        the block) when a cached sibling already covers these tokens."""
        for sibling in parent.children.values():
            if sibling.tokens[:len(tokens)] == tokens and sibling.block_id is not None:
                return None
        node = Node(tokens, parent, 0, False, block_id=block_id, last_access=t)
        parent.children[tokens] = node
        return node

    @staticmethod
    def dominated_partials(parent: Node, tokens: tuple[int, ...]) -> list[Node]:
        """The unreferenced partial children of ``parent`` that a full block of ``tokens`` covers."""
        return [c for c in parent.children.values()
                if not c.full and c.ref_count == 0 and tokens[:len(c.tokens)] == c.tokens]
