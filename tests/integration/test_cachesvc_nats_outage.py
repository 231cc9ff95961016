"""cachesvc keeps its index through a NATS outage and resyncs after it: a real nats-server of the test's own is
stopped for longer than ``instance_timeout_s``; the instance's blocks stay indexed meanwhile (no heartbeat could
arrive), and once the server is back cachesvc asks the instance for a snapshot, which replaces what the instance
changed while nothing could be published."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvmesh.bus import Bus, NatsServer, Subjects
from kvmesh.bus.snapshot import answer_snapshots
from kvmesh.contracts.messages import Heartbeat, InstanceLoad, KVEventBatch
from kvmesh.proto.v1 import cache_pb2

from tests.integration.test_cachesvc import KEYS, InProcess, cluster, matches, run, stored, until  # noqa: F401

TIMEOUT_S = 1.0


async def beat(bus: Bus, subjects: Subjects, on: Callable[[], bool]) -> None:
    """The instance's heartbeats, every 0.2 s while ``on()`` says so."""
    while True:
        if on():
            await bus.publish(subjects.heartbeat("decode", "inst"), Heartbeat(
                "inst", "decode", "127.0.0.1:1", "127.0.0.1:2", time.time(), InstanceLoad(), "tiny", 2))
        await asyncio.sleep(0.2)


async def indexed(stub, n: int) -> bool:
    """Whether cachesvc's index holds exactly the first ``n`` of KEYS for the instance (0: none)."""
    reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=KEYS))
    return matches(reply) == ({("inst", "device", n)} if n else set())


def test_an_outage_longer_than_the_instance_timeout_keeps_the_index_and_a_snapshot_resyncs_it(tmp_path, cluster):  # noqa: F811
    subjects = Subjects(cluster)
    nats = NatsServer(tmp_path / "nats").start()
    held = {"seq": 1, "keys": list(KEYS)}  # what the instance holds: its snapshot source

    async def current() -> tuple[int, list[tuple[int, str]]]:
        return held["seq"], [(k, "device") for k in held["keys"]]

    async def body() -> None:
        cachesvc = InProcess(nats.url, cluster, instance_timeout_s=TIMEOUT_S)
        async with cachesvc as stub:
            server = cachesvc.server
            bus = await Bus.connect(nats.url, "inst", reconnect_wait_s=0.1)
            await bus.ensure_events_stream(subjects)
            await answer_snapshots(bus, subjects, "inst", current)
            await bus.publish_event(subjects.kv_events("inst"), KVEventBatch("inst", 1, 0.0, (stored(KEYS),)))

            beating = asyncio.create_task(beat(bus, subjects, lambda: bus.nc.is_connected))
            await until(lambda: indexed(stub, len(KEYS)))
            await asyncio.to_thread(nats.stop)
            await until(lambda: asyncio.sleep(0, not server.bus.nc.is_connected))
            held["keys"] = KEYS[:2]  # it evicted while nothing could be published
            await asyncio.sleep(3 * TIMEOUT_S)  # past the timeout, and its reaper's ticks, many times over
            assert await indexed(stub, len(KEYS))  # kept: silence without a bus is no death
            await asyncio.to_thread(nats.start)
            await until(lambda: indexed(stub, 2), timeout_s=20.0)  # the snapshot asked for after the outage
            assert server.resync.refreshed >= 1
            await asyncio.sleep(3 * TIMEOUT_S)  # it beats again: still there
            assert await indexed(stub, 2)
            beating.cancel()
            await bus.close()

    try:
        run(body(), timeout_s=60)
    finally:
        nats.stop()


def test_an_instance_silent_past_the_timeout_is_dropped_and_resynced_once_heard_again(tmp_path, cluster):  # noqa: F811
    """A busy host or a stalled loop delays an instance's heartbeats past ``instance_timeout_s`` while NATS is up:
    its blocks are dropped (nothing should be routed to an instance that may be gone), and when it beats again
    cachesvc asks it for a snapshot, which brings its blocks back; without that they stayed unindexed until each
    was stored again."""
    subjects = Subjects(cluster)
    nats = NatsServer(tmp_path / "nats").start()

    async def current() -> tuple[int, list[tuple[int, str]]]:
        return 1, [(k, "device") for k in KEYS]

    async def body() -> None:
        cachesvc = InProcess(nats.url, cluster, instance_timeout_s=TIMEOUT_S)
        async with cachesvc as stub:
            bus = await Bus.connect(nats.url, "inst", reconnect_wait_s=0.1)
            await bus.ensure_events_stream(subjects)
            await answer_snapshots(bus, subjects, "inst", current)
            await bus.publish_event(subjects.kv_events("inst"), KVEventBatch("inst", 1, 0.0, (stored(KEYS),)))
            beating = asyncio.Event()
            task = asyncio.create_task(beat(bus, subjects, beating.is_set))
            beating.set()
            await until(lambda: indexed(stub, len(KEYS)))
            beating.clear()  # silent: dropped
            await until(lambda: indexed(stub, 0), timeout_s=20.0)
            beating.set()  # heard again: its snapshot
            await until(lambda: indexed(stub, len(KEYS)), timeout_s=20.0)
            task.cancel()
            await bus.close()

    try:
        run(body(), timeout_s=60.0)
    finally:
        nats.stop()
