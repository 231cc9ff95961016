"""Snapshot resync of the KV block index: cachesvc asks, an engine instance answers.

When an instance's ``kv.events`` batches skip a sequence number, or go back (the instance restarted and numbers
from 1 again), cachesvc publishes an empty request on ``kvmesh.<cluster>.kv.snapshot.<instance>`` (core NATS)
with a reply inbox. The instance answers on that inbox with every block it holds, in chunks that fit the
server's max payload; each chunk carries one tier's keys::

    "KVS1" | seq u64 | chunk u32 | chunks u32 | tier_len u16 | tier (utf-8) | block keys u64 ...   (little-endian)

``seq`` is the seq of the last events batch the instance has published. The snapshot must reflect every batch
up to ``seq``; it may also reflect later ones (applying an event twice does no harm). So read ``seq`` first, then
list the blocks. cachesvc replaces what it knows of the instance with the snapshot and applies only batches
after ``seq``.

Engine side, once at start (``blocks()`` lists the instance's ``(block key, tier)``, e.g. from its engine)::

    async def current() -> tuple[int, list[tuple[int, str]]]:
        seq = last_published_seq              # first
        return seq, await blocks()            # then

    await answer_snapshots(bus, subjects, instance_id, current)
"""

from __future__ import annotations

import logging
import struct
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import nats.errors
import numpy as np
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from kvmesh.bus.bus import Bus
from kvmesh.bus.subjects import Subjects, token

log = logging.getLogger(__name__)

MAGIC = b"KVS1"
_HEAD = struct.Struct("<4sQIIH")
_NO_RESPONDERS = "503"

SnapshotSource = Callable[[], Awaitable[tuple[int, Iterable[tuple[int, str]]]]]


@dataclass(frozen=True)
class Snapshot:
    instance_id: str
    seq: int
    blocks: dict[str, list[int]]  # tier -> block keys


def snapshot_subject(subjects: Subjects, instance_id: str) -> str:
    return f"{subjects.prefix}kv.snapshot.{token(instance_id, 'instance')}"


def encode_snapshot(seq: int, blocks: Iterable[tuple[int, str]], max_payload: int) -> list[bytes]:
    """The chunks of a snapshot: each at most ``max_payload`` bytes, one tier each (one empty chunk when the
    instance holds nothing)."""
    by_tier: dict[str, list[int]] = defaultdict(list)
    for key, tier in blocks:
        by_tier[tier].append(key)
    parts: list[tuple[bytes, np.ndarray]] = []
    for tier, keys in by_tier.items():
        name = tier.encode()
        per_chunk = (max_payload - _HEAD.size - len(name)) // 8
        if per_chunk < 1:
            raise ValueError(f"max_payload {max_payload} is too small for a snapshot chunk")
        arr = np.asarray(keys, dtype="<u8")
        parts += [(name, arr[i:i + per_chunk]) for i in range(0, len(arr), per_chunk)]
    parts = parts or [(b"", np.empty(0, dtype="<u8"))]
    return [_HEAD.pack(MAGIC, seq, i, len(parts), len(name)) + name + keys.tobytes()
            for i, (name, keys) in enumerate(parts)]


def decode_chunk(data: bytes) -> tuple[int, int, int, str, list[int]]:
    """``(seq, chunk, chunks, tier, keys)`` of one chunk; ValueError when it is not one."""
    if len(data) < _HEAD.size:
        raise ValueError(f"snapshot chunk of {len(data)} bytes is shorter than its header")
    magic, seq, chunk, chunks, tier_len = _HEAD.unpack_from(data)
    body = memoryview(data)[_HEAD.size + tier_len:]
    if magic != MAGIC or chunk >= chunks or len(body) % 8 or len(data) < _HEAD.size + tier_len:
        raise ValueError("not a snapshot chunk")
    tier = bytes(data[_HEAD.size:_HEAD.size + tier_len]).decode()
    return seq, chunk, chunks, tier, np.frombuffer(body, dtype="<u8").tolist()


async def answer_snapshots(bus: Bus, subjects: Subjects, instance_id: str, source: SnapshotSource) -> Subscription:
    """Answer every snapshot request for ``instance_id`` with what ``source()`` returns (``seq``, then the
    ``(block key, tier)`` pairs: see the module docstring for the order). Active on the server when this
    returns; ``await sub.unsubscribe()`` stops it."""

    async def on_request(msg: Msg) -> None:
        if not msg.reply:
            return
        try:
            seq, blocks = await source()
            for chunk in encode_snapshot(seq, blocks, bus.nc.max_payload):
                await bus.nc.publish(msg.reply, chunk)
        except Exception:
            log.exception("answering a snapshot request for %s failed", instance_id)

    sub = await bus.nc.subscribe(snapshot_subject(subjects, instance_id), cb=on_request)
    await bus.nc.flush()
    return sub


async def request_snapshot(bus: Bus, subjects: Subjects, instance_id: str, timeout_s: float) -> Snapshot | None:
    """Ask ``instance_id`` for its snapshot; None when nobody answers (no such subscriber: at once), the answer
    is incomplete within ``timeout_s``, or it does not decode."""
    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox)
    blocks: dict[str, list[int]] = defaultdict(list)
    deadline = time.monotonic() + timeout_s
    try:
        await bus.nc.publish(snapshot_subject(subjects, instance_id), b"", reply=inbox)
        seq, received, expected = 0, 0, 1
        while received < expected:
            msg = await sub.next_msg(timeout=max(0.001, deadline - time.monotonic()))
            if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
                return None
            seq, chunk, expected, tier, keys = decode_chunk(msg.data)
            if chunk != received:
                raise ValueError(f"snapshot chunk {chunk} arrived when {received} was due")
            if tier:
                blocks[tier] += keys
            received += 1
        return Snapshot(instance_id, seq, dict(blocks))
    except (TimeoutError, nats.errors.TimeoutError):
        log.warning("no complete snapshot from %s within %.1fs", instance_id, timeout_s)
        return None
    except ValueError as e:
        log.warning("bad snapshot from %s: %s", instance_id, e)
        return None
    finally:
        await sub.unsubscribe()
