"""The event bus every kvmesh service uses: nats-py with decoding, trace headers and the durable KV events stream.

Core NATS (``publish`` / ``subscribe``) carries what is only useful live: ``kv.ready`` and heartbeats.
JetStream (``publish_event`` / ``durable_events_consumer``) carries ``kv.events``, which rebuild state.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import inspect
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerConfig, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from kvmesh.bus.subjects import Subjects
from kvmesh.bus.trace_headers import extract_trace_headers, inject_trace_headers
from kvmesh.contracts.messages import CacheShardBeat, CodecError, Heartbeat, KVEventBatch, Message, RouterLoad, decode

log = logging.getLogger(__name__)
T = TypeVar("T")
JETSTREAM_WAIT_S = 60.0  # how long a service waits for JetStream to answer a call at start
_STREAM_NAME_IN_USE = 10058  # JetStream API error codes
_INSUFFICIENT_STORAGE = 10047

Handler = Callable[[Message, dict[str, str]], Awaitable[None]]
EventsHandler = Callable[[KVEventBatch, dict[str, str]], Awaitable[None]]


class _Client(Client):
    """nats-py's client that, when told to require TLS, refuses a server whose INFO does not ask for it, before
    anything is sent: nats-py upgrades to TLS only when the server asks, and would otherwise send CONNECT and
    every message in clear to whatever answered on the address. Rides on nats-py's ``_process_info`` (2.16),
    called with ``initial_connection=True`` for the INFO of every (re)connect, before the TLS upgrade and
    CONNECT; its signature is checked at import."""

    require_tls = False
    refused = ""  # why the last connect was refused ("" = none was)

    async def _process_info(self, info: dict[str, object], initial_connection: bool = False) -> None:
        if initial_connection and self.require_tls and not info.get("tls_required"):
            self.refused = ("the NATS server did not ask for TLS, and this process authenticates by its mesh "
                            "certificate: nothing was sent to it; enable TLS on the server (`tls {...}` with "
                            "`verify_and_map`, as the nats.conf `kvmesh up` writes has) or point nats_url at the "
                            "one that has it")
            raise nats.errors.Error(self.refused)
        await super()._process_info(info, initial_connection)


if "initial_connection" not in inspect.signature(Client._process_info).parameters:  # pragma: no cover
    raise ImportError(f"kvmesh.bus needs nats-py's Client._process_info(info, initial_connection) (2.16); "
                      f"nats-py {importlib.metadata.version('nats-py')} has none: install nats-py 2.16")


@dataclass(frozen=True)
class BusTLS:
    """How a mesh member connects: nats-server verified against the mesh CA (its certificate naming
    ``server_name``), this process's certificate presented (nats-server maps it to this identity's user:
    ``kvmesh.bus.permissions``), replies on ``inbox_prefix``, the only inbox that user may read."""

    context: ssl.SSLContext
    server_name: str = ""
    inbox_prefix: str = ""


POOL_EVENTS_SENDER = "pool"  # the instance id cachesvc's pool events carry (the index's name for the pool)


def _stream_hint(e: nats.js.errors.APIError, replicas: int, max_bytes: int) -> Exception:
    """NATS's refusal of the events stream as what to change: more copies than it has servers (the setting), or
    no room in JetStream's store for the stream's byte limit (the server's store); any other refusal as it is."""
    if replicas > 1 and "replicas" in (e.description or "").lower():
        return ValueError(f"the KV events stream cannot keep {replicas} copies on this NATS ({e.description}): "
                          f"KVMESH_EVENTS_REPLICAS ([shared] events_replicas) may not exceed the number of servers "
                          f"in the NATS cluster (1 for a lone nats-server, as kvmesh up and compose run)")
    if e.err_code == _INSUFFICIENT_STORAGE:
        return ValueError(f"NATS JetStream has no room to reserve the KV events stream's limit of {max_bytes >> 20} "
                          f"MiB ({e.description}): JetStream reserves a stream's whole limit in its store, whose "
                          f"size is the server's max_file_store (by default 75% of the free disk where it keeps "
                          f"the store, read at the server's start). Free disk there, or give nats-server a "
                          f"configuration with jetstream {{ max_file_store: <size> }} that holds this stream "
                          f"beside the others, then restart it")
    return e


def from_its_sender(subject: str, msg: Message) -> bool:
    """Whether a message on a subject that names its sender is that sender's: on ``kvmesh.<cluster>.heartbeat.
    <role>.<instance>`` a heartbeat of that role and instance, on ``...kv.events.<instance>`` a KV events batch of
    that instance, on ``...router.load.<router>`` that router's load. NATS lets each instance publish on its own
    subjects only (``kvmesh.bus.permissions``), so this keeps one from speaking as another even where a permission
    is wider than it should be. Subjects that name no sender take anything."""
    kind = subject.split(".")[2:]
    match kind:
        case ["heartbeat", role, instance]:
            return isinstance(msg, Heartbeat) and (msg.role, msg.instance_id) == (role, instance)
        case ["kv", "events", instance]:
            return isinstance(msg, KVEventBatch) and msg.instance_id == instance
        case ["router", "load", router]:
            return isinstance(msg, RouterLoad) and msg.router_id == router
        case ["pool", "events"]:
            return isinstance(msg, KVEventBatch) and msg.instance_id == POOL_EVENTS_SENDER
        case ["cache", "shard", shard]:
            return isinstance(msg, CacheShardBeat) and str(msg.shard) == shard
    return True


def tls_required(url: str | list[str]) -> bool:
    """Whether a member with mesh TLS must refuse a NATS server that does not ask for TLS: when it authenticates
    by its certificate (no user or token in any URL: ``kvmesh up``'s servers map certificates to users) or a URL
    says ``tls://``. A URL with a password is a server that authenticates by password, perhaps in clear (a NATS
    of your own): allowed, with a warning once connected."""
    urls = [url] if isinstance(url, str) else url
    return any(u.startswith("tls://") for u in urls) or not any("@" in u.split("//", 1)[-1] for u in urls)


def redact(url: str | list[str]) -> str:
    """``url`` without its password (``nats://user:***@host:4222``), fit for logs and errors."""
    urls = [url] if isinstance(url, str) else url
    return ", ".join(re.sub(r"//([^:/@]*):[^@/]*@", r"//\1:***@", u) for u in urls)


class EventsConsumer:
    """A running durable consumer of the KV events stream. ``stop()`` ends delivery but keeps the durable (and
    its acked position) on the server, so the next consumer with the same name resumes where this one stopped."""

    def __init__(self, name: str, sub: nats.js.JetStreamContext.PullSubscription, task: asyncio.Task[None]):
        self.name = name
        self._sub = sub
        self._task = task

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        with contextlib.suppress(nats.errors.Error, ValueError):
            await self._sub.unsubscribe()


class Bus:
    """One NATS connection. Reconnects forever (short wait) once connected; the first connect has a deadline."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self._consumers: list[EventsConsumer] = []
        self.misaddressed = 0  # messages dropped because they named another sender than their subject's
        self._misaddressed_on: set[str] = set()  # subjects already logged

    @classmethod
    async def connect(cls, url: str | list[str], name: str, tls: BusTLS | None = None,
                      connect_timeout_s: float = 10.0, reconnect_wait_s: float = 0.5) -> Bus:
        """``tls``: this process's mesh certificate (TLS is used when the server requires it, which a mesh
        server does: ``kvmesh up`` by default)."""
        async def on_error(e: Exception) -> None:
            log.warning("nats %s: %s", name, e)

        async def on_disconnected() -> None:
            if not nc.is_closed:  # nats-py also reports a deliberate close as a disconnect
                log.warning("nats %s: disconnected, reconnecting", name)

        async def on_reconnected() -> None:
            u = nc.connected_url
            log.info("nats %s: reconnected to %s", name, f"{u.hostname}:{u.port}" if u else "?")

        async def on_closed() -> None:
            log.info("nats %s: connection closed", name)

        if isinstance(url, str):  # a NATS cluster's servers, comma-separated
            url = [u.strip() for u in url.split(",") if u.strip()]
        nc = _Client()
        nc.require_tls = tls is not None and tls_required(url)
        secure: dict[str, object] = {}
        if tls is not None:
            secure = {"tls": tls.context, "tls_hostname": tls.server_name or None}
            if tls.inbox_prefix:
                secure["inbox_prefix"] = tls.inbox_prefix
        connecting = nc.connect(
            servers=url, name=name, allow_reconnect=True, max_reconnect_attempts=-1, **secure,  # type: ignore[arg-type]
            reconnect_time_wait=reconnect_wait_s,  # type: ignore[arg-type]  # typed int, only slept on
            connect_timeout=2, ping_interval=10, max_outstanding_pings=3,
            error_cb=on_error, disconnected_cb=on_disconnected, reconnected_cb=on_reconnected, closed_cb=on_closed)
        try:
            # With infinite reconnects nats-py retries even the first connect forever, hence the deadline.
            await asyncio.wait_for(connecting, connect_timeout_s)
        except TimeoutError:
            with contextlib.suppress(Exception):
                await nc.close()
            if nc.refused:
                raise ConnectionError(f"NATS at {redact(url)}: {nc.refused}") from None
            raise ConnectionError(f"cannot reach NATS at {redact(url)} within {connect_timeout_s}s") from None
        log.info("nats %s: connected to %s", name, redact(url))
        if tls is not None and not nc._server_info.get("tls_required"):
            log.warning("nats %s: %s does not ask for TLS: the password in the URL and every message travel in "
                        "clear (enable TLS on the server: `kvmesh up` does, with a user per certificate)", name,
                        redact(url))
        return cls(nc)

    # -- core NATS ---------------------------------------------------------------------------------------------

    async def publish(self, subject: str, msg: Message | bytes, headers: dict[str, str] | None = None) -> None:
        data = msg if isinstance(msg, bytes) else msg.encode()
        await self.nc.publish(subject, data, headers=inject_trace_headers(headers) or None)

    async def subscribe(self, subject: str, handler: Handler, queue: str | None = None) -> Subscription:
        """Deliver every decodable message on ``subject`` to ``handler``, one at a time; a message that does
        not decode, or a handler that raises, is logged and skipped. Active on the server when this returns."""

        async def on_msg(msg: Msg) -> None:
            try:
                obj = decode(msg.data)
            except CodecError as e:
                log.warning("dropping undecodable message on %s: %s", msg.subject, e)
                return
            if not from_its_sender(msg.subject, obj):
                self._drop_misaddressed(msg.subject, obj)
                return
            try:
                await handler(obj, extract_trace_headers(msg))
            except Exception:
                log.exception("handler failed on %s", msg.subject)

        sub = await self.nc.subscribe(subject, queue=queue or "", cb=on_msg)
        await self.nc.flush()
        return sub

    def _drop_misaddressed(self, subject: str, msg: Message) -> None:
        self.misaddressed += 1
        if subject not in self._misaddressed_on:  # once per subject: a forger repeats itself
            self._misaddressed_on.add(subject)
            log.warning("dropping a %s on %s: it names another sender (a forgery, or a misconfigured publisher)",
                        type(msg).TYPE, subject)

    # -- JetStream: the KV events stream ------------------------------------------------------------------------

    async def jetstream(self, what: str, step: Callable[[], Awaitable[T]], timeout_s: float = JETSTREAM_WAIT_S) -> T:
        """``step`` (a JetStream API call), retried while JetStream does not answer or has no leader for it yet: a
        NATS cluster re-elects the leaders a dead node held, which takes seconds, and a service starting then
        should wait for it, not fail. Gives up (the last error) after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return await step()
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError,
                    nats.js.errors.ServiceUnavailableError) as e:
                if time.monotonic() > deadline:
                    raise
                log.warning("JetStream did not answer %s (%s); retrying (a NATS cluster electing leaders?)", what,
                            e or type(e).__name__)
                await asyncio.sleep(1.0)

    async def ensure_events_stream(self, subjects: Subjects, max_age_s: float = 24 * 3600.0,
                                   max_bytes: int = 1 << 30, replicas: int = 1, update: bool = True) -> None:
        """Create the stream that captures ``kv.events.>``, or update its limits and replicas where they differ;
        safe to call from every service at start. ``update`` False (the engines, which may not change the stream
        on a mesh NATS server: ``kvmesh.bus.permissions``): a stream that differs is used as it is, with a
        warning (cachesvc, which may, brings it to its settings when it starts). File storage; the oldest events
        go first when a limit is hit."""
        config = StreamConfig(name=subjects.events_stream, subjects=[subjects.kv_events_all],
                              retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
                              discard=DiscardPolicy.OLD, max_age=max_age_s, max_bytes=max_bytes,
                              num_replicas=replicas)
        try:
            have = (await self.js.stream_info(subjects.events_stream)).config
            if (have.subjects, have.max_age, have.max_bytes, have.num_replicas, have.discard) == (
                    config.subjects, config.max_age, config.max_bytes, config.num_replicas, config.discard):
                return
            if not update:
                log.warning("the events stream %s has %s replica(s), max_age %ss, max_bytes %s; this process's "
                            "settings say %d, %ss, %d: publishing into it as it is (cachesvc changes it when it "
                            "starts with them)", subjects.events_stream, have.num_replicas or 1, have.max_age,
                            have.max_bytes, replicas, max_age_s, max_bytes)
                return
        except nats.js.errors.NotFoundError:
            try:
                await self.js.add_stream(config)
                return
            except nats.js.errors.BadRequestError as e:
                if e.err_code != _STREAM_NAME_IN_USE:  # else another service created it meanwhile
                    raise _stream_hint(e, replicas, max_bytes) from e
            except nats.js.errors.APIError as e:
                raise _stream_hint(e, replicas, max_bytes) from e
        try:
            await self.js.update_stream(config)
        except nats.js.errors.APIError as e:
            raise _stream_hint(e, replicas, max_bytes) from e

    async def publish_event(self, subject: str, batch: KVEventBatch, headers: dict[str, str] | None = None,
                            timeout_s: float = 5.0) -> int:
        """Publish ``batch`` into the events stream; returns its stream sequence once the server has stored it."""
        ack = await self.js.publish(subject, batch.encode(), timeout=timeout_s,
                                    headers=inject_trace_headers(headers) or None)
        return ack.seq

    async def durable_events_consumer(self, subjects: Subjects, durable_name: str, handler: EventsHandler,
                                      batch: int = 64, ack_wait_s: float = 30.0) -> EventsConsumer:
        """Feed every event batch of the stream to ``handler`` in stream order, acking each after ``handler``
        returns. A new ``durable_name`` starts at the stream's first message; an existing one resumes after its
        last ack. Delivery is at least once (a crash between handling and ack redelivers), so handlers must be
        idempotent. A handler that raises gets the batch again after a second (later batches may be handled
        first: ``seq`` tells); a message that does not decode is logged and terminated (never redelivered)."""
        sub = await self.js.pull_subscribe(
            subjects.kv_events_all, durable=durable_name, stream=subjects.events_stream,
            config=ConsumerConfig(ack_wait=ack_wait_s))
        task = asyncio.create_task(self._consume(sub, handler, batch), name=f"events-consumer-{durable_name}")
        consumer = EventsConsumer(durable_name, sub, task)
        self._consumers.append(consumer)
        return consumer

    async def _consume(self, sub: nats.js.JetStreamContext.PullSubscription, handler: EventsHandler,
                       batch: int) -> None:
        while True:
            try:
                for msg in await sub.fetch(batch, timeout=5.0):
                    await self._deliver(msg, handler)
            except TimeoutError:  # nothing new
                continue
            except nats.errors.ConnectionClosedError:
                return
            except nats.errors.Error as e:  # e.g. reconnecting; what was not acked comes back after ack_wait
                log.warning("events consumer: %s; retrying", e)
                await asyncio.sleep(0.5)

    @staticmethod
    async def _deliver(msg: Msg, handler: EventsHandler) -> None:
        try:
            obj = decode(msg.data)
            if not isinstance(obj, KVEventBatch):
                raise CodecError(f"expected a kv_event_batch, got {type(obj).TYPE}")
            if not from_its_sender(msg.subject, obj):
                raise CodecError(f"a batch of {obj.instance_id!r} is not that instance's to publish")
        except CodecError as e:
            log.warning("terminating undecodable event on %s: %s", msg.subject, e)
            await msg.term()
            return
        try:
            await handler(obj, extract_trace_headers(msg))
        except Exception:
            log.exception("events handler failed on %s seq %d; redelivering", obj.instance_id, obj.seq)
            await msg.nak(delay=1.0)
            return
        await msg.ack()

    async def close(self) -> None:
        """Stop the consumers (durables stay on the server), flush pending acks and publishes, close."""
        for consumer in self._consumers:
            await consumer.stop()
        self._consumers.clear()
        if self.nc.is_connected:
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=2)
        await self.nc.close()
