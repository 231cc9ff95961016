"""The cache service process: gRPC ``CacheService`` + health + reflection, fed by the KV events stream, and a
transfer endpoint (``kvmesh.transfer``) through which block bytes move.

Block bytes travel beside the RPCs, not in them: a writer asks for a push capability (``GrantPut``: the
endpoint, a transfer id and a token, for that many blocks until ``transfer_timeout_s``), pushes its blocks to
cachesvc's transfer endpoint with it, then calls ``PutBlocks`` with the keys, checksums and the transfer id; a
reader names its own transfer endpoint in ``GetBlocks`` with the transfer id and token it granted there, cachesvc
leases the hit blocks, pushes them there, releases the lease and answers with keys and checksums. Neither
endpoint takes a push nobody asked for. Inline ``data`` still works for clients that name no transfer.

Two owners. The event loop owns the index, the resync and liveness (gRPC handlers, the events consumer, the
heartbeat subscriber and the reaper all run on it). One storage thread owns the pool (its tiers and leases), so
disk and network I/O never block the loop; handlers hand pool work to it and await. ``MatchPrefix`` reads the
pool's membership from the loop (see ``store.py``). Neither needs locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import nats.js.errors
import numpy as np
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from kvmesh import tls
from kvmesh.authz import Authorizer, caller
from kvmesh.bus import Bus, Subjects
from kvmesh.bus.bus import POOL_EVENTS_SENDER
from kvmesh.bus.shard_directory import DISCOVER, ShardDirectory
from kvmesh.bus.snapshot import Snapshot, request_snapshot
from kvmesh.contracts.events import BlockRemoved, BlockStored
from kvmesh.contracts.ids import BlockKey, InstanceId
from kvmesh.contracts.layout import KVLayout, layout_mismatch
from kvmesh.contracts.messages import CacheShardBeat, Heartbeat, KVEventBatch, KVQuarantine, Message, SessionSignal
from kvmesh.contracts.shards import ShardMap
from kvmesh.identity import Identity, MeshRole
from kvmesh.proto.raw import delimited_head
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc
from kvmesh.ready import binding, report_ready
from kvmesh.settings import CacheServiceSettings, SharedSettings
from kvmesh.telemetry import tracing
from kvmesh.telemetry.metrics import MetricsServer
from kvmesh.telemetry.rpc import traced_rpc
from kvmesh.transfer import Limits, Refusal, TransferClient, TransferRejected, TransferServer
from kvmesh.transfer.header import Versions, negotiate, parse_versions
from kvmesh.transfer.wire import parse_address
from opentelemetry.trace import Span, SpanKind

from services.cachesvc.copies import CopyChanges, CopyTracker
from services.cachesvc.index import BlockIndex
from services.cachesvc.metrics import CacheMetrics
from services.cachesvc.pool import GetResult, Pool
from services.cachesvc.repair import Repair, mask_slots
from services.cachesvc.resync import Resync
from services.cachesvc.store import LayoutMismatch, PoolFull, Shadowing, StoredBlock, StoreUnavailable, TooManyLeases

log = logging.getLogger("cachesvc")

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name  # kvmesh.v1.CacheService
R = TypeVar("R")
POOL_INSTANCE = POOL_EVENTS_SENDER  # the index's name for the pool; its events on pool.events carry it
POOL_EVENTS_PER_MESSAGE = 4096  # block keys in one pool.events message (well under NATS's 1 MB payload)
POOL_EVENTS_HELD = 200_000  # block keys kept for pool.events while NATS is down (the oldest go first)
BEAT_S = 1.0  # its shard's beat (CacheShardBeat), for callers that find cachesvc through the bus
PEERS_WAIT_S = 10.0  # peers "nats": how long a repair waits between looks at the shards' beats
_MESSAGE_OVERHEAD = 64 << 10  # room for keys and checksums next to the data of a GetBlocks reply
MAX_BATCH = 256  # prompts in one MatchPrefixBatch



class TransferFailed(RuntimeError):
    """Block bytes did not move: a push that failed or timed out, or pushed blocks that never arrived."""


class ForeignAddress(ValueError):
    """GetBlocks named a transfer endpoint that is not the caller's own."""


class CopyRefused(ValueError):
    """GetBlocks asked for a copy (a repair's, with each block's retention and sessions) from a caller that is not
    a cachesvc shard."""


class WrongShard(ValueError):
    """The caller addresses another shard, or another number of shards, than this cachesvc is."""


def _holder(context: grpc.aio.ServicerContext) -> str:
    """Who calls, as leases and stored blocks record it: the mesh identity (\"\" on a plaintext server)."""
    who = caller(context)
    return str(who) if who else ""


def _request_layout(request: Any) -> KVLayout:
    if not request.HasField("layout"):
        raise ValueError("layout is required: set the BlockLayout the blocks were written with")
    return KVLayout.from_proto(request.layout)


# What a caller (or a peer) got wrong: each ends the call with a status whose message says what to fix, and the
# server keeps serving. Listed most specific first.
CALL_ERRORS = {
    LayoutMismatch: ("layout_mismatch", grpc.StatusCode.FAILED_PRECONDITION),
    TransferRejected: ("transfer_rejected", grpc.StatusCode.FAILED_PRECONDITION),
    TransferFailed: ("transfer_failed", grpc.StatusCode.UNAVAILABLE),
    Shadowing: ("shadowing", grpc.StatusCode.PERMISSION_DENIED),
    TooManyLeases: ("too_many_leases", grpc.StatusCode.RESOURCE_EXHAUSTED),
    ForeignAddress: ("foreign_address", grpc.StatusCode.PERMISSION_DENIED),
    CopyRefused: ("copy_refused", grpc.StatusCode.PERMISSION_DENIED),
    WrongShard: ("wrong_shard", grpc.StatusCode.FAILED_PRECONDITION),
    PoolFull: ("full", grpc.StatusCode.RESOURCE_EXHAUSTED),
    StoreUnavailable: ("unavailable", grpc.StatusCode.UNAVAILABLE),
    ValueError: ("invalid", grpc.StatusCode.INVALID_ARGUMENT),
}
# Each call counted and timed, and traced as ``cachesvc.<rpc>`` under the caller's span (W3C context in metadata).
_statuses = traced_rpc(lambda rpc: f"cachesvc.{rpc}", metrics=lambda self: self.server.metrics,
                       attributes=lambda self, request, context: tracing.request_attributes(context),
                       errors=CALL_ERRORS)


