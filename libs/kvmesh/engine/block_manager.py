"""Block ownership: a free list, a radix tree of cached blocks per namespace, eviction, and the host tier.

Invariants
- A device block is either free, private to one sequence, or owned by exactly one tree ``Node``.
- A node with ``ref_count > 0`` is in use by a running sequence: it is on the device and is never evicted.
- Full blocks (``block_size`` tokens) are shared by reference. A *partial* node (fewer tokens, always a leaf) is
  only ever copied into a new private block, so a sequence never writes into a shared block.
- A reserved block (``reserve``) belongs to its lease alone: not free, in no sequence, not in the tree, so the
  engine never reads or writes it; someone else fills it (decode: a push received in place) until ``import_prefix``
  adopts it into a sequence or ``release_reserved`` frees it, its bytes unpublished.
- Nodes are removed leaf-first, so every node's ancestors are in the tree; without a host tier only leaves are
  evicted, with one an inner node may spill to the host and stays matchable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kvmesh.contracts.events import TIER_DEVICE, TIER_HOST, BlockRemoved, BlockStored, EventSink, KVEvent
from kvmesh.contracts.ids import BlockKey
from kvmesh.contracts.keys import chain_key
from kvmesh.engine.eviction import LRU, EvictionPolicy, now
from kvmesh.engine.eviction_queue import EvictionQueue
from kvmesh.engine.kv_cache import DeviceKVPool, HostKVPool, KVPiece, Landed
from kvmesh.engine.sequence import RetentionRange, Sequence

if TYPE_CHECKING:
    import torch


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

    @property
    def key(self) -> BlockKey:
        return BlockKey(self.chain)


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


class BlockManager:
    def __init__(self, device: DeviceKVPool, host: HostKVPool | None = None,
                 policy: EvictionPolicy | None = None, on_event: EventSink | None = None,
                 enable_prefix_caching: bool = True) -> None:
        self.device = device
        self.host = host
        self.block_size = device.layout.block_size
        self.policy = policy or LRU()
        self._queue: EvictionQueue[Node] = EvictionQueue(self.policy)  # device nodes that may be evictable
        self._host_queue: EvictionQueue[Node] = EvictionQueue(self.policy)  # host nodes that may be evictable
        self.on_event = on_event
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks: list[int] = list(range(device.num_blocks - 1, -1, -1))
        self._roots: dict[int, Node] = {}
        self._device_nodes: set[Node] = set()
        self._host_nodes: set[Node] = set()
        self.stats = {"evicted_device": 0, "spilled_host": 0, "loaded_host": 0, "evicted_host": 0}
        self._pins: dict[str, list[Node]] = {}  # lease id -> the device nodes it holds a reference on
        self._reserved: dict[str, list[int]] = {}  # lease id -> device blocks reserved for it (``reserve``)

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._device_nodes)

    @property
    def num_host_blocks(self) -> int:
        return len(self._host_nodes)

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks held by leases (``pin``), counted once per lease."""
        return sum(len(nodes) for nodes in self._pins.values())

    @property
    def num_reserved_blocks(self) -> int:
        return sum(len(ids) for ids in self._reserved.values())

    def counts(self) -> dict[str, int]:
        """Where the device blocks are: free, cached (in the tree), referenced by a sequence or a lease,
        pinned by leases, reserved by leases, and the leases open (what the fault tests compare before and
        after)."""
        return {"free": len(self.free_blocks), "cached": len(self._device_nodes),
                "referenced": sum(1 for n in self._device_nodes if n.ref_count > 0),
                "pinned": self.num_pinned_blocks, "reserved": self.num_reserved_blocks,
                "leases": len(self._pins) + len(self._reserved)}

    def held_blocks(self) -> list[tuple[BlockKey, str]]:
        """Every full cached block and its tier (what a KV-event snapshot reports)."""
        return ([(n.key, TIER_DEVICE) for n in self._device_nodes if n.full]
                + [(n.key, TIER_HOST) for n in self._host_nodes])

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def match(self, seed: int, tokens: Seq[int], max_tokens: int | None = None) -> PrefixMatch:
        """Longest cached prefix of ``tokens`` (at most ``max_tokens``), at any token boundary."""
        bs = self.block_size
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        node = self._roots.get(seed)
        nodes: list[Node] = []
        if node is None or not self.enable_prefix_caching:
            return PrefixMatch(nodes, None, 0, bs)
        pos = 0
        while pos + bs <= limit:
            child = node.children.get(tuple(tokens[pos:pos + bs]))
            if child is None:
                break
            nodes.append(child)
            node, pos = child, pos + bs
        best, best_len = None, 0
        rest = tokens[pos:limit]
        for child in node.children.values():
            n = _common_prefix(child.tokens, rest)
            if n > best_len and (child.block_id is not None or child.host_slot is not None):
                best, best_len = child, n
        return PrefixMatch(nodes, best, best_len, bs)

    # ---- leases -------------------------------------------------------------------------------------------------
    def pin(self, lease: str, seed: int, tokens: Seq[int], max_blocks: int) -> int:
        """Hold the leading full blocks of ``tokens`` that are on the device (at most ``max_blocks``) under
        ``lease`` so eviction cannot take them until :meth:`unpin` (decode, for a request whose KV prefill
        pushes only past them). Returns how many are held; a lease id already held is released first."""
        self.unpin(lease)
        m = self.match(seed, tokens, max_blocks * self.block_size)
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
        """Release a lease (nothing when it is not held)."""
        for node in self._pins.pop(lease, ()):
            self._unref(node)

    def reserve(self, lease: str, n: int) -> list[int] | None:
        """Take ``n`` device blocks (evicting cached ones if needed) for KV that is written into them from
        outside the engine (decode: a push received in place), held under ``lease`` until ``import_prefix``
        adopts them (``Landed``) or :meth:`release_reserved`. Their ids, or None (nothing held) when the pool
        cannot make room. A lease already holding a reservation releases it first."""
        self.release_reserved(lease)
        ids = self._allocate(n)
        if not ids:
            return None
        self._reserved[lease] = ids
        return list(ids)

    def release_reserved(self, lease: str) -> None:
        """Free a reservation's blocks (nothing when ``lease`` holds none). What landed in them was never
        published: it is garbage from now on. The caller has stopped every write into them first."""
        self.free_blocks.extend(self._reserved.pop(lease, ()))

    # ---- sequence lifecycle ----------------------------------------------------------------------------------
    def allocate_prefix(self, seq: Sequence) -> bool:
        """Attach the longest cached prefix to a new sequence (loading host blocks, copying a partial block).

        Leaves at least one token to compute so the sequence gets logits. False when blocks are short.
        """
        tokens = seq.all_token_ids
        m = self.match(seq.namespace_seed, tokens, max_tokens=len(tokens) - 1)
        held = m.nodes + ([m.partial] if m.partial else [])
        for node in held:
            node.ref_count += 1
        to_load = [n for n in held if n.block_id is None]
        fresh = self._allocate(len(to_load) + (1 if m.partial else 0))
        if fresh is None:
            for node in held:
                self._unref(node)
            return False
        if to_load:
            self._load_from_host(to_load, fresh[:len(to_load)])
        t = self._record_hits(m.nodes)
        seq.nodes = list(m.nodes)
        seq.block_table = [n.block_id for n in m.nodes]  # type: ignore[misc]
        if m.partial:
            private = fresh[-1]
            self.device.copy_tokens(m.partial.block_id, private, self.block_size)  # type: ignore[arg-type]
            m.partial.last_access = t
            self._unref(m.partial)
            seq.block_table.append(private)
        seq.num_computed_tokens = m.num_tokens
        seq.num_cached_tokens = m.num_tokens
        return True

    def import_prefix(self, seq: Sequence, blocks: torch.Tensor | list[torch.Tensor] | list[KVPiece] | Landed,
                      num_tokens: int, first_block: int = 0) -> bool:
        """Attach KV computed elsewhere: ``blocks`` (whole blocks in the pool's storage layout; or pieces of
        them, in order, as pushed chunk by chunk; or ``KVPiece`` s that place themselves, whole blocks or
        layer slices, as pushed in layer groups) hold block indices ``first_block ..`` of the sequence, up to
        its first ``num_tokens`` tokens; the blocks before ``first_block`` must be cached here. Cached blocks
        are shared, the rest written. False (nothing held) when the pool cannot make room or the blocks before
        ``first_block`` are no longer cached. The caller checked that the pieces cover every layer of every
        block. ``Landed``: the blocks from ``first_block`` on are the ones reserved under its lease, adopted as
        they are (no copy; its ``pieces`` written into them); the reservation ends either way."""
        if isinstance(blocks, Landed):
            return self._import_landed(seq, blocks, num_tokens, first_block)
        if not self.allocate_prefix(seq):
            return False
        first_new = len(seq.nodes)  # a partially copied block is private and simply overwritten
        if first_new < first_block or not self.ensure_slots(seq, num_tokens):
            self.free(seq)
            return False
        self._write_pieces(seq, _placed(blocks, first_block), first_new, num_tokens)
        seq.num_computed_tokens = num_tokens
        self.cache_computed_blocks(seq)
        return True

    def _import_landed(self, seq: Sequence, landed: Landed, num_tokens: int, first_block: int) -> bool:
        """``import_prefix`` of KV received in place: the sequence's blocks are its leading cached full blocks
        (held by a pin, so on the device) and then the reserved ones."""
        ids = self._reserved.pop(landed.lease, None)
        if ids is None:
            return False
        m = self.match(seq.namespace_seed, seq.all_token_ids, first_block * self.block_size)
        if (len(ids) != -(-num_tokens // self.block_size) - first_block or len(m.nodes) < first_block
                or any(node.block_id is None for node in m.nodes)):
            self.free_blocks.extend(ids)
            return False
        for node in m.nodes:
            node.ref_count += 1
        self._record_hits(m.nodes)
        seq.nodes = list(m.nodes)
        seq.block_table = [node.block_id for node in m.nodes] + ids  # type: ignore[misc]
        self._write_pieces(seq, landed.pieces, first_block, num_tokens)
        seq.num_computed_tokens = num_tokens
        self.cache_computed_blocks(seq)  # a block another request cached meanwhile is shared, ours freed
        return True

    def _record_hits(self, nodes: list[Node]) -> float:
        """A sequence reuses ``nodes``: tell the eviction policy and count the hit. Returns the time used."""
        t = now()
        for node in nodes:
            self.policy.on_hit(node, t)
            node.last_access = t
            node.hit_count += 1
        return t

    def _write_pieces(self, seq: Sequence, pieces: list[KVPiece], first_new: int, num_tokens: int) -> None:
        """Copy received pieces into the sequence's blocks ``first_new ..`` up to token ``num_tokens`` (each
        piece: one strided copy per run of block ids)."""
        last = -(-num_tokens // self.block_size)
        for piece in pieces:
            start = piece.first_block
            lo, hi = max(first_new, start), min(last, start + piece.data.shape[0])
            if lo < hi:
                self.device.write_blocks(seq.block_table[lo:hi], piece.data[lo - start:hi - start], piece.layers)

    def adopt(self, seed: int, tokens: list[int], blocks: torch.Tensor, first_block: int) -> bool:
        """Put fetched full blocks (indices ``first_block ..`` of ``tokens``) into the prefix cache, unreferenced."""
        from kvmesh.contracts.sampling import SamplingParams

        n = len(tokens) // self.block_size * self.block_size
        seq = Sequence("adopt", list(tokens[:n]) + [0], SamplingParams(), seed)
        if not self.import_prefix(seq, blocks, n, first_block):
            return False
        self.free(seq)
        return True

    def export_prefix(self, seq: Sequence, first_block: int = 0, num_tokens: int | None = None) -> torch.Tensor:
        """The sequence's computed KV as whole blocks ``[n, *block_shape]`` (a copy), from block
        ``first_block`` on, up to its token ``num_tokens`` (default: all it computed)."""
        n = -(-(seq.num_computed_tokens if num_tokens is None else num_tokens) // self.block_size)
        return self.device.read_blocks(seq.block_table[first_block:n])

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the sequence's block table to hold ``num_tokens`` tokens; False if the pool cannot."""
        need = self.blocks_needed(seq, num_tokens)
        if need == 0:
            return True
        fresh = self._allocate(need)
        if fresh is None:
            return False
        seq.block_table.extend(fresh)
        return True

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's newly computed full blocks into the tree so other requests can share them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        n_full = seq.num_computed_tokens // bs
        if len(seq.nodes) >= n_full:
            return
        tokens = seq.all_token_ids
        parent = seq.nodes[-1] if seq.nodes else self._root(seq.namespace_seed)
        stored: list[BlockKey] = []
        parent_key = BlockKey(parent.chain) if parent.full else None
        t = now()
        for i in range(len(seq.nodes), n_full):
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            node = parent.children.get(block_tokens)
            if node is None:
                node = Node(block_tokens, parent, chain_key(parent.chain, block_tokens), True,
                            block_id=seq.block_table[i], last_access=t, depth=i)
                self._drop_partial_siblings(parent, block_tokens)
                parent.children[block_tokens] = node
                parent.extended = True
                self._device_nodes.add(node)
                stored.append(node.key)
            elif node.block_id is None:  # only on the host: our fresh copy becomes the device copy
                self._release_host(node)
                node.block_id = seq.block_table[i]
                self._device_nodes.add(node)
                stored.append(node.key)
            else:  # computed twice concurrently: share the cached block, free ours
                self.free_blocks.append(seq.block_table[i])
                seq.block_table[i] = node.block_id
            self._apply_retention(node, seq.retention, i)
            node.ref_count += 1
            seq.nodes.append(node)
            parent = node
        if stored:
            self._emit(BlockStored(tuple(stored), parent_key, bs, TIER_DEVICE))

    def free(self, seq: Sequence) -> None:
        """Release a finished or preempted sequence: shared blocks are unreferenced (and stay cached), the
        computed tail of a partial block is kept as a partial node, everything else returns to the free list."""
        self.cache_computed_blocks(seq)
        t = now()
        for node in seq.nodes:
            node.last_access = t
            self._unref(node)
        private = seq.block_table[len(seq.nodes):]
        tail = seq.num_computed_tokens - len(seq.nodes) * self.block_size
        if private and 0 < tail < self.block_size and self.enable_prefix_caching:
            parent = seq.nodes[-1] if seq.nodes else self._root(seq.namespace_seed)
            start = len(seq.nodes) * self.block_size
            self._add_partial(parent, tuple(seq.all_token_ids[start:start + tail]), private[0], t)
            private = private[1:]
        self.free_blocks.extend(private)
        seq.block_table, seq.nodes = [], []

    # ---- internals ---------------------------------------------------------------------------------------------
    def _root(self, seed: int) -> Node:
        root = self._roots.get(seed)
        if root is None:
            root = self._roots[seed] = Node((), None, seed, False)
        return root

    def _emit(self, event: KVEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def _apply_retention(self, node: Node, ranges: tuple[RetentionRange, ...], index: int) -> None:
        start, end = index * self.block_size, (index + 1) * self.block_size
        for r in ranges:
            if r.start < end and start < r.end and r.priority >= node.priority:
                node.priority, node.priority_until = r.priority, now() + r.duration_s

    def _add_partial(self, parent: Node, tokens: tuple[int, ...], block_id: int, t: float) -> None:
        for sibling in parent.children.values():
            if sibling.tokens[:len(tokens)] == tokens and sibling.block_id is not None:
                self.free_blocks.append(block_id)  # a cached sibling already covers these tokens
                return
        node = Node(tokens, parent, 0, False, block_id=block_id, last_access=t)
        parent.children[tokens] = node
        self._device_nodes.add(node)
        self._queue.push(node, t)

    def _drop_partial_siblings(self, parent: Node, tokens: tuple[int, ...]) -> None:
        dominated = [c for c in parent.children.values()
                     if not c.full and c.ref_count == 0 and tokens[:len(c.tokens)] == c.tokens]
        for child in dominated:
            self._delete(child)

    def _allocate(self, n: int) -> list[int] | None:
        if n == 0:
            return []
        if len(self.free_blocks) < n:
            self.evict(n - len(self.free_blocks))
        if len(self.free_blocks) < n:
            return None
        return [self.free_blocks.pop() for _ in range(n)]

    def evict(self, n: int) -> int:
        """Free ``n`` device blocks from unreferenced cached nodes, in the policy's order (O(log n) each: the
        queue holds the nodes that were evictable when last touched; one that no longer is leaves it until its
        last reader or last child goes, which pushes it again)."""
        freed = 0
        t = now()
        while freed < n:
            node = self._queue.pop(t, self._evictable)
            if node is None:
                break
            self.policy.on_evict(node, t)
            if self._evict_from_device(node):
                freed += 1
        return freed

    def _evictable(self, node: Node) -> bool:
        return (node.block_id is not None and node.ref_count == 0
                and (self.host is not None or not node.children))

    def _unref(self, node: Node) -> None:
        node.ref_count -= 1
        if node.ref_count == 0 and node.block_id is not None:
            self._queue.push(node, node.last_access)
        elif node.ref_count == 0 and node.host_slot is not None and not node.children:
            self._host_queue.push(node, node.last_access)  # an attach that failed: evictable from the host again

    def _evict_from_device(self, node: Node) -> bool:
        if node.full and self.host is not None and self._make_host_room():
            (slot,) = self.host.store(self.device.read_blocks([node.block_id]))  # type: ignore[list-item]
            self.free_blocks.append(node.block_id)  # type: ignore[arg-type]
            node.block_id, node.host_slot = None, slot
            self._device_nodes.discard(node)
            self._host_nodes.add(node)
            if not node.children:
                self._host_queue.push(node, node.last_access)
            self.stats["spilled_host"] += 1
            self.stats["evicted_device"] += 1
            self._emit(BlockRemoved((node.key,), TIER_DEVICE))
            self._emit(BlockStored((node.key,), self._parent_key(node), self.block_size, TIER_HOST))
            return True
        if node.children:
            return False
        self.stats["evicted_device"] += 1
        self._delete(node)
        return True

    def _make_host_room(self) -> bool:
        assert self.host is not None
        if self.host.free_slots:
            return True
        victim = self._host_queue.pop(now(), self._host_leaf)
        if victim is None:
            return False
        self.stats["evicted_host"] += 1
        self._delete(victim)
        return True

    @staticmethod
    def _host_leaf(node: Node) -> bool:
        # unreferenced only: a prefix being attached holds its host nodes while device room is made to load
        # them (``_unref`` pushes such a node again if it stays on the host)
        return node.host_slot is not None and not node.children and node.ref_count == 0

    def _load_from_host(self, nodes: list[Node], blocks: list[int]) -> None:
        assert self.host is not None
        self.device.write_blocks(blocks, self.host.load([n.host_slot for n in nodes]))  # type: ignore[misc]
        for node, block in zip(nodes, blocks):
            self._release_host(node)
            node.block_id = block
            self._device_nodes.add(node)
        self.stats["loaded_host"] += len(nodes)
        for node in nodes:
            self._emit(BlockRemoved((node.key,), TIER_HOST))
            self._emit(BlockStored((node.key,), self._parent_key(node), self.block_size, TIER_DEVICE))

    def _release_host(self, node: Node) -> None:
        assert self.host is not None and node.host_slot is not None
        self.host.release(node.host_slot)
        node.host_slot = None
        self._host_nodes.discard(node)
        self._host_queue.discard(node)

    def _parent_key(self, node: Node) -> BlockKey | None:
        return BlockKey(node.parent.chain) if node.parent is not None and node.parent.full else None

    def _delete(self, node: Node) -> None:
        assert not node.children and node.ref_count == 0 and node.parent is not None
        del node.parent.children[node.tokens]
        self._queue.discard(node)
        parent = node.parent
        if not parent.children and parent.ref_count == 0 and parent.block_id is not None:
            self._queue.push(parent, parent.last_access)  # a leaf now: evictable without a host tier
        if not parent.children and parent.host_slot is not None:
            self._host_queue.push(parent, parent.last_access)  # a host leaf now: evictable from the host
        tier = TIER_DEVICE
        if node.block_id is not None:
            self.free_blocks.append(node.block_id)
            node.block_id = None
            self._device_nodes.discard(node)
        if node.host_slot is not None:
            self._release_host(node)
            tier = TIER_HOST
        if node.full:
            self._emit(BlockRemoved((node.key,), tier))


def _placed(blocks: torch.Tensor | list[torch.Tensor] | list[KVPiece], first_block: int) -> list[KVPiece]:
    """``import_prefix``'s blocks as pieces that say where they go (plain tensors follow each other)."""
    out: list[KVPiece] = []
    for piece in blocks if isinstance(blocks, list) else [blocks]:
        if not isinstance(piece, KVPiece):
            piece = KVPiece(first_block, piece)
            first_block += int(piece.data.shape[0])
        out.append(piece)
    return out
