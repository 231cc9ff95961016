"""The bus against a real nats-server on 127.0.0.1. Async bodies run under ``asyncio.run`` (no pytest-asyncio)."""

import asyncio
import time
import uuid
from collections.abc import Coroutine
from typing import Any

import pytest
from kvmesh.bus import Bus, NatsServer, Subjects
from kvmesh.contracts.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.contracts.ids import BlockKey
from kvmesh.contracts.layout import KVLayout
from kvmesh.contracts.messages import Heartbeat, InstanceLoad, KVEventBatch, KVReady, Message
from nats.js.api import StorageType

from tests.ports import refusing_port

TRACE = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tracestate": "kvmesh=1"}


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 20.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture
def subjects() -> Subjects:
    return Subjects(f"t{uuid.uuid4().hex[:10]}")


def batch(seq: int, instance: str = "p0") -> KVEventBatch:  # on kv.events.p0: its own subject
    return KVEventBatch(instance_id=instance, seq=seq, ts=1000.0 + seq, events=(
        BlockStored(block_keys=(BlockKey(2**64 - 1 - seq),), parent_key=None, token_count=16, tier="device"),
        BlockRemoved(block_keys=(BlockKey(seq),), tier="host"),
    ))


class Inbox:
    """A handler that queues what it gets."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[Any, dict[str, str]]] = asyncio.Queue()

    async def __call__(self, msg: Any, headers: dict[str, str]) -> None:
        await self.queue.put((msg, headers))

    async def get(self, timeout_s: float = 5.0) -> tuple[Any, dict[str, str]]:
        return await asyncio.wait_for(self.queue.get(), timeout_s)

    async def take(self, n: int, timeout_s: float = 5.0) -> list[Any]:
        return [(await self.get(timeout_s))[0] for _ in range(n)]

    async def assert_empty(self, wait_s: float = 0.5) -> None:
        await asyncio.sleep(wait_s)
        assert self.queue.empty(), f"unexpected: {self.queue.get_nowait()}"


def test_every_message_type_round_trips_with_headers(nats_server, subjects):
    msgs: list[Message] = [
        KVReady(request_id="r1", decode_instance="d0", transfer_id="t1", block_keys=(BlockKey(2**64 - 1),),
                num_tokens=20, first_token=7, layout=KVLayout("m", 2, 2, 8, 16, "fp16"), prefill_instance="p0"),
        Heartbeat(instance_id="d0", role="decode", grpc_address="127.0.0.1:1", transfer_address="127.0.0.1:2",
                  ts=1.5, load=InstanceLoad(running=1, free_blocks=10), model="m", block_size=16),
        KVEventBatch(instance_id="p0", seq=3, ts=2.0, events=(AllBlocksCleared(),)),
    ]

    async def body() -> None:
        bus = await Bus.connect(nats_server.url, "test")
        inbox = Inbox()
        await bus.subscribe(f"kvmesh.{subjects.cluster}.>", inbox)
        for m in msgs:
            await bus.publish(subjects.kv_ready("d0"), m, headers={**TRACE, "x-request-id": "r1"})
        for m in msgs:
            got, headers = await inbox.get()
            assert got == m
            assert headers == {**TRACE, "x-request-id": "r1"}
        await bus.close()

    run(body())


def test_malformed_message_does_not_stop_the_subscriber(nats_server, subjects):
    hb = Heartbeat(instance_id="p0", role="prefill", grpc_address="a", transfer_address="b", ts=0.0,
                   load=InstanceLoad(), model="m", block_size=16)

    async def body() -> None:
        bus = await Bus.connect(nats_server.url, "test")
        inbox = Inbox()
        await bus.subscribe(subjects.heartbeats_all, inbox)
        subject = subjects.heartbeat("prefill", "p0")
        for bad in (b"garbage", b'{"v": 99, "type": "heartbeat"}', b'{"v": 1, "type": "heartbeat"}'):
            await bus.publish(subject, bad)
        await bus.publish(subject, hb)
        assert (await inbox.get())[0] == hb
        await inbox.assert_empty(0.2)
        await bus.close()

    run(body())


def test_a_failing_handler_does_not_stop_the_subscriber(nats_server, subjects):
    async def body() -> None:
        bus = await Bus.connect(nats_server.url, "test")
        inbox = Inbox()

        async def handler(msg: Any, headers: dict[str, str]) -> None:
            if msg.seq == 0:
                raise RuntimeError("boom")
            await inbox(msg, headers)

        await bus.subscribe(subjects.kv_events("p0"), handler)
        await bus.publish(subjects.kv_events("p0"), batch(0, "p0"))
        await bus.publish(subjects.kv_events("p0"), batch(1, "p0"))
        assert (await inbox.get())[0].seq == 1
        await bus.close()

    run(body())


def test_a_queue_group_delivers_each_message_once(nats_server, subjects):
    async def body() -> None:
        bus = await Bus.connect(nats_server.url, "test")
        inbox = Inbox()
        for _ in range(3):
            await bus.subscribe(subjects.kv_ready("d0"), inbox, queue="decoders")
        for i in range(10):
            await bus.publish(subjects.kv_ready("d0"), batch(i))
        assert sorted(m.seq for m in await inbox.take(10)) == list(range(10))
        await inbox.assert_empty(0.2)
        await bus.close()

    run(body())


def test_a_new_durable_replays_every_batch_in_order(nats_server, subjects):
    async def body() -> None:
        bus = await Bus.connect(nats_server.url, "test")
        await bus.ensure_events_stream(subjects)
        sent = [batch(i, inst) for i in range(5) for inst in ("p0", "d0")]
        stream_seqs = [await bus.publish_event(subjects.kv_events(b.instance_id), b, headers=TRACE) for b in sent]
        assert stream_seqs == list(range(1, 11))

        inbox = Inbox()
        await bus.durable_events_consumer(subjects, "cachesvc", inbox)
        got = [await inbox.get() for _ in sent]
        assert [m for m, _ in got] == sent  # seq numbers and 64-bit keys intact, stream order kept
        assert all(h == TRACE for _, h in got)
        await bus.close()

    run(body())


def test_a_restarted_durable_gets_only_new_batches(nats_server, subjects):
    async def body() -> None:
        producer = await Bus.connect(nats_server.url, "prefill")
        await producer.ensure_events_stream(subjects)
        for i in range(3):
            await producer.publish_event(subjects.kv_events("p0"), batch(i))

        consumer = await Bus.connect(nats_server.url, "cachesvc")
        inbox = Inbox()
        await consumer.durable_events_consumer(subjects, "cachesvc", inbox)
        assert [m.seq for m in await inbox.take(3)] == [0, 1, 2]
        await consumer.close()  # the cachesvc process goes away
        # its last fetch stays a pull request on the server until the server sees the connection gone: a batch
        # published before then goes to that request's dead inbox and comes back only after ack_wait
        while (await producer.js.consumer_info(subjects.events_stream, "cachesvc")).num_waiting:
            await asyncio.sleep(0.05)

        for i in range(3, 5):
            await producer.publish_event(subjects.kv_events("p0"), batch(i))

        consumer = await Bus.connect(nats_server.url, "cachesvc")
        inbox = Inbox()
        await consumer.durable_events_consumer(subjects, "cachesvc", inbox)
        assert [m.seq for m in await inbox.take(2)] == [3, 4]
        await inbox.assert_empty()

        fresh = Inbox()  # a different durable still sees the whole history
        await consumer.durable_events_consumer(subjects, "auditor", fresh)
        assert [m.seq for m in await fresh.take(5)] == [0, 1, 2, 3, 4]
        await consumer.close()
        await producer.close()

    run(body())


def test_a_failing_events_handler_gets_the_batch_again(nats_server, subjects):
    async def body() -> None:
        bus = await Bus.connect(nats_server.url, "test")
        await bus.ensure_events_stream(subjects)
        await bus.publish(subjects.kv_events("p0"), b"not an event")  # captured by the stream, never decodes
        await bus.publish_event(subjects.kv_events("p0"), batch(0))
        calls: list[int] = []
        inbox = Inbox()

        async def flaky(msg: KVEventBatch, headers: dict[str, str]) -> None:
            calls.append(msg.seq)
            if len(calls) == 1:
                raise RuntimeError("index busy")
            await inbox(msg, headers)

        await bus.durable_events_consumer(subjects, "cachesvc", flaky)
        assert (await inbox.get())[0].seq == 0
        assert calls == [0, 0]
        await bus.close()

    run(body())


def test_ensure_events_stream_is_idempotent_and_applies_new_limits(nats_server, subjects):
    async def body() -> None:
        bus = await Bus.connect(nats_server.url, "test")
        await bus.ensure_events_stream(subjects)
        await bus.ensure_events_stream(subjects)
        await bus.ensure_events_stream(subjects, max_age_s=600.0, max_bytes=1 << 20)
        info = await bus.js.stream_info(subjects.events_stream)
        assert info.config.subjects == [subjects.kv_events_all]
        assert info.config.max_bytes == 1 << 20 and info.config.max_age == 600.0
        assert info.config.storage == StorageType.FILE
        await bus.close()

    run(body())


def test_more_stream_copies_than_nats_servers_is_refused_naming_the_setting(nats_server, subjects):
    async def body() -> None:
        bus = await Bus.connect(nats_server.url, "test")
        with pytest.raises(ValueError, match="KVMESH_EVENTS_REPLICAS"):
            await bus.ensure_events_stream(subjects, replicas=3)  # a new stream
        await bus.ensure_events_stream(subjects)
        with pytest.raises(ValueError, match="may not exceed the number of servers"):
            await bus.ensure_events_stream(subjects, replicas=3)  # an update
        await bus.close()

    run(body())


def test_a_store_too_small_for_the_streams_limit_is_refused_saying_what_to_change(tmp_path, subjects):
    """JetStream reserves a stream's whole byte limit in its store: a store smaller than that refuses the stream,
    and the error says where the store's size comes from and how to change it."""
    config = tmp_path / "nats.conf"
    config.write_text("jetstream { max_file_store: 64MB }\n")

    async def body(url: str) -> None:
        bus = await Bus.connect(url, "test")
        with pytest.raises(ValueError, match=r"no room to reserve the KV events stream's limit of 1024 MiB.*"
                                             r"max_file_store"):
            await bus.ensure_events_stream(subjects)
        await bus.ensure_events_stream(subjects, max_bytes=16 << 20)  # a limit the store holds
        await bus.close()

    with NatsServer(tmp_path, config=config) as server:
        run(body(server.url))


