"""One engine instance as a service: the engine thread, gRPC (Prefill and/or Decode), the transfer engine,
KV events on the bus (JetStream), ``kv.ready`` and heartbeats."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc

from kvmesh.bus import Bus, Heartbeat, KVEventBatch, KVReady, Subjects
from kvmesh.config import EngineConfig
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.llm_engine import LLMEngine
from kvmesh.events import AllBlocksCleared, KVEvent
from kvmesh.grpc_server import ServiceServer
from kvmesh.proto.v1 import worker_pb2_grpc
from kvmesh.transfer import TransferServer
from kvmesh.worker.config import WorkerConfig
from kvmesh.worker.decode import DecodeServicer
from kvmesh.keys import block_keys
from kvmesh.worker.pool_client import PoolClient
from kvmesh.worker.prefill import PrefillServicer

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, cfg: WorkerConfig, engine_cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.engine_cfg = engine_cfg
        self.subjects = Subjects(cfg.cluster)
        self.instance_id = cfg.instance_id
        self.metrics_fallbacks = 0
        self._event_seq = 0
        self._event_queue: asyncio.Queue[list[KVEvent]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    @property
    def serves_prefill(self) -> bool:
        return self.cfg.role in ("prefill", "both")

    @property
    def serves_decode(self) -> bool:
        return self.cfg.role in ("decode", "both")

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        llm = await loop.run_in_executor(None, LLMEngine, self.engine_cfg)
        self.layout = llm.layout
        self.fingerprint = llm.fingerprint
        self.engine = AsyncEngine(llm, loop, on_events=self._event_queue.put_nowait)
        names = [n for n, on in (("kvmesh.v1.Prefill", self.serves_prefill),
                                 ("kvmesh.v1.Decode", self.serves_decode)) if on]
        self.grpc = ServiceServer(names)
        self.grpc_address = self.grpc.bind(self.cfg.host, self.cfg.port)
        if not self.instance_id:
            self.instance_id = f"{self.cfg.role}-{self.grpc.port}"
        self.bus = await Bus.connect(self.cfg.nats_url, name=self.instance_id)
        await self.bus.ensure_events_stream(self.subjects)
        self._event_queue.put_nowait([AllBlocksCleared()])  # a fresh instance holds nothing, whatever it held
        self.pool = PoolClient(self.cfg.cachesvc_address, self.layout) if self.cfg.cachesvc_address else None
        self.transfer_server = None
        if self.serves_decode:
            self.transfer_server = await TransferServer.start(self.layout, host=self.cfg.host,
                                                              port=self.cfg.transfer_port,
                                                              backend=self.cfg.transfer_backend)
            self.decode = DecodeServicer(self, self.transfer_server)
            worker_pb2_grpc.add_DecodeServicer_to_server(self.decode, self.grpc.server)
            await self.bus.subscribe(self.subjects.kv_ready(self.instance_id), self._on_kv_ready)
        if self.serves_prefill:
            self.prefill = PrefillServicer(self)
            worker_pb2_grpc.add_PrefillServicer_to_server(self.prefill, self.grpc.server)
        await self.grpc.start()
        self._tasks = [asyncio.create_task(self._publish_events()), asyncio.create_task(self._heartbeat())]
        await self.grpc.set_serving(True)
        log.info("%s serving gRPC on %s (transfer %s)", self.instance_id, self.grpc_address,
                 self.transfer_address or "-")

    @property
    def transfer_address(self) -> str:
        return self.transfer_server.address if self.transfer_server is not None else ""

    async def warm_from_pool(self, prompt: list[int], cache_salt: str, pool_blocks: int) -> int:
        """Before computing a prompt: when the pool holds a longer prefix than our cache (by at least
        ``pool_fetch_min_blocks``), fetch the difference into our cache. Returns the blocks fetched."""
        if self.pool is None or pool_blocks == 0:
            return 0
        llm = self.engine.engine
        seed = llm.namespace_seed(cache_salt)
        bs = self.layout.block_size
        usable = min(pool_blocks, (len(prompt) - 1) // bs)  # the last token is always computed
        local = await self.engine.call(lambda e: len(e.blocks.match(seed, prompt, len(prompt) - 1).nodes))
        if usable - local < self.cfg.pool_fetch_min_blocks:
            return 0
        keys = block_keys(seed, prompt[:usable * bs], bs)[local:]
        try:
            blocks = await self.pool.fetch(keys)
        except (grpc.aio.AioRpcError, ValueError) as e:
            log.warning("pool fetch failed, computing instead: %s", e)
            return 0
        if blocks is None:
            return 0
        n = blocks.shape[0]
        ok = await self.engine.call(lambda e: e.blocks.adopt(seed, prompt[:(local + n) * bs], blocks, local))
        return n if ok else 0

    async def write_back(self, keys: list[int], blocks) -> None:
        """Store a finished request's full blocks in the pool (decode), so any instance can reuse them."""
        if self.pool is None or not keys:
            return
        try:
            await self.pool.write_back(keys, blocks[:len(keys)])
        except grpc.aio.AioRpcError as e:
            log.warning("write-back of %d blocks failed: %s", len(keys), e.details())

    async def announce(self, ready: KVReady) -> None:
        await self.bus.publish(self.subjects.kv_ready(ready.decode_instance), ready)

    async def _on_kv_ready(self, msg: KVReady, headers: dict[str, str]) -> None:
        self.decode.board.post(msg)

    async def _publish_events(self) -> None:
        subject = self.subjects.kv_events(self.instance_id)
        while True:
            events = await self._event_queue.get()
            self._event_seq += 1
            batch = KVEventBatch(self.instance_id, self._event_seq, time.time(), tuple(events))
            try:
                await self.bus.publish_event(subject, batch)
            except Exception:  # noqa: BLE001 - the cache index resyncs on the gap; serving goes on
                log.exception("publishing KV events batch %d failed", self._event_seq)

    async def _heartbeat(self) -> None:
        subject = self.subjects.heartbeat(self.cfg.role, self.instance_id)
        while True:
            load = dataclasses.asdict(self.engine.load())
            load["kv_fallbacks"] = self.metrics_fallbacks
            beat = Heartbeat(instance_id=self.instance_id, role=self.cfg.role, grpc_address=self.grpc_address,
                             transfer_address=self.transfer_address, ts=time.time(), load=load,
                             model=self.fingerprint, block_size=self.layout.block_size)
            try:
                await self.bus.publish(subject, beat)
            except Exception:  # noqa: BLE001
                log.exception("heartbeat failed")
            await asyncio.sleep(self.cfg.heartbeat_s)

    async def stop(self) -> None:
        await self.grpc.stop()
        for t in self._tasks:
            t.cancel()
        if self.serves_prefill:
            await self.prefill.close()
        if self.transfer_server is not None:
            await self.transfer_server.close()
        if self.pool is not None:
            await self.pool.close()
        await self.bus.close()
        self.engine.close()


async def serve(cfg: WorkerConfig, engine_cfg: EngineConfig) -> None:
    """Run until SIGTERM/SIGINT."""
    import signal  # noqa: PLC0415

    worker = Worker(cfg, engine_cfg)
    await worker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("%s stopping", worker.instance_id)
    await worker.stop()
