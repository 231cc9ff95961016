"""The cache service process: gRPC ``CacheService`` + health + reflection, fed by the KV events stream.

One asyncio loop owns everything: the index and the pool are touched only from it (gRPC handlers, the events
consumer, the heartbeat subscriber and the reaper all run on it), so they need no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import time
from typing import Any, Awaitable, Callable, TypeVar

import grpc
import nats.js.errors
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.bus import Bus, Heartbeat, KVEventBatch, Message, Subjects
from kvmesh.engine.kv_cache import KVLayout
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc, common_pb2
from services.cachesvc.config import CacheServiceConfig
from services.cachesvc.index import BlockIndex
from services.cachesvc.pool import BlockPool, LayoutMismatch, PoolFull

log = logging.getLogger("cachesvc")

SERVICE_NAME = cache_pb2.DESCRIPTOR.services_by_name["CacheService"].full_name  # kvmesh.v1.CacheService
POOL_INSTANCE, POOL_TIER = "pool", "dram"
_MESSAGE_OVERHEAD = 64 << 10  # room for keys and checksums next to the data of a GetBlocks reply

R = TypeVar("R")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]]


def layout_from_proto(msg: common_pb2.BlockLayout) -> KVLayout:
    return KVLayout(model_fingerprint=msg.model_fingerprint, num_layers=msg.num_layers,
                    num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim, block_size=msg.block_size,
                    dtype=msg.dtype, layout=msg.layout, tp_rank=msg.tp_rank, tp_size=msg.tp_size)


def _request_layout(request: Any) -> KVLayout:
    if not request.HasField("layout"):
        raise ValueError("layout is required: set the BlockLayout the blocks were written with")
    return layout_from_proto(request.layout)


def _statuses(method: Handler[R]) -> Handler[R]:
    """Bad input becomes a gRPC status whose message says what to fix; the server keeps serving."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await method(self, request, context)
        except LayoutMismatch as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except PoolFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        raise AssertionError("unreachable: abort raises")

    return wrapper