def encode_get_reply(head: cache_pb2.GetBlocksResponse, data: Sequence[bytes | memoryview]) -> bytes:
    """A serialized GetBlocksResponse: ``head`` (every field but ``data``) followed by field 3, written straight
    from the blocks' buffers. One copy of the bytes instead of three (join, message, serialize); protobuf
    readers accept fields in any order."""
    size = sum(len(d) for d in data)
    return b"".join([head.SerializeToString(), delimited_head(3, size), *data])


def _serialize(reply: Any) -> bytes:
    return reply if isinstance(reply, bytes) else reply.SerializeToString()


def add_cache_service(servicer: CacheService, server: grpc.aio.Server) -> None:
    """Like the generated ``add_CacheServiceServicer_to_server``, but a handler may return its reply already
    serialized (GetBlocks does)."""
    service = cache_pb2.DESCRIPTOR.services_by_name["CacheService"]
    handlers = {m.name: grpc.unary_unary_rpc_method_handler(
        getattr(servicer, m.name), request_deserializer=GetMessageClass(m.input_type).FromString,
        response_serializer=_serialize) for m in service.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _joined(layout: KVLayout, blocks: list[StoredBlock]) -> memoryview:
    """``blocks`` back to back in one fresh buffer (what a push sends)."""
    nbytes = layout.block_nbytes
    view = memoryview(bytearray(len(blocks) * nbytes))
    for i, b in enumerate(blocks):
        view[i * nbytes:(i + 1) * nbytes] = b.data
    return view


def _lease_s(value: float, max_lease_s: float, required: bool) -> float:
    low = "(0" if required else "[0"
    if not (0 < value if required else 0 <= value) or value > max_lease_s:
        raise ValueError(f"lease_s must be in {low}, {max_lease_s}] seconds (max_lease_s), got {value}")
    return value


class CacheService(cache_pb2_grpc.CacheServiceServicer):
    def __init__(self, server: CacheServer) -> None:
        self.server = server
        self.cfg = server.cfg
        self.max_reply_bytes = (server.cfg.max_message_mb << 20) - _MESSAGE_OVERHEAD

    @property
    def pool(self) -> Pool:
        assert self.server.pool is not None, "the pool is opened before gRPC starts"
        return self.server.pool

    async def _storage(self, fn: Callable[..., R], *args: Any) -> R:
        return await asyncio.get_running_loop().run_in_executor(self.server.storage, fn, *args)

    @_statuses
    async def MatchPrefix(self, request: cache_pb2.MatchPrefixRequest,
                          context: grpc.aio.ServicerContext, _span: Span) -> cache_pb2.MatchPrefixResponse:
        self.server.metrics.matches.inc()
        return self._match(request)

    @_statuses
    async def MatchPrefixBatch(self, request: cache_pb2.MatchPrefixBatchRequest,
                               context: grpc.aio.ServicerContext, span: Span) -> cache_pb2.MatchPrefixBatchResponse:
        """Each question answered as ``MatchPrefix`` answers it, in order, each traced as its own
        ``cachesvc.MatchPrefix`` span under the trace its entry names. Every entry names this shard's view, so one
        that is wrong fails the call (as it would fail each call alone)."""
        asked = request.requests
        if len(asked) > MAX_BATCH:
            raise ValueError(f"MatchPrefixBatch holds {len(asked)} requests; send at most {MAX_BATCH} a call")
        span.set_attribute("kvmesh.batch", len(asked))
        answers = []
        for item in asked:
            t0 = time.time_ns()
            answers.append(self._match(item))
            if (parent := tracing.extract(item.metadata)) is not None:
                tracing.record("cachesvc.MatchPrefix", parent, t0, time.time_ns(),
                               {**tracing.attributes_of(item.metadata), "kvmesh.batch": len(asked)},
                               SpanKind.SERVER)
        self.server.metrics.matches.inc(len(asked))
        return cache_pb2.MatchPrefixBatchResponse(responses=answers)

    def _match(self, request: cache_pb2.MatchPrefixRequest) -> cache_pb2.MatchPrefixResponse:
        self.server.check_view(request.view)
        keys = list(request.block_keys)
        smap, shard, index = self.server.shard_map, self.cfg.shard, self.server.index
        if smap.shards == 1:
            pool = [cache_pb2.TierMatch(instance_id=POOL_INSTANCE, tier=tier, num_blocks=n)
                    for tier, n in self.pool.leading(keys)]
            if request.packed:
                return self._packed(request, index.match_packed(keys), matches=pool)
            matches = [cache_pb2.TierMatch(instance_id=m.instance_id, tier=m.tier, num_blocks=m.num_blocks)
                       for m in index.match_prefix(keys)]
            return cache_pb2.MatchPrefixResponse(matches=matches + pool)
        # a shard: its own keys alone. The instances: each count where that holder's run breaks in the whole
        # list (the keys it does not own count as present; the caller takes the least over the shards). Its
        # pool: the positions it holds, per tier (the caller ORs the shards'). Not before the events stream is
        # replayed: a half-built index would cut every answer short.
        if not self.server.caught_up:
            raise StoreUnavailable(f"shard {shard} is replaying the events stream; ask the other shards")
        held = [cache_pb2.PoolHeld(tier=tier, positions=mask.to_bytes((mask.bit_length() + 7) // 8, "little"))
                for tier, mask in self.pool.held_bits(keys, smap.pool_positions(shard, keys))]
        mine = smap.index_positions(shard, keys)
        if request.packed:
            return self._packed(request, index.match_packed(keys, mine), index_copies=smap.copies, pool_held=held)
        matches = [cache_pb2.TierMatch(instance_id=m.instance_id, tier=m.tier, num_blocks=m.num_blocks)
                   for m in index.match_own(keys, mine)]
        return cache_pb2.MatchPrefixResponse(matches=matches, index_copies=smap.copies, pool_held=held)

    def _packed(self, request: cache_pb2.MatchPrefixRequest, found: tuple[np.ndarray, np.ndarray],
                **fields: Any) -> cache_pb2.MatchPrefixResponse:
        """A packed MatchPrefix answer: the instances' holders as this index's ids and their counts (two arrays
        of little-endian uint32), and the id -> name table when the caller's copy of it is not current."""
        index = self.server.index
        ids, counts = found
        resp = cache_pb2.MatchPrefixResponse(packed=True, holder_ids=ids.astype("<u4").tobytes(),
                                             holder_counts=counts.astype("<u4").tobytes(),
                                             holders_epoch=index.holders_epoch, **fields)
        if request.holders_epoch != index.holders_epoch:
            resp.holders.extend(cache_pb2.HolderName(id=hid, instance_id=instance, tier=tier)
                                for hid, instance, tier in index.holder_names())
        return resp

    @_statuses
    async def PutBlocks(self, request: cache_pb2.PutBlocksRequest,
                        context: grpc.aio.ServicerContext, _span: Span) -> cache_pb2.PutBlocksResponse:
        self.server.check_view(request.view)
        self.server.check_owned(request.block_keys)
        if request.priority_duration_s < 0:
            raise ValueError(f"priority_duration_s must be >= 0 (0 = the longest, max_retention_s), got "
                             f"{request.priority_duration_s}")
        # a writer's retention is capped: 0 or longer than max_retention_s is max_retention_s, never forever
        retention_s = min(request.priority_duration_s or self.cfg.max_retention_s, self.cfg.max_retention_s)
        layout = _request_layout(request)
        data: bytes | memoryview = request.data
        if request.transfer_id:
            if request.data:
                raise ValueError("set either data (inline blocks) or transfer_id (pushed blocks), not both")
            try:
                data = await self._take_pushed(request.transfer_id, layout, list(request.block_keys),
                                               list(request.checksums))
            finally:
                self.server.transfer.revoke(request.transfer_id)  # its grant is used up, whatever came
        if request.session_key and request.session_blocks and not set(request.block_keys) <= set(
                request.session_blocks):
            raise ValueError("session_blocks must hold every one of block_keys: the session's context includes "
                             "the blocks its request wrote")
        result = await self._storage(self.pool.put, layout, request.block_keys, request.checksums, data,
                                     request.priority, retention_s, bool(request.transfer_id),
                                     request.session_key, request.session_end, list(request.session_blocks),
                                     _holder(context))
        self.server.metrics.bytes.labels("put").inc(len(data))
        if result.stored:
            await self.server.tell_copies(self.server.copies.after_put(request.block_keys))
        return cache_pb2.PutBlocksResponse(stored=result.stored, skipped=result.skipped)

    async def _take_pushed(self, transfer_id: str, layout: KVLayout, keys: list[BlockKey],
                           checksums: list[int]) -> memoryview:
        """The bytes pushed under ``transfer_id``, once they match the request's layout, keys and checksums
        (the transfer server verified the bytes against the checksums pushed with them: no hashing again)."""
        transfer = self.server.transfer
        timeout = self.cfg.transfer_timeout_s
        try:
            got = await transfer.take(transfer_id, timeout)
        except TimeoutError:
            transfer.discard(transfer_id)
            raise TransferFailed(f"transfer {transfer_id} did not arrive within {timeout:g}s (transfer_timeout_s): "
                                 f"push the blocks to {transfer.address} under the capability GrantPut issued "
                                 "before calling PutBlocks") from None
        except TransferRejected as e:
            raise TransferRejected(f"transfer {transfer_id} was refused on arrival: {e.reason}") from None
        if got.layout != layout:
            raise LayoutMismatch(f"transfer {transfer_id} carried another layout than PutBlocks names "
                                 f"({layout_mismatch(layout, got.layout)}); push and put with the same layout")
        if got.layers is not None:  # a hand-off's layer group part: the pool stores whole blocks only
            raise ValueError(f"transfer {transfer_id} holds layers {list(got.layers)} of its blocks, not whole "
                             "blocks; push whole blocks to the pool")
        if list(got.block_keys) != keys or got.num_blocks != len(keys):
            raise ValueError(f"transfer {transfer_id} carried {got.num_blocks} blocks with other keys than the "
                             f"{len(keys)} block_keys of PutBlocks; push exactly the blocks you put")
        bad = [i for i, (pushed, put) in enumerate(zip(got.checksums, checksums, strict=True))
               if pushed != put]
        if bad:
            raise ValueError(f"blocks {bad} of transfer {transfer_id} fail their checksums: the bytes pushed "
                             "are not the blocks PutBlocks names; nothing was stored")
        return got.data

    @_statuses
    async def GetBlocks(self, request: cache_pb2.GetBlocksRequest,
                        context: grpc.aio.ServicerContext, _span: Span) -> bytes | cache_pb2.GetBlocksResponse:
        self.server.check_view(request.view)
        layout = _request_layout(request)
        lease_s = _lease_s(request.lease_s, self.cfg.max_lease_s, required=False)
        holder, who = _holder(context), caller(context)
        if request.copy:
            self.server.check_copy_caller(who)
        if request.transfer_address or request.transfer_id:
            self.server.check_own_address(who, request.transfer_address)
            return await self._push_blocks(request, layout, lease_s, holder)

        def get() -> bytes:  # on the storage thread: the bytes are copied there too
            got = self.pool.get(layout, request.block_keys, self.max_reply_bytes, lease_s, holder,
                                touch=not request.copy)
            head = cache_pb2.GetBlocksResponse(
                block_keys=[b.key for b in got.blocks], checksums=[b.checksum for b in got.blocks],
                tiers=got.tiers, lease_id=got.lease_id, leased_blocks=got.leased)
            if request.copy:  # a repair: each block's retention goes with its copy
                kept = [self.pool.retention(b.key) for b in got.blocks]
                head.priorities.extend(p for p, _ in kept)
                head.priority_s.extend(s for _, s in kept)
                head.sessions.extend(cache_pb2.BlockSessions(keys=h)
                                     for h in self.pool.holding([b.key for b in got.blocks]))
            return encode_get_reply(head, [b.data for b in got.blocks])

        reply = await self._storage(get)
        self.server.metrics.bytes.labels("get").inc(len(reply))
        return reply

    async def _push_blocks(self, request: cache_pb2.GetBlocksRequest, layout: KVLayout,
                           lease_s: float, holder: str) -> cache_pb2.GetBlocksResponse:
        """GetBlocks through the transfer engine: lease the hit run (the caller's lease, else one for the push
        alone), copy it into one buffer, push it to the reader under the capability it named, release, answer
        without data."""
        if not request.transfer_address or not request.transfer_id:
            raise ValueError("transfer_address and transfer_id go together: name the reader's transfer endpoint "
                             "and a fresh id it takes the blocks by (or neither, for inline data)")
        if not request.transfer_token:
            raise ValueError("transfer_token is required with transfer_address: the push capability the reader's "
                             "transfer endpoint granted for transfer_id (it refuses a push without one)")
        parse_address(request.transfer_address)  # ValueError saying what a transfer address looks like
        versions = parse_versions(request.transfer_versions)  # the reader's: ValueError saying what they look like
        try:  # before anything is leased: a reader this cachesvc cannot write to is told so, not "refused"
            negotiate(self.server.transfer_client.codec.speaks, versions)
        except TransferRejected as e:
            raise TransferRejected(f"cachesvc cannot push to {request.transfer_address}: {e.reason}",
                                   e.kind) from None
        timeout = self.cfg.transfer_timeout_s

        def get() -> tuple[GetResult, memoryview | None]:  # on the storage thread: the copy too
            got = self.pool.get(layout, request.block_keys, self.cfg.max_transfer_mb << 20,
                                lease_s or 2 * timeout, holder if lease_s else "", touch=not request.copy)
            return got, _joined(layout, got.blocks) if got.blocks else None

        got, blocks = await self._storage(get)
        try:
            if blocks is not None:
                await self._push(request.transfer_address, request.transfer_id, request.transfer_token, versions,
                                 layout, blocks, [BlockKey(b.key) for b in got.blocks],
                                 [b.checksum for b in got.blocks])
        finally:
            if got.lease_id and not lease_s:
                await self._storage(self.pool.leases.release, got.lease_id)
        self.server.metrics.bytes.labels("get").inc(0 if blocks is None else len(blocks))
        keep = bool(lease_s and got.lease_id)
        return cache_pb2.GetBlocksResponse(
            block_keys=[b.key for b in got.blocks], checksums=[b.checksum for b in got.blocks], tiers=got.tiers,
            lease_id=got.lease_id if keep else 0, leased_blocks=got.leased if keep else 0)

    async def _push(self, address: str, transfer_id: str, token: str, versions: Versions, layout: KVLayout,
                    blocks: memoryview, keys: list[BlockKey], checksums: list[int]) -> None:
        """Push ``blocks`` with the checksums stored with them: the reader verifies the bytes against those,
        so a block damaged in storage or on the way is caught there, and nothing is hashed here."""
        timeout = self.cfg.transfer_timeout_s
        try:
            async with asyncio.timeout(timeout):
                await self.server.transfer_client.push(address, transfer_id, layout, blocks, keys,
                                                       len(keys) * layout.block_size, checksums, token=token,
                                                       versions=versions)
        except TransferRejected as e:
            raise TransferRejected(f"{address} refused the push of {len(keys)} blocks: {e.reason}") from None
        except TimeoutError:
            raise TransferFailed(f"the push of {len(keys)} blocks to {address} took over {timeout:g}s "
                                 "(transfer_timeout_s)") from None
        except OSError as e:  # ConnectionError included
            raise TransferFailed(f"the push of {len(keys)} blocks to {address} failed: {e}") from None

    @_statuses
    async def GrantPut(self, request: cache_pb2.GrantPutRequest,
                       context: grpc.aio.ServicerContext, _span: Span) -> cache_pb2.GrantPutResponse:
        self.server.check_view(request.view)
        if request.num_blocks == 0:
            raise ValueError("num_blocks must be > 0: the whole blocks the push will hold")
        transfer, timeout = self.server.transfer, self.cfg.transfer_timeout_s
        transfer_id = f"pool-put-{uuid.uuid4().hex}"
        grant = transfer.grant(transfer_id, 0, request.num_blocks, timeout)
        return cache_pb2.GrantPutResponse(transfer_address=transfer.address, transfer_id=transfer_id,
                                          token=grant.token, expires_in_s=timeout,
                                          transfer_versions=str(transfer.versions))

    @_statuses
    async def LeaseBlocks(self, request: cache_pb2.LeaseBlocksRequest,
                          context: grpc.aio.ServicerContext, _span: Span) -> cache_pb2.LeaseBlocksResponse:
        self.server.check_view(request.view)
        lease_s = _lease_s(request.lease_s, self.cfg.max_lease_s, required=True)
        lease_id, n = await self._storage(self.pool.lease, list(request.block_keys), lease_s, _holder(context))
        return cache_pb2.LeaseBlocksResponse(lease_id=lease_id, num_blocks=n)

    @_statuses
    async def ReleaseLease(self, request: cache_pb2.ReleaseLeaseRequest,
                           context: grpc.aio.ServicerContext, _span: Span) -> cache_pb2.ReleaseLeaseResponse:
        released = await self._storage(self.pool.leases.release, request.lease_id)
        return cache_pb2.ReleaseLeaseResponse(released=released)

    @_statuses
    async def ListBlocks(self, request: cache_pb2.ListBlocksRequest,
                         context: grpc.aio.ServicerContext, _span: Span) -> cache_pb2.ListBlocksResponse:
        """Shard to shard: what the pool holds of the slots asked (a restarted shard's repair and hand-over,
        ``repair.py``)."""
        self.server.check_view(request.view)
        slots = mask_slots(request.slots)
        if request.foreign_only:  # a hand-over: what this shard holds of slots it does not keep
            slots -= set(self.server.shard_map.pool_slots(self.cfg.shard))
        listing = await self._storage(self.pool.listing, slots)
        return cache_pb2.ListBlocksResponse(blocks=[
            cache_pb2.LayoutBlocks(layout=layout.to_proto(), block_keys=keys) for layout, keys in listing.items()])

    @_statuses
    async def Stats(self, request: cache_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext, _span: Span) -> cache_pb2.StatsResponse:
        def tiers() -> tuple[list[cache_pb2.TierStats], int, int]:
            leases = self.pool.leases
            return ([cache_pb2.TierStats(tier=t.name, blocks=len(t), bytes=t.used_bytes,
                                         capacity_bytes=t.capacity_bytes, evicted=t.evicted)
                     for t in self.pool.tiers], len(leases), leases.pinned_keys)

        tier_stats, leases, leased = await self._storage(tiers)
        dram = next((t for t in tier_stats if t.tier == "dram"), cache_pb2.TierStats())
        index, resync, repair = self.server.index, self.server.resync, self.server.repair
        return cache_pb2.StatsResponse(
            indexed_blocks=len(index), instances=len(index.instances()), pool_blocks=dram.blocks,
            pool_bytes=dram.bytes, pool_capacity_bytes=dram.capacity_bytes, events_applied=index.events_applied,
            event_gaps=resync.gaps, tiers=tier_stats, leases=leases, leased_blocks=leased,
            snapshots_requested=resync.requested, snapshots_applied=resync.applied,
            caught_up=self.server.caught_up, transfer_address=self.server.transfer.address,
            view=cache_pb2.ShardView(shard=self.cfg.shard, shards=self.cfg.shards,
                                     index_copies=self.server.shard_map.copies,
                                     pool_copies=self.server.shard_map.pool_copies),
            repaired_blocks=repair.blocks if repair else 0, repaired_bytes=repair.bytes if repair else 0,
            repair_pending_slots=repair.pending if repair else 0,
            handover_pending_shards=repair.handover_pending if repair else self.server.handover_waiting)


class CacheServer:
    """gRPC server + NATS side. ``start()`` returns once the pool is open (the disk tier scanned) and the
    events stream replayed up to where it stood at start (health SERVING)."""

    def __init__(self, cfg: CacheServiceSettings, shared: SharedSettings | None = None) -> None:
        self.cfg = cfg
        self.shared = shared or SharedSettings()
        self.subjects = Subjects(self.shared.cluster)
        # one shard of several keeps the index entries and the pool blocks of the keys the shard map gives it
        # a shard leaving the cluster (cfg.leaving) owns no slot of the map: it indexes nothing and takes no write
        self.shard_map = ShardMap(cfg.shards, cfg.index_copies, cfg.pool_copies)
        sharded = cfg.shards > 1 or cfg.leaving
        self.index = BlockIndex(self.shard_map.index_slots(cfg.shard) if sharded else None)
        self.durable = f"{cfg.durable_name}-{cfg.shard}" if sharded else cfg.durable_name
        self.resync = Resync(self.index, self._fetch_snapshot)
        self.copies = CopyTracker(self.index, lambda key: self.pool is not None and any(
            t.has(key) for t in self.pool.tiers), self.shard_map.first_slots(cfg.shard) if sharded else None)
        self.storage = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cachesvc-storage")
        self.pool: Pool | None = None
        self._pool_events: list[BlockStored | BlockRemoved] = []  # for pool.events, in order
        self._pool_seq = 0
        self.health = health.aio.HealthServicer()
        # inside a mesh with mutual TLS every call is authorised by the caller's role (kvmesh.authz)
        self.authorizer = Authorizer("cachesvc") if tls.mutual(self.shared) else None
        self.metrics = CacheMetrics(self)
        self.metrics_server: MetricsServer | None = None
        self.port = 0
        self.bus: Bus | None = None
        self._transfer: TransferServer | None = None
        self.transfer_client = TransferClient(connect_timeout=min(5.0, cfg.transfer_timeout_s),
                                              reply_timeout=cfg.transfer_timeout_s,
                                              tls=tls.transfer_client_tls(self.shared))
        self.caught_up = False
        self._last_seen: dict[str, float] = {}  # instance -> monotonic time of its last heartbeat
        self._dropped: set[str] = set()  # instances dropped for silence, until heard again
        self._transfer_addresses: dict[str, str] = {}  # instance -> the transfer endpoint it announced
        self.bus_outage = False  # NATS was seen down and has not been seen back yet
        self._reaper: asyncio.Task[None] | None = None
        self._beater: asyncio.Task[None] | None = None
        self.repair: Repair | None = None  # a shard with peers: refills itself at start (copies, hand-over)
        self.handover_waiting = 0  # the other shards its repair will ask, while it waits for their addresses
        self._repairing: asyncio.Task[None] | None = None
        max_message = cfg.max_message_mb << 20
        self.grpc = grpc.aio.server(interceptors=[self.authorizer] if self.authorizer else None,
                                    options=[("grpc.max_receive_message_length", max_message),
                                             ("grpc.max_send_message_length", max_message),
                                             ("grpc.so_reuseport", 0)])  # a port in use fails, not shared
        add_cache_service(CacheService(self), self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection((SERVICE_NAME, health_name, reflection.SERVICE_NAME), self.grpc)

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.port}"

    @property
    def endpoints(self) -> dict[str, str]:
        """What this server bound (its ready file and ready line)."""
        return {"grpc": self.address, "transfer": self.transfer.address,
                "metrics": self.metrics_server.url if self.metrics_server else ""}

    @property
    def transfers_refused(self) -> dict[Refusal, int]:
        """Pushes the transfer endpoint refused so far, by reason (none before it started)."""
        return dict(self._transfer.refused) if self._transfer is not None else {}

    @property
    def transfer(self) -> TransferServer:
        assert self._transfer is not None, "the transfer endpoint starts before gRPC"
        return self._transfer

    async def start(self) -> None:
        """Ports given as 0 are any free ones (read back: ``address``, ``endpoints``); a fixed port that cannot be
        bound raises ``PortInUse`` naming the setting to change, before the pool is opened."""
        cfg = self.cfg
        with binding("gRPC", cfg.host, cfg.port, "--port / KVMESH_CACHESVC_PORT"):
            self.port = tls.add_port(self.grpc, f"{cfg.host}:{cfg.port}")
            if self.port == 0:
                raise OSError(f"cannot bind gRPC to {cfg.host}:{cfg.port}")
        loop = asyncio.get_running_loop()
        # the external store names its manifest by the durable: one per shard
        self.pool = await loop.run_in_executor(self.storage, Pool.from_config,
                                               cfg.model_copy(update={"durable_name": self.durable}),
                                               time.monotonic, self.shared.cluster)
        log.info("pool tiers: %s", ", ".join(f"{t.name} ({len(t)} blocks)" for t in self.pool.tiers) or "none")
        def pool_events(events: list[BlockStored | BlockRemoved]) -> None:  # the storage thread
            loop.call_soon_threadsafe(self._pool_events.extend, events)

        self.pool.on_events = pool_events
        with binding("transfer", cfg.host, cfg.transfer_port, "--transfer-port / KVMESH_CACHESVC_TRANSFER_PORT"):
            self._transfer = await TransferServer.start(
                None, cfg.host, cfg.transfer_port, cfg.transfer_backend,
                ttl=max(30.0, 3 * cfg.transfer_timeout_s), max_buffered_bytes=cfg.transfer_buffer_mb << 20,
                tls=tls.transfer_server_context(self.shared), limits=Limits.of(self.shared))
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.grpc.start()
        self.metrics_server = MetricsServer(self.metrics.registry, cfg.host, cfg.metrics_port)
        log.info("gRPC on %s (NOT_SERVING until the events stream is replayed); transfer on %s; metrics on %s",
                 self.address, self.transfer.address, self.metrics_server.url)

        self.bus = bus = await Bus.connect(self.shared.nats_url, f"cachesvc-{self.durable}",
                                          tls=tls.bus_tls(self.shared))
        await bus.jetstream("the events stream's declaration", lambda: bus.ensure_events_stream(
            self.subjects, replicas=self.shared.events_replicas))
        await self.bus.subscribe(self.subjects.heartbeats_all, self._on_heartbeat)
        await self.bus.subscribe(self.subjects.sessions, self._on_session)
        await self.bus.subscribe(self.subjects.kv_quarantine, self._on_quarantine)
        # The index lives in memory only, so a (re)started cachesvc replays the whole stream: reset the
        # durable's position first. It stays durable for the process's life (survives NATS reconnects).
        async def reset() -> None:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await bus.js.delete_consumer(self.subjects.events_stream, self.durable)

        await bus.jetstream("the durable's reset", reset)
        await bus.jetstream("the durable's creation", lambda: bus.durable_events_consumer(
            self.subjects, self.durable, self._on_events))
        self._reaper = asyncio.create_task(self._reap(), name="cachesvc-reaper")
        await self._replayed()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._beater = asyncio.create_task(self._beat(), name="cachesvc-beat")
        self._start_repair()
        log.info("serving cluster %r: stream %s, durable %r, %d blocks indexed", self.shared.cluster,
                 self.subjects.events_stream, self.durable, len(self.index))

    def _start_repair(self) -> None:
        """A shard fetches, given ``peers``, what it lacks of its blocks from their other copies and the blocks of
        its slots other shards hold from before a resharding (``repair.py``)."""
        cfg, smap = self.cfg, self.shard_map
        if cfg.leaving:
            log.warning("shard %d of %d: leaving the cluster; it owns no slots, takes no writes and serves its pool "
                        "only to the other shards' hand-over: stop it once each of them reports "
                        "handover_pending_shards 0", cfg.shard, smap.shards)
            return
        listed = cfg.peer_addresses
        if smap.shards == 1 and cfg.peers != DISCOVER and len(listed) <= 1:
            return  # one shard, none leaving: nothing to fetch from anywhere
        if not cfg.repair_mb_s:
            log.info("repair_mb_s is 0: what this shard's pool lost before this start, and blocks of its slots "
                     "other shards hold from before a resharding, are not fetched")
            return
        if not cfg.peers:
            log.info("no peers set: what this shard's pool lost before this start, and blocks of its slots other "
                     "shards hold from before a resharding, are not fetched (set peers to every shard's address, "
                     "in shard order, or \"nats\")")
            return
        assert self.pool is not None
        pool = self.pool

        async def storage(fn: Callable[..., R], *args: Any) -> R:
            return await asyncio.get_running_loop().run_in_executor(self.storage, fn, *args)

        def counted(source: int, blocks: int, nbytes: int) -> None:
            self.metrics.repaired_blocks.labels(str(source)).inc(blocks)
            self.metrics.repaired_bytes.labels(str(source)).inc(nbytes)

        async def repair() -> None:
            peers: dict[int, str] = dict(enumerate(listed))
            if cfg.peers == DISCOVER:  # the shards' beats (this one's own too) name them, and those leaving
                assert self.bus is not None
                directory = ShardDirectory()
                await directory.start(self.bus, self.subjects)
                while len(view := await directory.wait(PEERS_WAIT_S, smap.shards)) != smap.shards:
                    log.info("repair waits for the beats of all %d shards (heard a whole list of %d)", smap.shards,
                             len(view))
                await asyncio.sleep(2 * BEAT_S)  # a leaving shard beats as often as the others: hear it too
                peers = dict(enumerate(view)) | directory.leaving(smap.shards)
                log.info("repair: the shards' beats name %s", ", ".join(f"{i}: {a}" for i, a in peers.items()))
            if len(peers) <= 1:
                return
            self.repair = Repair(cfg, self.shared, smap, pool, storage, counted, peers)
            await self.repair.run()

        self.handover_waiting = max(smap.shards, len(listed)) - 1
        self._repairing = asyncio.create_task(repair(), name="cachesvc-repair")
        self._repairing.add_done_callback(_repair_ended)

    async def _replayed(self) -> None:
        """Return once the consumer has handled (and acked) everything the stream held when it was created."""
        assert self.bus is not None
        while True:
            info = await self.bus.js.consumer_info(self.subjects.events_stream, self.durable)
            if not info.num_pending and not info.num_ack_pending:
                self.caught_up = True
                return
            await asyncio.sleep(0.05)

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        for task in (self._reaper, self._repairing, self._beater):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.repair is not None:
            await self.repair.close()
        await self.grpc.stop(grace_s)
        await self.transfer_client.close()
        if self._transfer is not None:
            await self._transfer.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        await self.resync.close()
        if self.bus is not None:
            await self.bus.close()
        if self.pool is not None:
            pool = self.pool
            spilled = await asyncio.get_running_loop().run_in_executor(self.storage, pool.drain)
            await asyncio.get_running_loop().run_in_executor(self.storage, pool.close)
            if spilled:
                log.info("spilled %d DRAM blocks to the %s tier", spilled, pool.tiers[1].name)
        self.storage.shutdown()
        log.info("stopped")

    async def _fetch_snapshot(self, instance_id: str) -> Snapshot | None:
        assert self.bus is not None
        return await request_snapshot(self.bus, self.subjects, instance_id, self.cfg.snapshot_timeout_s)

    async def _on_events(self, batch: KVEventBatch, headers: dict[str, str]) -> None:
        self._last_seen.setdefault(batch.instance_id, time.monotonic())  # no beat yet: count from now
        self.resync.on_batch(batch)
        if self.caught_up:  # the replay at start describes a past that the instances' own state has left
            await self.tell_copies(self.copies.after_batch(batch))

    async def tell_copies(self, changes: CopyChanges) -> None:
        """Tell each instance which of its blocks gained or lost their other copies; mark the pool's own."""
        if not changes or self.bus is None:
            return
        for inst, msg in changes.instances.items():
            try:
                await self.bus.publish(self.subjects.kv_copies(inst), msg)
            except Exception as e:  # noqa: BLE001 - advisory: the instance evicts as if it had not heard
                log.warning("could not tell %s about %d shared / %d sole blocks: %s", inst, len(msg.shared),
                            len(msg.sole), e)
        if (changes.pool_shared or changes.pool_sole) and self.pool is not None:
            await asyncio.get_running_loop().run_in_executor(self.storage, self.pool.mark_replicated,
                                                             changes.pool_shared, changes.pool_sole)

    async def _on_session(self, msg: Message, headers: dict[str, str]) -> None:
        if isinstance(msg, SessionSignal) and self.pool is not None:
            await asyncio.get_running_loop().run_in_executor(self.storage, self.pool.session_signal, msg.session,
                                                             msg.event, msg.expected_s)

    async def _on_quarantine(self, msg: Message, headers: dict[str, str]) -> None:
        if isinstance(msg, KVQuarantine) and self.pool is not None:
            log.warning("instance %s's KV canary quarantined %d blocks (%s reuse): the pool no longer serves them",
                        msg.instance_id, len(msg.block_keys), msg.path)
            await asyncio.get_running_loop().run_in_executor(self.storage, self.pool.quarantine, msg.block_keys)

    async def _on_heartbeat(self, msg: Message, headers: dict[str, str]) -> None:
        if isinstance(msg, Heartbeat):
            if msg.instance_id in self._dropped:  # silent a while (a busy host, a stalled loop), not gone
                self._dropped.discard(msg.instance_id)
                log.warning("instance %s: heard again after it was dropped; resyncing from its snapshot",
                            msg.instance_id)
                self.resync.refresh([msg.instance_id])
            self._last_seen[msg.instance_id] = time.monotonic()
            if msg.transfer_address:
                self._transfer_addresses[msg.instance_id] = msg.transfer_address

    def check_view(self, view: cache_pb2.ShardView) -> None:
        """A sharded cachesvc answers only a caller that addresses this shard of this many; a lone one also an
        unsharded caller (no view)."""
        shard, shards = self.cfg.shard, self.cfg.shards
        if view.shards == 0 and shards == 1 and not self.cfg.leaving or (view.shard, view.shards) == (shard, shards):
            return
        if view.shards == 0:
            raise WrongShard(f"this cachesvc is shard {shard} of {shards}: list all {shards} shards' addresses, "
                             "in shard order, in cachesvc_address (comma-separated)")
        raise WrongShard(f"this cachesvc is shard {shard} of {shards}, not shard {view.shard} of {view.shards}: "
                         f"cachesvc_address must list the {shards} shards in shard order")

    def check_owned(self, keys: Sequence[int]) -> None:
        """A sharded pool stores only the keys whose pool it holds (a leaving shard, none)."""
        if self.cfg.shards == 1 and not self.cfg.leaving:
            return
        smap, shard = self.shard_map, self.cfg.shard
        other = [(k, smap.pool_owners(k)) for k in keys if shard not in smap.pool_owners(k)]
        if other:
            key, owners = other[0]
            raise WrongShard(f"{len(other)} of the {len(keys)} block keys belong to other shards' pools (key "
                             f"{key:#x}: shards {', '.join(map(str, owners))}): put each block to the shards "
                             "kvmesh.contracts.shards maps it to")

    @staticmethod
    def check_copy_caller(who: Identity | None) -> None:
        """A copy (a repair's) carries which sessions hold each block, and so names other tenants' sessions: it is
        for another shard alone. No check on a plaintext server (who: None)."""
        if who is not None and who.role is not MeshRole.CACHESVC:
            raise CopyRefused(f"GetBlocks with copy is for cachesvc shards (a repair), not {who}: read the blocks "
                              "without copy")

    def check_own_address(self, who: Identity | None, address: str) -> None:
        """A GetBlocks push goes only to the transfer endpoint the calling instance announced (its heartbeat):
        cachesvc never dials a host:port a caller merely names. No check on a plaintext server (who: None)."""
        if who is None or self._transfer_addresses.get(who.instance) == address:
            return
        own = self._transfer_addresses.get(who.instance)
        raise ForeignAddress(f"transfer_address {address!r} is not {who}'s own transfer endpoint "
                             f"({own!r} by its heartbeats): blocks are pushed only to the caller's endpoint")

    async def _reap(self) -> None:
        """Drop the blocks of every instance silent for longer than ``instance_timeout_s``; end expired leases and
        write the external tier's manifest when it is due (``Pool.maintain``). While NATS is down nobody is
        dropped (no heartbeat could arrive); once it is back (reconnected), every instance gets
        ``instance_timeout_s`` to be heard again and is asked for a snapshot (``Resync.refresh``). A dropped
        instance heard again (it was slow, not gone) is asked for its snapshot too (``_on_heartbeat``)."""
        timeout = self.cfg.instance_timeout_s
        loop = asyncio.get_running_loop()
        reconnects = self._reconnects()
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            if not self._bus_up():
                self._last_seen = dict.fromkeys(self._last_seen, now)
                self.bus_outage = True
            elif self.bus_outage or self._reconnects() != reconnects:  # back (a short outage between two ticks too)
                reconnects, self.bus_outage = self._reconnects(), False
                self._last_seen = dict.fromkeys(self._last_seen, now)
                log.warning("NATS is back: resyncing the %d indexed instances from their snapshots",
                            len(self.index.instances()))
                self.resync.refresh(self.index.instances())
            for inst, seen in list(self._last_seen.items()):
                if now - seen > timeout:
                    del self._last_seen[inst]
                    if inst in self.index.instances():
                        self._dropped.add(inst)
                        dropped = self.index.drop_instance(inst)
                        log.warning("instance %s: no heartbeat for %.1fs; dropped its %d indexed blocks",
                                    inst, now - seen, dropped)
            if self.pool is not None:
                await loop.run_in_executor(self.storage, self.pool.maintain)
                await self._publish_pool_events()

    @property
    def advertised(self) -> str:
        """The gRPC address its beat tells callers to dial ("" when it binds a wildcard address and was given no
        ``advertise_host``)."""
        host = self.cfg.advertise_host or ("" if self.cfg.host in ("0.0.0.0", "::", "") else self.cfg.host)
        return f"{host}:{self.port}" if host else ""

    async def _beat(self) -> None:
        """Its shard, the count and its address on ``cache.shard.<shard>`` every ``BEAT_S``, from the time it serves:
        callers with ``cachesvc_address = "nats"`` find the shards so (``kvmesh.bus.shard_directory``)."""
        assert self.bus is not None
        smap, address = self.shard_map, self.advertised
        if not address:
            log.warning("cachesvc binds %s and has no advertise_host: its beat names no address, so callers that "
                        "find cachesvc through the bus cannot use this shard (set KVMESH_CACHESVC_ADVERTISE_HOST)",
                        self.cfg.host)
        subject = self.subjects.cachesvc_shard(self.cfg.shard)
        while True:
            if self._bus_up():
                beat = CacheShardBeat(self.cfg.shard, smap.shards, address, time.time(), smap.copies, smap.pool_copies)
                try:
                    await self.bus.publish(subject, beat)
                except Exception as e:  # noqa: BLE001 - the next beat tries again
                    log.debug("beat not published: %s", e)
            await asyncio.sleep(BEAT_S)

    async def _publish_pool_events(self) -> None:
        """What the pool's tiers stored and removed since the last tick, on ``pool.events`` (the routers' hit
        attribution names a block evicted from the pool). While NATS is down they wait, the oldest dropped past
        ``POOL_EVENTS_HELD`` keys (a gap only blurs an explanation)."""
        held = sum(len(e.block_keys) for e in self._pool_events)
        while held > POOL_EVENTS_HELD and self._pool_events:
            held -= len(self._pool_events.pop(0).block_keys)
        if not self._pool_events or self.bus is None or not self._bus_up():
            return
        events, self._pool_events = self._pool_events, []
        batch: list[BlockStored | BlockRemoved] = []
        size = 0
        for i, e in enumerate(events):
            batch.append(e)
            size += len(e.block_keys)
            if size >= POOL_EVENTS_PER_MESSAGE or i == len(events) - 1:
                self._pool_seq += 1
                msg = KVEventBatch(InstanceId(POOL_INSTANCE), self._pool_seq, time.time(), tuple(batch))
                try:
                    await self.bus.publish(self.subjects.pool_events, msg)
                except Exception as e:  # noqa: BLE001 - attribution only: never fails the pool
                    log.debug("pool events not published: %s", e)
                    return
                batch, size = [], 0

    def _bus_up(self) -> bool:
        return self.bus is not None and self.bus.nc.is_connected

    def _reconnects(self) -> int:
        return int(self.bus.nc.stats["reconnects"]) if self.bus is not None else 0


async def serve(cfg: CacheServiceSettings, shared: SharedSettings | None = None) -> None:
    """Run until SIGTERM or SIGINT, then shut down cleanly. Once serving, report the bound endpoints
    (``kvmesh.ready``: the ready line, and ``shared.ready_file`` when set)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    shared = shared or SharedSettings()
    server = CacheServer(cfg, shared)
    try:
        await server.start()
        report_ready("cachesvc", server.endpoints, shared.ready_file)
        await stop.wait()
        log.info("signal received, shutting down")
    finally:
        await server.stop()


def _repair_ended(task: asyncio.Task[None]) -> None:
    """Say why a repair stopped early (its own errors are handled inside; this is a defect's trace)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("repair stopped: %s; blocks this shard lost stay missing until written again", task.exception(),
                  exc_info=task.exception())
