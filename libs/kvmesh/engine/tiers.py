"""Where cached blocks live and which go first: the device tier (L1: the pool's free list and the tree nodes with a
device block), the host tier (L2: a bounded pool in host memory that evicted device blocks spill to), and the
eviction order of each (a strategy's sort key, in an ``EvictionQueue``).

Rules (the block manager's invariants rest on them)
- Only an unreferenced node leaves the device. Without a host tier only leaves are evicted; with one, a full
  inner node spills to the host and stays matchable, and host nodes leave leaf-first.
- A node leaves the tree only as a leaf (``delete``), so every node's ancestors are cached; its parent, a leaf
  now, becomes evictable.
- Every move is told as a KV event: ``BlockRemoved`` from the tier it left, ``BlockStored`` in the one it reached.
"""

from __future__ import annotations

from collections.abc import Callable

from kvmesh.contracts.events import TIER_DEVICE, TIER_HOST, BlockRemoved, BlockStored, KVEvent
from kvmesh.engine.eviction import EvictionPolicy, now
from kvmesh.engine.eviction_queue import EvictionQueue
from kvmesh.engine.kv_cache import DeviceKVPool, HostKVPool
from kvmesh.engine.radix import Node, RadixTree


class Tiers:
    def __init__(self, device: DeviceKVPool, host: HostKVPool | None, policy: EvictionPolicy,
                 emit: Callable[[KVEvent], None], tree: RadixTree) -> None:
        self.device = device
        self.tree = tree
        self.host = host
        self.policy = policy
        self.block_size = device.layout.block_size
        self._emit = emit
        self.free_blocks: list[int] = list(range(device.num_blocks - 1, -1, -1))
        self.device_nodes: set[Node] = set()
        self.host_nodes: set[Node] = set()
        self.queue: EvictionQueue[Node] = EvictionQueue(policy)  # device nodes that may be evictable
        self.host_queue: EvictionQueue[Node] = EvictionQueue(policy)  # host nodes that may be evictable
        self.stats = {"evicted_device": 0, "spilled_host": 0, "loaded_host": 0, "evicted_host": 0,
                      "prefetch_loaded": 0, "prefetch_used": 0, "prefetch_wasted": 0}

    # ---- device blocks ---------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """``n`` free device blocks, evicting cached ones if needed; None (nothing taken) when there is no room."""
        if n == 0:
            return []
        if len(self.free_blocks) < n:
            self.evict(n - len(self.free_blocks))
        if len(self.free_blocks) < n:
            return None
        return [self.free_blocks.pop() for _ in range(n)]

    def on_device(self, node: Node, block_id: int) -> None:
        """``node``'s block is now in device block ``block_id`` (computed here, or loaded)."""
        node.block_id = block_id
        self.device_nodes.add(node)

    def evict(self, n: int) -> int:
        """Free ``n`` device blocks from unreferenced cached nodes, in the policy's order (O(log n) each: the
        queue holds the nodes that were evictable when last touched; one that no longer is leaves it until its
        last reader or last child goes, which pushes it again; one that was but could not go this time, an
        inner node the full host tier cannot take, is ranked again)."""
        freed = 0
        t = now()
        kept: list[Node] = []  # popped but could not go yet (children, and no host room): ranked again
        progressed = False
        while freed < n:
            node = self.queue.pop(t, self._evictable)
            if node is None:
                if not (kept and progressed):
                    break
                for k in kept:  # what went since may have made host room for them: another round
                    self.queue.push(k, k.last_access)
                kept, progressed = [], False
                continue
            if self._evict_from_device(node):
                self.policy.on_evict(node, t)
                freed += 1
                progressed = True
            else:
                kept.append(node)
        for node in kept:
            self.queue.push(node, node.last_access)
        return freed

    def unref(self, node: Node) -> None:
        """A sequence or a lease lets go of ``node``; the last one makes it evictable again."""
        node.ref_count -= 1
        if node.ref_count == 0 and node.block_id is not None:
            self.queue.push(node, node.last_access)
        elif node.ref_count == 0 and node.host_slot is not None and not node.children:
            self.host_queue.push(node, node.last_access)  # an attach that failed: evictable from the host again

    def rerank(self, node: Node) -> None:
        """``node``'s sort key changed (a session signal, cachesvc's word on its copies): rank it again where it
        may be evicted from (a referenced one is ranked when its last reader lets go)."""
        if node.ref_count:
            return
        if node.block_id is not None:
            self.queue.push(node, now())
        elif node.host_slot is not None and not node.children:
            self.host_queue.push(node, now())

    def _left_device(self, node: Node) -> None:
        """A block warmed back for a paused session left the device before it was hit: wasted."""
        if node.prefetched:
            node.prefetched = False
            self.stats["prefetch_wasted"] += 1

    def _evictable(self, node: Node) -> bool:
        return (node.block_id is not None and node.ref_count == 0
                and (self.host is not None or not node.children))

    def _evict_from_device(self, node: Node) -> bool:
        if node.full and self.host is not None and self._make_host_room():
            (slot,) = self.host.store(self.device.read_blocks([node.block_id]))  # type: ignore[list-item]
            self._left_device(node)
            self.free_blocks.append(node.block_id)  # type: ignore[arg-type]
            node.block_id, node.host_slot = None, slot
            self.device_nodes.discard(node)
            self.host_nodes.add(node)
            if not node.children:
                self.host_queue.push(node, node.last_access)
            self.stats["spilled_host"] += 1
            self.stats["evicted_device"] += 1
            self._emit(BlockRemoved((node.key,), TIER_DEVICE, self.policy.name))
            self._emit(BlockStored((node.key,), node.parent_key, self.block_size, TIER_HOST))
            return True
        if node.children:
            return False
        self.stats["evicted_device"] += 1
        self.delete(node)
        return True

    # ---- the host tier ---------------------------------------------------------------------------------------
    def _make_host_room(self) -> bool:
        assert self.host is not None
        if self.host.free_slots:
            return True
        victim = self.host_queue.pop(now(), self._host_leaf)
        if victim is None:
            return False
        self.stats["evicted_host"] += 1
        self.delete(victim)
        return True

    @staticmethod
    def _host_leaf(node: Node) -> bool:
        # unreferenced only: a prefix being attached holds its host nodes while device room is made to load
        # them (``unref`` pushes such a node again if it stays on the host)
        return node.host_slot is not None and not node.children and node.ref_count == 0

    def load_from_host(self, nodes: list[Node], blocks: list[int]) -> None:
        """Bring host-resident ``nodes`` back to the device, into ``blocks``."""
        assert self.host is not None
        self.device.write_blocks(blocks, self.host.load([n.host_slot for n in nodes]))  # type: ignore[misc]
        for node, block in zip(nodes, blocks):
            self.release_host(node)
            self.on_device(node, block)
        self.stats["loaded_host"] += len(nodes)
        for node in nodes:
            self._emit(BlockRemoved((node.key,), TIER_HOST))
            self._emit(BlockStored((node.key,), node.parent_key, self.block_size, TIER_DEVICE))

    def release_host(self, node: Node) -> None:
        assert self.host is not None and node.host_slot is not None
        self.host.release(node.host_slot)
        node.host_slot = None
        self.host_nodes.discard(node)
        self.host_queue.discard(node)

    # ---- leaving the tree ------------------------------------------------------------------------------------
    def delete(self, node: Node, reason: str = "") -> None:
        """Remove an unreferenced leaf from the tree and free its block wherever it is; ``reason`` (for the KV
        event): why, when not evicted by the policy."""
        assert node.ref_count == 0
        parent = self.tree.remove(node)
        self.queue.discard(node)
        if not parent.children and parent.ref_count == 0 and parent.block_id is not None:
            self.queue.push(parent, parent.last_access)  # a leaf now: evictable without a host tier
        if not parent.children and parent.host_slot is not None:
            self.host_queue.push(parent, parent.last_access)  # a host leaf now: evictable from the host
        tier = TIER_DEVICE
        if node.block_id is not None:
            self._left_device(node)
            self.free_blocks.append(node.block_id)
            node.block_id = None
            self.device_nodes.discard(node)
        if node.host_slot is not None:
            self.release_host(node)
            tier = TIER_HOST
        if node.full:
            self._emit(BlockRemoved((node.key,), tier, reason or self.policy.name))