class CacheService(cache_pb2_grpc.CacheServiceServicer):
    def __init__(self, index: BlockIndex, pool: BlockPool, max_reply_bytes: int) -> None:
        self.index = index
        self.pool = pool
        self.max_reply_bytes = max_reply_bytes

    @_statuses
    async def MatchPrefix(self, request: cache_pb2.MatchPrefixRequest,
                          context: grpc.aio.ServicerContext) -> cache_pb2.MatchPrefixResponse:
        keys = list(request.block_keys)
        matches = [cache_pb2.TierMatch(instance_id=m.instance_id, tier=m.tier, num_blocks=m.num_blocks)
                   for m in self.index.match_prefix(keys)]
        in_pool = self.pool.leading(keys)
        if in_pool:
            matches.append(cache_pb2.TierMatch(instance_id=POOL_INSTANCE, tier=POOL_TIER, num_blocks=in_pool))
        return cache_pb2.MatchPrefixResponse(matches=matches)

    @_statuses
    async def PutBlocks(self, request: cache_pb2.PutBlocksRequest,
                        context: grpc.aio.ServicerContext) -> cache_pb2.PutBlocksResponse:
        result = self.pool.put(_request_layout(request), request.block_keys, request.checksums, request.data)
        return cache_pb2.PutBlocksResponse(stored=result.stored, skipped=result.skipped)

    @_statuses
    async def GetBlocks(self, request: cache_pb2.GetBlocksRequest,
                        context: grpc.aio.ServicerContext) -> cache_pb2.GetBlocksResponse:
        blocks = self.pool.get(_request_layout(request), request.block_keys, max_bytes=self.max_reply_bytes)
        return cache_pb2.GetBlocksResponse(block_keys=[b.key for b in blocks],
                                           checksums=[b.checksum for b in blocks],
                                           data=b"".join(b.data for b in blocks))

    @_statuses
    async def Stats(self, request: cache_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> cache_pb2.StatsResponse:
        return cache_pb2.StatsResponse(
            indexed_blocks=len(self.index), instances=len(self.index.instances()),
            pool_blocks=len(self.pool), pool_bytes=self.pool.used_bytes,
            pool_capacity_bytes=self.pool.capacity_bytes, events_applied=self.index.events_applied,
            event_gaps=self.index.event_gaps)


class CacheServer:
    """gRPC server + NATS side. ``start()`` returns once the events consumer is attached (health SERVING)."""

    def __init__(self, cfg: CacheServiceConfig) -> None:
        self.cfg = cfg
        self.subjects = Subjects(cfg.cluster)
        self.index = BlockIndex()
        self.pool = BlockPool(cfg.pool_capacity_mb << 20, cfg.eviction)
        self.health = health.aio.HealthServicer()
        self.port = 0
        self.bus: Bus | None = None
        self._last_seen: dict[str, float] = {}  # instance -> monotonic time of its last heartbeat
        self._reaper: asyncio.Task[None] | None = None
        max_message = cfg.max_message_mb << 20
        self.grpc = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message),
                                             ("grpc.max_send_message_length", max_message)])
        cache_pb2_grpc.add_CacheServiceServicer_to_server(
            CacheService(self.index, self.pool, max_message - _MESSAGE_OVERHEAD), self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection((SERVICE_NAME, health_name, reflection.SERVICE_NAME), self.grpc)

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.port}"

    async def start(self) -> None:
        self.port = self.grpc.add_insecure_port(f"{self.cfg.host}:{self.cfg.port}")
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.grpc.start()
        log.info("gRPC on %s (NOT_SERVING until the events consumer is attached)", self.address)

        self.bus = await Bus.connect(self.cfg.nats_url, f"cachesvc-{self.cfg.durable_name}")
        await self.bus.ensure_events_stream(self.subjects)
        await self.bus.subscribe(self.subjects.heartbeats_all, self._on_heartbeat)
        # The index lives in memory only, so a (re)started cachesvc replays the whole stream: reset the
        # durable's position first. It stays durable for the process's life (survives NATS reconnects).
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.bus.js.delete_consumer(self.subjects.events_stream, self.cfg.durable_name)
        await self.bus.durable_events_consumer(self.subjects, self.cfg.durable_name, self._on_events)
        self._reaper = asyncio.create_task(self._reap(), name="cachesvc-reaper")
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving cluster %r: stream %s, durable %r", self.cfg.cluster, self.subjects.events_stream,
                 self.cfg.durable_name)

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.grpc.stop(grace_s)
        if self.bus is not None:
            await self.bus.close()
        log.info("stopped")

    async def _on_events(self, batch: KVEventBatch, headers: dict[str, str]) -> None:
        self._last_seen.setdefault(batch.instance_id, time.monotonic())  # no beat yet: count from now
        if self.index.apply(batch):
            log.debug("applied %s seq %d (%d events)", batch.instance_id, batch.seq, len(batch.events))

    async def _on_heartbeat(self, msg: Message, headers: dict[str, str]) -> None:
        if isinstance(msg, Heartbeat):
            self._last_seen[msg.instance_id] = time.monotonic()

    async def _reap(self) -> None:
        """Drop the blocks of every instance silent for longer than ``instance_timeout_s``."""
        timeout = self.cfg.instance_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            for inst, seen in list(self._last_seen.items()):
                if now - seen > timeout:
                    del self._last_seen[inst]
                    if inst in self.index.instances():
                        dropped = self.index.drop_instance(inst)
                        log.warning("instance %s: no heartbeat for %.1fs; dropped its %d indexed blocks",
                                    inst, now - seen, dropped)


async def serve(cfg: CacheServiceConfig) -> None:
    """Run until SIGTERM or SIGINT, then shut down cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = CacheServer(cfg)
    try:
        await server.start()
        await stop.wait()
        log.info("signal received, shutting down")
    finally:
        await server.stop()