def test_connect_gives_up_at_its_deadline():
    async def body(port: int) -> None:
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="cannot reach NATS"):
            await Bus.connect(f"nats://127.0.0.1:{port}", "test", connect_timeout_s=1.0)
        assert time.monotonic() - start < 3.0

    with refusing_port() as port:
        run(body(port))


def test_the_bus_reconnects_and_the_stream_survives_a_server_restart(tmp_path, subjects):
    async def body() -> None:
        async with NatsServer(tmp_path) as server:
            bus = await Bus.connect(server.url, "test", reconnect_wait_s=0.2)
            await bus.ensure_events_stream(subjects)
            await bus.publish_event(subjects.kv_events("p0"), batch(0))
            inbox = Inbox()
            await bus.subscribe(subjects.heartbeats_all, inbox)

            await server.astop()
            await server.astart()  # same port, same store
            hb = Heartbeat(instance_id="p0", role="prefill", grpc_address="a", transfer_address="b", ts=0.0,
                           load=InstanceLoad(), model="m", block_size=16)
            for _ in range(100):  # publishes are buffered while reconnecting; resubscription follows reconnect
                if bus.nc.is_connected:
                    break
                await asyncio.sleep(0.1)
            await bus.nc.flush()
            await bus.publish(subjects.heartbeat("prefill", "p0"), hb)
            assert (await inbox.get())[0] == hb

            events = Inbox()
            await bus.durable_events_consumer(subjects, "cachesvc", events)
            assert (await events.get())[0] == batch(0)
            await bus.close()

    run(body(), timeout_s=30.0)


def test_a_jetstream_call_is_retried_while_jetstream_does_not_answer_and_only_then(nats_server):
    import nats.errors
    import nats.js.errors

    async def body() -> None:
        bus = await Bus.connect(nats_server.url, "test")
        calls: list[str] = []

        async def electing() -> str:  # a NATS cluster re-electing a stream's leader: two timeouts, then an answer
            calls.append("electing")
            if len(calls) < 3:
                raise nats.errors.TimeoutError
            return "answered"

        assert await bus.jetstream("a step", electing, timeout_s=10) == "answered" and len(calls) == 3

        async def never() -> None:
            raise nats.js.errors.ServiceUnavailableError

        with pytest.raises(nats.js.errors.ServiceUnavailableError):  # past its deadline: the last error
            await bus.jetstream("a step", never, timeout_s=0.5)

        async def refused() -> None:
            calls.append("refused")
            raise nats.js.errors.BadRequestError

        with pytest.raises(nats.js.errors.BadRequestError):  # an answer, if a refusal: not retried
            await bus.jetstream("a step", refused, timeout_s=10)
        assert calls.count("refused") == 1
        await bus.close()

    run(body())
