"""vLLM's KV events as kvmesh's: block keys computed from the token ids, so the router and cachesvc never depend on
vLLM's hash function or its block size.

vLLM 0.32 publishes over ZMQ (``kv_events_config``): multipart ``[topic, seq (8 bytes big-endian), msgpack
KVEventBatch]`` once per engine step, ``seq`` counting batches from 0, and a replay socket that sends the batches
from a given ``seq`` again. Its ``BlockStored`` carries its own hashes, the parent's hash, the token ids of its
full blocks, its block size, the adapter's name and per block the "extra keys" (the first block's: the adapter's
name, then the cache salt); ``BlockRemoved`` carries only its hashes.

``Translator`` keeps, per vLLM block hash, the kvmesh keys of the kvmesh blocks inside it (a vLLM block of 128
tokens holds 8 of 16): a block chains from its parent's last key, a chain's first from the kvmesh namespace of its
salt and adapter (``name@generation``, as vLLM is given adapters under that name). ``Subscriber`` reads the socket
on a thread of its own and hands each batch to the event loop; a gap in ``seq`` is filled from the replay socket.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from kvmesh.contracts.events import (
    TIER_DEVICE,
    TIER_HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from kvmesh.contracts.ids import BlockKey, NamespaceSeed
from kvmesh.contracts.keys import block_keys

log = logging.getLogger(__name__)
TIERS = {"GPU": TIER_DEVICE, "CPU": TIER_HOST}  # vLLM's medium (GPU even on a CPU device) -> kvmesh's tier
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def endpoints() -> tuple[str, str]:
    """A fresh pair of ipc endpoints (events, replay) that nobody else binds."""
    base = os.path.join(tempfile.gettempdir(), f"kvmesh-vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    return f"ipc://{base}.sock", f"ipc://{base}-replay.sock"


VLLM_EVICTION = "vllm lru"  # what vLLM's prefix cache evicts by (its free queue: least recently freed first)

class Translator:
    """vLLM events -> kvmesh events, with the map that makes ``BlockRemoved`` translatable. Runs on the event
    loop; ``held`` (every kvmesh key held, counted) answers prefix matches and snapshots."""

    def __init__(self, block_size: int, namespace: Callable[[str, str], NamespaceSeed]) -> None:
        self.block_size = block_size  # kvmesh's
        self.namespace = namespace    # (cache salt, adapter name@generation) -> the chain's seed
        self._keys: dict[Any, tuple[BlockKey, ...]] = {}  # vLLM block hash -> the kvmesh keys inside it
        self._tier: dict[Any, str] = {}
        self.held: Counter[BlockKey] = Counter()
        self.skipped = 0  # blocks whose parent (or adapter) was unknown: not indexed

    def translate(self, events: Sequence[Any]) -> list[KVEvent]:
        out: list[KVEvent] = []
        for ev in events:
            name = type(ev).__name__
            if name == "BlockStored":
                if (stored := self._stored(ev)) is not None:
                    out.append(stored)
            elif name == "BlockRemoved":
                out.extend(self._removed(ev))
            elif name == "AllBlocksCleared":
                self._keys.clear()
                self._tier.clear()
                self.held.clear()
                out.append(AllBlocksCleared())
        return out

    def holds(self, seed: int, tokens: Sequence[int], max_tokens: int) -> int:
        """Leading full kvmesh blocks of ``tokens`` (within ``max_tokens``) held, in any tier."""
        n = 0
        for key in block_keys(seed, tokens[:max_tokens], self.block_size):
            if key not in self.held:
                break
            n += 1
        return n

    def snapshot(self) -> list[tuple[BlockKey, str]]:
        return [(key, self._tier[h]) for h, keys in self._keys.items() for key in keys]

    def _stored(self, ev: Any) -> BlockStored | None:
        vbs = int(ev.block_size)
        if vbs % self.block_size:
            raise ValueError(f"vLLM's block size {vbs} is not a multiple of kvmesh's {self.block_size}")
        if ev.parent_block_hash is None:
            first = (ev.extra_keys or [None])[0] or ()
            salt = str(first[1 if ev.lora_name else 0]) if len(first) > (1 if ev.lora_name else 0) else ""
            chain: int = self.namespace(salt, ev.lora_name or "")
            parent_key = None
        elif (parent := self._keys.get(ev.parent_block_hash)) is not None:
            chain = parent_key = parent[-1]
        else:  # its parent was removed (or never seen): its keys cannot be chained
            self.skipped += len(ev.block_hashes)
            return None
        tokens = list(ev.token_ids)
        keys = block_keys(chain, tokens, self.block_size)
        per = vbs // self.block_size
        tier = TIERS.get(ev.medium or "GPU", TIER_DEVICE)
        for i, h in enumerate(ev.block_hashes):
            mine = tuple(keys[i * per:(i + 1) * per])
            if h in self._keys:  # announced again (a prefix hit reported in full): nothing new
                continue
            self._keys[h], self._tier[h] = mine, tier
            self.held.update(mine)
        return BlockStored(tuple(keys), parent_key, self.block_size, tier, ev.lora_name)

    def _removed(self, ev: Any) -> list[KVEvent]:
        out: list[KVEvent] = []
        for h in ev.block_hashes:
            keys = self._keys.pop(h, None)
            if keys is None:
                continue
            tier = self._tier.pop(h)
            self.held.subtract(keys)
            for key in keys:
                if self.held[key] <= 0:
                    del self.held[key]
            out.append(BlockRemoved(keys, tier, VLLM_EVICTION))
        return out


class Subscriber:
    """Reads vLLM's event socket on its own thread and hands every batch, in order, to ``deliver`` (called on the
    reader thread; the caller moves it to its event loop). A gap in the batches' sequence numbers is filled from
    the replay socket; what cannot be replayed any more is reported as ``AllBlocksCleared``-worthy by
    ``on_lost``."""

    def __init__(self, endpoint: str, replay: str, topic: str, deliver: Callable[[list[Any]], None],
                 on_lost: Callable[[], None]) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._zmq = zmq
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        self.endpoint, self.replay, self.topic = endpoint, replay, topic
        self.deliver, self.on_lost = deliver, on_lost
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.next_seq = 0
        self.gaps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sub.close(0)
        self.ctx.term()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sub.poll(100):
                continue
            _, seq_b, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if seq > self.next_seq:
                self._fill(self.next_seq, seq)
            if seq >= self.next_seq:
                self._hand(seq, payload)

    def _hand(self, seq: int, payload: bytes) -> None:
        try:
            batch = self._decode(payload)
        except Exception:
            log.exception("vLLM KV event batch %d could not be decoded", seq)
            self.on_lost()
        else:
            self.deliver(list(batch.events))
        self.next_seq = seq + 1

    def _fill(self, start: int, end: int) -> None:
        """Ask the replay socket for batches ``start .. end - 1``; what it no longer has is lost."""
        self.gaps += 1
        zmq = self._zmq
        sock = self.ctx.socket(zmq.DEALER)
        try:
            sock.connect(self.replay)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            while sock.poll(2000):
                frames = sock.recv_multipart()
                seq_b, payload = frames[-2], frames[-1]
                if seq_b == END_SEQ:
                    break
                seq = int.from_bytes(seq_b, "big")
                if start <= seq < end and seq >= self.next_seq:
                    if seq > self.next_seq:
                        break  # the replay buffer does not reach back far enough
                    self._hand(seq, payload)
        finally:
            sock.close(0)
        if self.next_seq < end:
            log.warning("vLLM KV event batches %d..%d were lost; the index forgets this instance's blocks",
                        self.next_seq, end - 1)
            self.on_lost()
            self.next_seq = end
