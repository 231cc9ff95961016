"""Block ownership for the engine: which blocks a sequence holds, and the prefix cache it shares them through.

The block manager runs a sequence's life (attach a cached prefix, grow, publish computed blocks, import pushed
KV, free) over three owners, each in its own module:
- the radix tree of cached blocks per namespace (``engine/radix.py``): what is cached;
- the tiers (``engine/tiers.py``): where each cached block lives (device, host), and what is evicted first;
- the leases (``engine/leases.py``): blocks pinned or reserved for someone outside the engine.

Invariants
- A device block is either free, private to one sequence, reserved by one lease, or owned by exactly one tree
  ``Node``.
- A node with ``ref_count > 0`` is in use by a running sequence or a pin: it is on the device and never evicted.
- Full blocks (``block_size`` tokens) are shared by reference. A *partial* node (fewer tokens, always a leaf) is
  only ever copied into a new private block, so a sequence never writes into a shared block.
- Nodes are removed leaf-first, so every node's ancestors are in the tree.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from kvmesh.contracts.engine import RetentionRange
from kvmesh.contracts.events import TIER_DEVICE, TIER_HOST, BlockRemoved, BlockStored, EventSink, KVEvent
from kvmesh.contracts.ids import BlockKey
from kvmesh.contracts.sessions import SessionEvent
from kvmesh.engine.eviction import LRU, EvictionPolicy, now
from kvmesh.engine.kv_cache import DeviceKVPool, HostKVPool, KVPiece, Landed
from kvmesh.engine.leases import Leases
from kvmesh.engine.radix import Node, PrefixMatch, RadixTree
from kvmesh.engine.sequence import Sequence, Status
from kvmesh.engine.sessions import SessionTable, owner_after
from kvmesh.engine.tiers import Tiers

if TYPE_CHECKING:
    import torch

__all__ = ["BlockManager", "Node", "PrefixMatch"]

EXPIRE_EVERY_S = 10.0  # how often idle sessions are looked for


class BlockManager:
    def __init__(self, device: DeviceKVPool, host: HostKVPool | None = None,
                 policy: EvictionPolicy | None = None, on_event: EventSink | None = None,
                 enable_prefix_caching: bool = True) -> None:
        self.device = device
        self.host = host
        self.block_size = device.layout.block_size
        self.policy = policy or LRU()
        self.on_event = on_event
        self.enable_prefix_caching = enable_prefix_caching
        self.tree = RadixTree(self.block_size)
        self.tiers = Tiers(device, host, self.policy, self._emit, self.tree)
        self.leases = Leases(self.tree, self.tiers)
        self.sessions: SessionTable | None = getattr(self.policy, "sessions", None)
        self._expired_at = 0.0

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> list[int]:
        return self.tiers.free_blocks

    @property
    def stats(self) -> dict[str, int]:
        return self.tiers.stats

    @property
    def num_free_blocks(self) -> int:
        return len(self.tiers.free_blocks)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.tiers.device_nodes)

    @property
    def num_host_blocks(self) -> int:
        return len(self.tiers.host_nodes)

    @property
    def num_pinned_blocks(self) -> int:
        return self.leases.num_pinned_blocks

    @property
    def num_reserved_blocks(self) -> int:
        return self.leases.num_reserved_blocks

    def counts(self) -> dict[str, int]:
        """Where the device blocks are: free, cached (in the tree), referenced by a sequence or a lease,
        pinned by leases, reserved by leases, and the leases open (what the fault tests compare before and
        after)."""
        device = self.tiers.device_nodes
        return {"free": len(self.tiers.free_blocks), "cached": len(device),
                "referenced": sum(1 for n in device if n.ref_count > 0),
                "pinned": self.leases.num_pinned_blocks, "reserved": self.leases.num_reserved_blocks,
                "leases": self.leases.num_leases}

    def held_blocks(self) -> list[tuple[BlockKey, str]]:
        """Every full cached block and its tier (what a KV-event snapshot reports)."""
        return ([(n.key, TIER_DEVICE) for n in self.tiers.device_nodes if n.full]
                + [(n.key, TIER_HOST) for n in self.tiers.host_nodes])

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def match(self, seed: int, tokens: Seq[int], max_tokens: int | None = None) -> PrefixMatch:
        """Longest cached prefix of ``tokens`` (at most ``max_tokens``), at any token boundary."""
        if not self.enable_prefix_caching:
            return PrefixMatch([], None, 0, self.block_size)
        return self.tree.match(seed, tokens, max_tokens)

    def evict(self, n: int) -> int:
        """Free ``n`` device blocks from unreferenced cached nodes, in the policy's order."""
        return self.tiers.evict(n)

    # ---- leases (engine/leases.py) -------------------------------------------------------------------------
    def pin(self, lease: str, seed: int, tokens: Seq[int], max_blocks: int) -> int:
        """Hold the leading full blocks of ``tokens`` that are on the device (at most ``max_blocks``) under
        ``lease`` so eviction cannot take them until :meth:`unpin` (decode, for a request whose KV prefill
        pushes only past them). Returns how many are held."""
        return self.leases.pin(lease, seed, tokens, max_blocks) if self.enable_prefix_caching else 0

    def unpin(self, lease: str) -> None:
        self.leases.unpin(lease)

    def reserve(self, lease: str, n: int) -> list[int] | None:
        """Take ``n`` device blocks for KV written into them from outside the engine (decode: a push received
        in place), until ``import_prefix`` adopts them (``Landed``) or :meth:`release_reserved`."""
        return self.leases.reserve(lease, n)

    def release_reserved(self, lease: str) -> None:
        self.leases.release(lease)

    # ---- sequence lifecycle ----------------------------------------------------------------------------------
    def allocate_prefix(self, seq: Sequence) -> bool:
        """Attach the longest cached prefix to a new sequence (loading host blocks, copying a partial block).

        Leaves at least one token to compute so the sequence gets logits; none for a sequence that scores its prompt
        (it needs every position's logits). False when blocks are short. When the
        prefix's host blocks cannot all come back (the device can make no room for them while they are held:
        its other blocks' children fill the host tier), the part on the device is attached and the rest is
        computed again, rather than waiting for room that never comes.
        """
        tokens = seq.all_token_ids
        m = self.match(seq.namespace_seed, tokens, max_tokens=0 if seq.scores_prompt else len(tokens) - 1)
        if self._attach(seq, m):
            return True
        on_device = list(itertools.takewhile(lambda n: n.block_id is not None, m.nodes))
        if len(on_device) == len(m.nodes) and m.partial is None:
            return False
        return self._attach(seq, PrefixMatch(on_device, None, 0, self.block_size))

    def _attach(self, seq: Sequence, m: PrefixMatch) -> bool:
        """``allocate_prefix`` of the match ``m``; False (nothing held) when the device has no room."""
        held = m.nodes + ([m.partial] if m.partial else [])
        for node in held:
            node.ref_count += 1
        to_load = [n for n in held if n.block_id is None]
        fresh = self.tiers.allocate(len(to_load) + (1 if m.partial else 0))
        if fresh is None:
            for node in held:
                self.tiers.unref(node)
            return False
        if to_load:
            self.tiers.load_from_host(to_load, fresh[:len(to_load)])
        t = self._record_hits(m.nodes)
        seq.nodes = list(m.nodes)
        seq.block_table = [n.block_id for n in m.nodes]  # type: ignore[misc]
        if m.partial:
            private = fresh[-1]
            self.device.copy_tokens(m.partial.block_id, private, self.block_size)  # type: ignore[arg-type]
            m.partial.last_access = t
            self.tiers.unref(m.partial)
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
        ids = self.leases.take(landed.lease)
        if ids is None:
            return False
        m = self.match(seq.namespace_seed, seq.all_token_ids, first_block * self.block_size)
        held = [node.block_id for node in m.nodes if node.block_id is not None]
        if (len(ids) != -(-num_tokens // self.block_size) - first_block or len(m.nodes) < first_block
                or len(held) < len(m.nodes)):
            self.free_blocks.extend(ids)
            return False
        for node in m.nodes:
            node.ref_count += 1
        self._record_hits(m.nodes)
        seq.nodes = list(m.nodes)
        seq.block_table = held + ids
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
            if node.prefetched:
                node.prefetched = False
                self.stats["prefetch_used"] += 1
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
        self.free(seq, used=False)
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
        fresh = self.tiers.allocate(need)
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
        parent = seq.nodes[-1] if seq.nodes else self.tree.root(seq.namespace_seed)
        stored: list[BlockKey] = []
        parent_key = BlockKey(parent.chain) if parent.full else None
        t = now()
        for i in range(len(seq.nodes), n_full):
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            node = parent.children.get(block_tokens)
            if node is None:
                for dominated in self.tree.dominated_partials(parent, block_tokens):
                    self.tiers.delete(dominated, "replaced")
                node = self.tree.add_full(parent, block_tokens, seq.block_table[i], t, i)
                self.tiers.on_device(node, seq.block_table[i])
                stored.append(node.key)
            elif node.block_id is None:  # only on the host: our fresh copy becomes the device copy
                self.tree.quarantined.discard(node.chain)
                self.tiers.release_host(node)
                self.tiers.on_device(node, seq.block_table[i])
                stored.append(node.key)
            elif node.chain in self.tree.quarantined:  # our fresh KV rewrites the quarantined block
                self.device.copy_tokens(seq.block_table[i], node.block_id, bs)
                self.tree.quarantined.discard(node.chain)
                self.free_blocks.append(seq.block_table[i])
                seq.block_table[i] = node.block_id
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

    def free(self, seq: Sequence, used: bool = True) -> None:
        """Release a finished or preempted sequence: shared blocks are unreferenced (and stay cached), the
        computed tail of a partial block is kept as a partial node, everything else returns to the free list.
        A finished one's retention ranges hold from now, and its session (if any) holds its blocks now (or,
        its last request, nothing). ``used``: a request used the blocks (not a fetch putting them in)."""
        self.cache_computed_blocks(seq)
        t = now()
        changed: set[int] = set()
        if seq.status is Status.FINISHED and seq.nodes:
            for i, node in enumerate(seq.nodes):
                self._apply_retention(node, seq.retention, i)
            if seq.session is not None and self.sessions is not None:
                changed = self.sessions.request(seq.session.key, [n.chain for n in seq.nodes], t,
                                                seq.session.end)
        session = seq.session.key if seq.session is not None else ""
        for node in seq.nodes:
            node.last_access = t
            if used:
                node.session_owner = owner_after(node.session_owner, session)
            self.tiers.unref(node)
        self._rerank(changed)
        if seq.status is Status.FINISHED:
            self.expire_sessions(t)
        private = seq.block_table[len(seq.nodes):]
        tail = seq.num_computed_tokens - len(seq.nodes) * self.block_size
        if private and 0 < tail < self.block_size and self.enable_prefix_caching:
            parent = seq.nodes[-1] if seq.nodes else self.tree.root(seq.namespace_seed)
            start = len(seq.nodes) * self.block_size
            partial = self.tree.add_partial(parent, tuple(seq.all_token_ids[start:start + tail]), private[0], t)
            if partial is not None:  # else a cached sibling already covers these tokens: the block is freed
                self.tiers.on_device(partial, private[0])
                self.tiers.queue.push(partial, t)
                private = private[1:]
        self.free_blocks.extend(private)
        seq.block_table, seq.nodes = [], []

    # ---- sessions and the cluster's copies -------------------------------------------------------------------
    def quarantine(self, keys: Seq[int]) -> list[BlockKey]:
        """The canary caught these blocks' KV diverging: they and every block cached after them in their chains
        are never matched again until a request rewrites them (``RadixTree.quarantined``); those no one holds are
        deleted now, the index is told the rest are gone too. Returns the keys quarantined."""
        doomed: list[Node] = []
        for key in keys:
            stack = [self.tree.by_key[key]] if key in self.tree.by_key else []
            while stack:
                node = stack.pop()
                doomed.append(node)
                if node.full:
                    self.tree.quarantined.add(node.chain)
                stack.extend(node.children.values())
        quarantined = [n.key for n in doomed if n.full]
        kept = []
        for node in reversed(doomed):  # descendants before their ancestors
            if node.ref_count == 0 and not node.children and node.parent is not None \
                    and node.parent.children.get(node.tokens) is node:
                if node.block_id is not None:  # scrubbed: a bad dtype leaves inf / nan a later masked read spreads
                    self.device.k[:, node.block_id].zero_()
                    self.device.v[:, node.block_id].zero_()
                self.tiers.delete(node, "quarantine")  # tells the index
                if node.full:
                    self.tree.quarantined.discard(node.chain)
            elif node.full:
                kept.append(node.key)
        if kept:
            self._emit(BlockRemoved(tuple(kept), TIER_DEVICE, "quarantine"))
        return quarantined

    def session_signal(self, key: str, event: SessionEvent, expected_s: float = 0.0) -> None:
        """Session ``key`` paused, demoted, released or ended (``SessionTable.signal``); ``expected_s``: the
        pause the client announced (0: none)."""
        if self.sessions is None:
            return
        self._rerank(self.sessions.signal(key, event, now(), expected_s))

    def session_back(self, key: str) -> None:
        """A request of session ``key`` was queued: a paused session's blocks are kept while it waits
        (``SessionTable.back``)."""
        if self.sessions is not None:
            self._rerank(self.sessions.back(key, now()))

    def expire_sessions(self, t: float, force: bool = False) -> None:
        """Drop the sessions silent past the table's ``idle_s`` (looked for every ``EXPIRE_EVERY_S``)."""
        if self.sessions is not None and (force or t - self._expired_at >= EXPIRE_EVERY_S):
            self._expired_at = t
            self._rerank(self.sessions.expire(t))

    def cluster_copies(self, shared: Seq[int], sole: Seq[int]) -> None:
        """cachesvc's word: ``shared`` blocks have another copy in the cluster, ``sole`` ones no longer do."""
        for keys, replicated in ((shared, True), (sole, False)):
            for key in keys:
                node = self.tree.by_key.get(key)
                if node is not None and node.replicated != replicated:
                    node.replicated = replicated
                    self.tiers.rerank(node)

    def prefetch(self, key: str) -> int:
        """Warm paused session ``key``'s blocks that were demoted to the host back onto the device (its chain
        from the first block, as far as the tree holds it), evicting what ranks lowest to make room. How many
        were loaded (0 when none was on the host, or there is no room)."""
        s = self.sessions.get(key) if self.sessions is not None else None
        if s is None or self.sessions is None or self.host is None:
            return 0
        self._rerank(self.sessions.retain(key))  # a demoted session's KV is kept from now on
        chain = []
        for block in s.blocks:
            node = self.tree.by_key.get(block)
            if node is None:
                break
            chain.append(node)
        to_load = [n for n in chain if n.block_id is None and n.host_slot is not None]
        if not to_load:
            return 0
        for node in to_load:  # held while room is made, so the host tier cannot drop them meanwhile
            node.ref_count += 1
        fresh = self.tiers.allocate(len(to_load))
        if fresh is not None:
            self.tiers.load_from_host(to_load, fresh)
        t = now()
        for node in to_load:
            node.prefetched = fresh is not None
            if fresh is not None:  # warmed for a use that is coming: not the next victim by its old recency
                node.last_access = t
            self.tiers.unref(node)
        if fresh is None:
            return 0
        self.stats["prefetch_loaded"] += len(to_load)
        return len(to_load)

    def _rerank(self, keys: set[int]) -> None:
        for key in keys:
            node = self.tree.by_key.get(key)
            if node is not None:
                self.tiers.rerank(node)

    # ---- internals ---------------------------------------------------------------------------------------------
    def _emit(self, event: KVEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def _apply_retention(self, node: Node, ranges: tuple[RetentionRange, ...], index: int) -> None:
        start, end = index * self.block_size, (index + 1) * self.block_size
        for r in ranges:
            if r.start < end and start < r.end and r.priority >= node.priority:
                node.priority, node.priority_until = r.priority, now() + r.duration_s


def _placed(blocks: torch.Tensor | list[torch.Tensor] | list[KVPiece], first_block: int) -> list[KVPiece]:
    """``import_prefix``'s blocks as pieces that say where they go (plain tensors follow each other)."""
    out: list[KVPiece] = []
    for piece in blocks if isinstance(blocks, list) else [blocks]:
        if not isinstance(piece, KVPiece):
            piece = KVPiece(first_block, piece)
            first_block += int(piece.data.shape[0])
        out.append(piece)
    return out
