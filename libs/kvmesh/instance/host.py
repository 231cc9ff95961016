"""Hosting one engine instance: the engine thread, the gRPC server, the transfer engine, KV events on the bus
(JetStream), snapshots, heartbeats, metrics, the pool client and warm-from-pool.

The host serves no RPC of its own: each service's entry point hands it the roles it serves (``RolePlugin``: the
gRPC service's name, whether it receives pushed KV, and how to attach its servicer once the host is up). So this
library knows no service; ``services/prefill``, ``services/decode`` and ``app/both.py`` compose it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from opentelemetry.trace import Span, StatusCode

from kvmesh import tls
from kvmesh.authz import Authorizer
from kvmesh.bus import Bus, Subjects
from kvmesh.bus.shard_directory import DISCOVER, ShardDirectory
from kvmesh.bus.snapshot import answer_snapshots
from kvmesh.contracts.engine import RequestTiming, SessionHint
from kvmesh.contracts.events import AllBlocksCleared, KVEvent
from kvmesh.contracts.ids import BlockKey, InstanceId
from kvmesh.contracts.keys import block_keys
from kvmesh.contracts.messages import (
    FEATURES,
    Heartbeat,
    InstanceLoad,
    KVCopies,
    KVEventBatch,
    KVQuarantine,
    Message,
    SessionSignal,
)
from kvmesh.contracts.sessions import SessionEvent
from kvmesh.engines import Engine, start_engine
from kvmesh.grpc_server import ServiceServer
from kvmesh.instance import adapters
from kvmesh.instance.metrics import WorkerMetrics
from kvmesh.instance.pool_client import PoolClient, PoolError
from kvmesh.instance.session_contexts import SessionContexts
from kvmesh.model_source.resolve import model_name
from kvmesh.proto.v1 import worker_pb2, worker_pb2_grpc
from kvmesh.ready import binding, report_ready
from kvmesh.settings import EngineSettings, InstanceSettings, SharedSettings, TelemetrySettings
from kvmesh.telemetry import tracing
from kvmesh.telemetry.metrics import MetricsServer
from kvmesh.transfer import Limits, TransferServer

log = logging.getLogger(__name__)


class Warmed(NamedTuple):
    """A pool fetch before a prompt: the blocks adopted, and the outcome ("" none tried, "adopted", "local cache
    suffices", "below pool_fetch_min_blocks", or "failed: why")."""

    blocks: int
    outcome: str


class Attached(Protocol):
    """A role's servicer once attached to a host: the host closes it as it stops."""

    async def close(self) -> None: ...


@dataclass(frozen=True)
class RolePlugin:
    """What a service hands the host for one role it serves. ``attach`` runs once the engine, the bus, the
    transfer server and the pool client are up, before gRPC starts: it adds its servicer to ``host.grpc.server``
    and subscribes to what it needs on ``host.bus``."""
    grpc_service: str                                  # e.g. "kvmesh.v1.Prefill" (health and reflection)
    attach: Callable[[EngineHost], Awaitable[Attached]]
    receives_kv: bool = False                          # needs a transfer-engine server for pushed KV (decode)


class EngineHost:
    def __init__(self, cfg: InstanceSettings, engine_cfg: EngineSettings, roles: Sequence[RolePlugin],
                 shared: SharedSettings | None = None) -> None:
        if not roles:
            raise ValueError("an engine host serves at least one role")
        self.cfg = cfg
        self.roles = tuple(roles)
        self.attached: list[Attached] = []
        self.engine_cfg = engine_cfg
        self.shared = shared or SharedSettings()
        self.subjects = Subjects(self.shared.cluster)
        self.instance_id = InstanceId(cfg.id)
        self.model_name = model_name(engine_cfg.model)
        self.engine: Engine
        self.metrics = WorkerMetrics()
        self.metrics_server: MetricsServer | None = None
        self.metrics_fallbacks = 0
        self._event_seq = 0
        self._event_queue: asyncio.Queue[list[KVEvent]] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        # sessions' contexts, to warm their KV from the pool before they return; the warms in flight, by session
        self.session_contexts = SessionContexts(cfg.session_context_tokens)
        self._session_warms: dict[str, asyncio.Task] = {}
        self.lora_load_s: float | None = None  # the last LoRA adapter load, measured (heartbeat: lora_load_s)
        self.draining = False  # stopping: its beats say so, its gRPC server takes no new call (drain)
        self.drain_started = asyncio.Event()

    async def start(self) -> None:
        self.engine = await start_engine(self.engine_cfg)
        self.layout = self.engine.layout
        self.fingerprint = self.engine.fingerprint
        # pushes in these layouts are cast on intake (engines.convert); none while the engine's KV cannot be read
        self.kv_accepts = () if self.engine.kv_unconvertible else self.engine_cfg.convert_from()
        self.convertible = frozenset(dataclasses.replace(self.layout, dtype=d) for d in self.kv_accepts)
        self.engine.subscribe(self._event_queue.put_nowait)
        self.metrics.watch(self.engine)
        self.grpc = ServiceServer([r.grpc_service for r in self.roles] + [adapters.SERVICE],
                                  Authorizer(self.cfg.role) if tls.mutual(self.shared) else None)
        if self.grpc.authorizer is not None:
            self.metrics.watch_authorizer(self.grpc.authorizer)
        worker_pb2_grpc.add_AdaptersServicer_to_server(adapters.AdaptersServicer(self), self.grpc.server)
        self.grpc_address = self.grpc.bind(self.cfg.host, self.cfg.port)  # 0: any free port, read back
        if not self.instance_id:
            self.instance_id = InstanceId(f"{self.cfg.role}-{self.grpc.port}")
        self.bus = await Bus.connect(self.shared.nats_url, name=self.instance_id, tls=tls.bus_tls(self.shared))
        # created if missing; cachesvc owns its limits and replicas (an engine may not change them on a mesh NATS)
        await self.bus.jetstream("the events stream's declaration", lambda: self.bus.ensure_events_stream(
            self.subjects, replicas=self.shared.events_replicas, update=False))
        self._event_queue.put_nowait([AllBlocksCleared()])  # a fresh instance holds nothing, whatever it held
        await answer_snapshots(self.bus, self.subjects, self.instance_id, self._snapshot)
        self.transfer_server = None
        # KV intake (decode), and pool fetches land here too
        if any(r.receives_kv for r in self.roles) or self.cfg.cachesvc_address:
            with binding("transfer", self.cfg.host, self.cfg.transfer_port,
                         "--transfer-port / KVMESH_INSTANCE_TRANSFER_PORT"):
                self.transfer_server = await TransferServer.start(self.layout, host=self.cfg.host,
                                                                  port=self.cfg.transfer_port,
                                                                  backend=self.cfg.transfer_backend,
                                                                  tls=tls.transfer_server_context(self.shared),
                                                                  convertible=self.convertible,
                                                                  limits=Limits.of(self.shared))
        if self.transfer_server is not None:
            self.metrics.watch_transfers(self.transfer_server)
        self.pool = None
        self.shard_directory: ShardDirectory | None = None
        if self.cfg.cachesvc_address and self.engine.kv_unconvertible:
            log.error("%s: the pool stays off: %s", self.cfg.role, self.engine.kv_unconvertible)
        elif self.cfg.cachesvc_address:
            discover = self.cfg.cachesvc_address == DISCOVER  # the shards their beats name, as they come
            self.pool = PoolClient("" if discover else self.cfg.cachesvc_address, self.layout, self.transfer_server,
                                   transfer_tls=tls.transfer_client_tls(self.shared),
                                   receive_at=self.advertised(self.transfer_address))
            if discover:
                self.shard_directory = ShardDirectory(on_change=self.pool.use)
                await self.shard_directory.start(self.bus, self.subjects)
        # what the cluster says about the cached blocks: sessions that ended or paused (routers), which blocks have
        # another copy elsewhere (cachesvc)
        await self.bus.subscribe(self.subjects.sessions, self._on_session)
        if self.pool is not None and self.session_contexts.budget:
            self.engine.on_session_due(lambda key: self.warm_session(key, "due"))
        await self.bus.subscribe(self.subjects.kv_copies(self.instance_id), self._on_copies)
        self.engine.on_quarantine(self._quarantined)
        for role in self.roles:
            self.attached.append(await role.attach(self))
        await self.grpc.start()
        self._tasks = [asyncio.create_task(self._publish_events()), asyncio.create_task(self._heartbeat())]
        self.metrics_server = MetricsServer(self.metrics.registry, self.cfg.host, self.cfg.metrics_port)
        await self.grpc.set_serving(True)
        log.info("%s serving gRPC on %s (transfer %s), metrics on %s", self.instance_id, self.grpc_address,
                 self.transfer_address or "-", self.metrics_server.url)

    @property
    def endpoints(self) -> dict[str, str]:
        """What this instance bound (its ready file and ready line)."""
        out = {"grpc": self.grpc_address, "metrics": self.metrics_server.url if self.metrics_server else ""}
        if self.transfer_address:
            out["transfer"] = self.transfer_address
        return out

    @property
    def transfer_address(self) -> str:
        return self.transfer_server.address if self.transfer_server is not None else ""

    def advertised(self, address: str) -> str:
        """``address`` (host:port bound) as other services dial it: ``advertise_host`` when set."""
        if not address or not self.cfg.advertise_host:
            return address
        scheme, sep, where = address.rpartition("://")  # a transfer address is <backend>://host:port
        return f"{scheme}{sep}{self.cfg.advertise_host}:{where.rsplit(':', 1)[1]}"

    def span_attributes(self, work: worker_pb2.WorkRequest, context: Any = None) -> dict[str, Any]:
        """A request's span labels: the client's request id as the router's call metadata names it (else the
        work's), the dispatch id (the work's: what this instance knows the request by), model, tenant salt."""
        client = tracing.request_attributes(context).get(tracing.REQUEST_ID) if context is not None else None
        return {tracing.REQUEST_ID: client or work.request_id, tracing.DISPATCH_ID: work.request_id,
                tracing.MODEL: self.model_name, tracing.TENANT: work.cache_salt, "kvmesh.instance": self.instance_id}

    async def warm_from_pool(self, prompt: list[int], cache_salt: str, pool_blocks: int,
                             parent: Span | None = None, attrs: dict[str, Any] | None = None,
                             lora: str = "", whole: bool = False) -> Warmed:
        """Before computing a prompt: when the pool holds a longer prefix than our cache (by at least
        ``pool_fetch_min_blocks``), fetch the difference into our cache. Returns the blocks fetched and the
        outcome in words (what the router's hit attribution reads). Traced as ``prefill.fetch`` under ``parent``.
        ``whole``: ``prompt`` is a context to warm, not a prompt to compute: its last full block is wanted too."""
        if self.pool is None or pool_blocks == 0:
            return Warmed(0, "")
        span = tracing.start("prefill.fetch", parent, attributes={**(attrs or {}), "kvmesh.tier": "pool",
                                                                 "kvmesh.pool_blocks": pool_blocks})
        try:
            n = await self._warm_from_pool(self.pool, prompt, cache_salt, pool_blocks, span, attrs, lora, whole)
        except BaseException as e:
            span.set_status(StatusCode.ERROR, str(e))
            raise
        finally:
            span.end()
        return n

    async def _warm_from_pool(self, pool: PoolClient, prompt: list[int], cache_salt: str, pool_blocks: int,
                              span: Span, attrs: dict[str, Any] | None = None, lora: str = "",
                              whole: bool = False) -> Warmed:
        try:
            seed = self.engine.namespace(cache_salt, lora)
        except ValueError as e:  # an adapter this instance does not serve: the engine refuses the request
            span.set_attributes({"kvmesh.blocks": 0, "kvmesh.outcome": str(e)})
            return Warmed(0, f"failed: {e}")
        bs = self.layout.block_size
        computed = 0 if whole else 1  # a prompt's last token is always computed
        usable = min(pool_blocks, (len(prompt) - computed) // bs)
        usable -= usable % self.engine.adopt_unit  # what the engine cannot load would be fetched for nothing
        local = await self.engine.match_prefix(seed, prompt, len(prompt) - computed)
        span.set_attribute("kvmesh.local_blocks", local)
        if usable - local < self.cfg.pool_fetch_min_blocks:
            outcome = "local cache suffices" if usable <= local else "below pool_fetch_min_blocks"
            span.set_attributes({"kvmesh.blocks": 0, "kvmesh.outcome": outcome})
            return Warmed(0, outcome)
        keys = block_keys(seed, prompt[:usable * bs], bs)[local:]
        try:
            fetched = await pool.fetch(keys, tracing.grpc_metadata(span) + tracing.request_metadata(attrs))
        except PoolError as e:
            log.warning("pool fetch failed, computing instead: %s", e)
            span.set_status(StatusCode.ERROR, f"pool fetch failed: {e}")
            return Warmed(0, f"failed: {e}")
        if fetched is None:
            span.set_attributes({"kvmesh.blocks": 0, "kvmesh.outcome": "pool had none"})
            return Warmed(0, "failed: the pool had none of them")
        n = fetched.num_blocks
        nbytes = n * self.layout.block_nbytes
        self.metrics.transfer_bytes.labels("pool_fetch").inc(nbytes)
        ok = await self.engine.adopt(seed, prompt, local, fetched.data, n)
        span.set_attributes({"kvmesh.blocks": n if ok else 0, "kvmesh.bytes": nbytes,
                             "kvmesh.outcome": "adopted" if ok else "no room"})
        return Warmed(n, "adopted") if ok else Warmed(0, "failed: no room in the cache for the fetched blocks")

    def record_engine_spans(self, parent: Span, timing: RequestTiming, attrs: dict[str, Any], prompt_tokens: int,
                            cached_tokens: int) -> None:
        """``prefill.queue`` (handed to the engine → first scheduled) and ``prefill.compute`` (→ first token out
        of the engine) of a request the engine computed, from the timestamps the engine thread took."""
        if not parent.is_recording() or not timing.scheduled:
            return
        off = time.time_ns() - time.monotonic_ns()
        ns = lambda t: off + int(t * 1e9)
        tracing.record("prefill.queue", parent, ns(timing.submitted), ns(timing.scheduled),
                       {**attrs, "kvmesh.engine_wait_ms": round((timing.started - timing.submitted) * 1e3, 3)})
        tracing.record("prefill.compute", parent, ns(timing.scheduled), ns(timing.first_output),
                       {**attrs, "kvmesh.tokens.prompt": prompt_tokens, "kvmesh.tokens.reused": cached_tokens,
                        "kvmesh.tokens.computed": prompt_tokens - cached_tokens,
                        "kvmesh.preemptions": timing.preemptions})

    async def _on_session(self, msg: Message, headers: dict[str, str]) -> None:
        """A session signal for every cache; ``RESUME`` only for the instance it names (where the request
        goes), which also fetches what the pool holds of the session's context."""
        if not isinstance(msg, SessionSignal):
            return
        stale = msg.event in (SessionEvent.PAUSE, SessionEvent.DEMOTE) and msg.instance not in ("", self.instance_id)
        if msg.event in (SessionEvent.END, SessionEvent.RELEASE) or stale:  # stale: its last request ran elsewhere
            self.session_contexts.forget(msg.session)
        if msg.event is not SessionEvent.RESUME or msg.instance == self.instance_id:
            self.engine.signal_session(msg)
        if msg.event is SessionEvent.RESUME and msg.instance == self.instance_id:
            self.warm_session(msg.session, "resume")

    # ---- sessions' KV from the pool, ahead of their next request ---------------------------------------------
    def remember_session(self, session: SessionHint | None, cache_salt: str, lora: str,
                         tokens: Sequence[int]) -> None:
        """A request of ``session`` ended here with ``tokens`` of context (its prompt and output): what to warm
        from the pool should the session return after its blocks have left this instance (its last request:
        nothing to keep)."""
        if session is None or self.pool is None:
            return
        if session.end:
            self.session_contexts.forget(session.key)
        else:
            self.session_contexts.remember(session.key, cache_salt, lora, tokens)

    def warm_session(self, key: str, trigger: str) -> None:
        """Fetch what the pool holds of session ``key``'s context past our cache, in the background (``trigger``:
        ``resume``, its next request reached a router; ``due``, it is about to return). Nothing when this
        instance keeps no context of it, or a warm of it is in flight."""
        ctx = self.session_contexts.get(key)
        if ctx is None or self.pool is None or key in self._session_warms:
            return
        bs = self.layout.block_size

        async def warm() -> None:
            span = tracing.start("session.warm", None, attributes={"kvmesh.instance": self.instance_id,
                                                                   "kvmesh.trigger": trigger})
            try:
                warmed = await self.warm_from_pool(list(ctx.tokens), ctx.cache_salt, len(ctx.tokens) // bs, span,
                                                   lora=ctx.lora, whole=True)
                self.metrics.session_warm_blocks.labels(trigger).inc(warmed.blocks)
            except Exception as e:  # noqa: BLE001 - a warm-up is a bet: the request fetches or computes anyway
                log.warning("warming session KV from the pool failed: %s", e)
                span.set_status(StatusCode.ERROR, str(e))
            finally:
                span.end()
                self._session_warms.pop(key, None)

        task = asyncio.ensure_future(warm())
        self._session_warms[key] = task
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def session_warmed(self, key: str) -> None:
        """Wait for a warm of session ``key`` in flight (its request arrived while the pool's blocks were on
        their way: fetching them again would only race it)."""
        task = self._session_warms.get(key)
        if task is not None:
            await asyncio.wait([task])

    def _quarantined(self, keys: list[BlockKey], path: str) -> None:
        """The engine's KV canary quarantined ``keys``: the pool must not serve its copies either."""
        msg = KVQuarantine(self.instance_id, tuple(keys), path)

        async def tell() -> None:
            try:
                await self.bus.publish(self.subjects.kv_quarantine, msg)
            except Exception as e:  # noqa: BLE001 - the instance's own cache is quarantined regardless
                log.error("could not tell the pool of %d quarantined blocks: %s", len(keys), e)

        task = asyncio.ensure_future(tell())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _on_copies(self, msg: Message, headers: dict[str, str]) -> None:
        if isinstance(msg, KVCopies) and msg.instance_id == self.instance_id:
            self.engine.cluster_copies(msg.shared, msg.sole)

    async def _snapshot(self) -> tuple[int, list[tuple[BlockKey, str]]]:
        """What cachesvc asks for after a gap in our events: the sequence number first, then the blocks."""
        seq = self._event_seq
        return seq, await self.engine.held_blocks()

    async def _publish_events(self) -> None:
        subject = self.subjects.kv_events(self.instance_id)
        while True:
            events = await self._event_queue.get()
            self._event_seq += 1
            batch = KVEventBatch(self.instance_id, self._event_seq, time.time(), tuple(events))
            try:
                await self.bus.publish_event(subject, batch)
            except Exception:
                log.exception("publishing KV events batch %d failed", self._event_seq)

    def _beat(self) -> Heartbeat:
        load = InstanceLoad.of(self.engine.load(), self.engine.speed(), kv_fallbacks=self.metrics_fallbacks,
                               kv_block_bytes=self.layout.block_nbytes, lora_load_s=self.lora_load_s)
        return Heartbeat(instance_id=self.instance_id, role=self.cfg.role,
                         grpc_address=self.advertised(self.grpc_address),
                         transfer_address=self.advertised(self.transfer_address), ts=time.time(), load=load,
                         model=self.fingerprint, block_size=self.layout.block_size,
                         loras=tuple((a.name, a.generation, a.path) for a in self.engine.adapters()),
                         kv_layout=self.layout, kv_accepts=self.kv_accepts,
                         kv_unconvertible=self.engine.kv_unconvertible, draining=self.draining,
                         features=FEATURES)

    async def _publish_beat(self) -> None:
        try:
            await self.bus.publish(self.subjects.heartbeat(self.cfg.role, self.instance_id), self._beat())
        except Exception:
            log.exception("heartbeat failed")

    async def _heartbeat(self) -> None:
        while True:
            await self._publish_beat()
            await asyncio.sleep(self.cfg.heartbeat_s)

    async def drain(self) -> None:
        """Stop taking requests and let the running ones finish, for ``drain_s`` at most: a beat saying so goes
        out at once (routers send new requests elsewhere from then on; older routers learn it when the beats stop),
        the gRPC server refuses new calls, and the calls in flight (a stream's tokens, a prefill and its push) run
        on, KV transfers too. What still runs after ``drain_s`` is cut: its routers migrate it, as from a dead
        instance."""
        self.draining = True
        await self._publish_beat()
        with contextlib.suppress(Exception):  # out now, not when the client's flusher gets to it
            await self.bus.nc.flush(timeout=2)
        self.drain_started.set()
        load = self.engine.load()
        log.info("%s draining: no new requests; the %d running and %d waiting may take %gs to finish",
                 self.instance_id, load.running, load.waiting, self.cfg.drain_s)
        started = time.monotonic()
        await self.grpc.stop(self.cfg.drain_s)
        log.info("%s drained in %.1fs", self.instance_id, time.monotonic() - started)

    async def stop(self) -> None:
        if not self.draining:
            await self.drain()
        if self.metrics_server is not None:
            self.metrics_server.close()
        for t in [*self._tasks, *self._session_warms.values()]:  # a warm-up is a bet: not worth a stop's wait
            t.cancel()
        for attached in self.attached:
            await attached.close()
        if self.transfer_server is not None:
            await self.transfer_server.close()
        if self.pool is not None:
            await self.pool.close()
        await self.bus.close()
        await self.engine.close()


async def serve(cfg: InstanceSettings, engine_cfg: EngineSettings, roles: Sequence[RolePlugin],
                telemetry_cfg: TelemetrySettings | None = None, shared: SharedSettings | None = None) -> None:
    """Run until SIGTERM/SIGINT. Once serving, report the bound endpoints (``kvmesh.ready``: the ready line,
    and ``shared.ready_file`` when set)."""
    import signal

    shared = shared or SharedSettings()
    host = EngineHost(cfg, engine_cfg, roles, shared)
    await host.start()
    tracing.setup(cfg.role, host.instance_id, telemetry_cfg)
    report_ready(host.instance_id, host.endpoints, shared.ready_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("%s stopping", host.instance_id)
    await host.stop()
    tracing.shutdown()
