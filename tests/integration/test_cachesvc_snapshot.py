"""Snapshot resync against a real nats-server: a gap or a restarted instance makes cachesvc ask the instance
(``kvmesh.bus.snapshot.answer_snapshots``) for its blocks, and the index ends up equal to what it holds."""

from __future__ import annotations

import time
import uuid

import pytest
from kvmesh.bus import Bus, Subjects
from kvmesh.bus.snapshot import answer_snapshots
from kvmesh.contracts.events import AllBlocksCleared, BlockStored, KVEvent
from kvmesh.contracts.ids import BlockKey
from kvmesh.contracts.messages import KVEventBatch
from kvmesh.proto.v1 import cache_pb2

from tests.integration.test_cachesvc import InProcess, matches, run, until

CHAIN = [BlockKey(5000 + i) for i in range(8)]


@pytest.fixture
def cluster() -> str:
    return f"s{uuid.uuid4().hex[:10]}"


def stored(keys, tier="device") -> BlockStored:
    return BlockStored(block_keys=tuple(keys), parent_key=None, token_count=16, tier=tier)


class FakeInstance:
    """Publishes numbered event batches and answers snapshots with what it holds."""

    def __init__(self, bus: Bus, subjects: Subjects, instance_id: str) -> None:
        self.bus, self.subjects, self.id = bus, subjects, instance_id
        self.seq = 0
        self.blocks: list[tuple[int, str]] = []

    async def current(self) -> tuple[int, list[tuple[int, str]]]:
        return self.seq, list(self.blocks)

    async def publish(self, *events: KVEvent, lose: bool = False) -> None:
        self.seq += 1
        if not lose:
            await self.bus.publish_event(self.subjects.kv_events(self.id),
                                         KVEventBatch(self.id, self.seq, time.time(), events))


def test_a_gap_is_repaired_from_the_instance_snapshot(nats_server, cluster):
    subjects = Subjects(cluster)

    async def body() -> None:
        async with InProcess(nats_server.url, cluster) as stub:
            bus = await Bus.connect(nats_server.url, "p0")
            p0 = FakeInstance(bus, subjects, "p0")
            await answer_snapshots(bus, subjects, "p0", p0.current)
            p0.blocks = [(k, "device") for k in CHAIN[:2]]
            await p0.publish(stored(CHAIN[:2]))
            p0.blocks = [(k, "device") for k in CHAIN] + [(k, "host") for k in CHAIN[:3]]
            await p0.publish(stored(CHAIN[2:]), stored(CHAIN[:3], "host"), lose=True)  # never reaches the stream
            p0.blocks.append((CHAIN[3], "host"))
            await p0.publish(stored(CHAIN[3:4], "host"))   # seq 3 after 1: a gap

            async def repaired() -> bool:
                reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=CHAIN))
                return matches(reply) == {("p0", "device", 8), ("p0", "host", 4)}

            await until(repaired)
            stats = await stub.Stats(cache_pb2.StatsRequest())
            assert (stats.event_gaps, stats.snapshots_requested, stats.snapshots_applied) == (1, 1, 1)
            await bus.close()

    run(body())


def test_an_instance_restarted_within_the_timeout_is_resynced(nats_server, cluster):
    subjects = Subjects(cluster)

    async def body() -> None:
        async with InProcess(nats_server.url, cluster) as stub:
            bus = await Bus.connect(nats_server.url, "p0")
            old = FakeInstance(bus, subjects, "p0")
            for _ in range(3):
                await old.publish(stored(CHAIN))
            new = FakeInstance(bus, subjects, "p0")        # same id, numbers from 1 again
            await answer_snapshots(bus, subjects, "p0", new.current)
            await new.publish(AllBlocksCleared())
            new.blocks = [(k, "device") for k in CHAIN[:2]]
            await new.publish(stored(CHAIN[:2]))

            async def resynced() -> bool:
                reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=CHAIN))
                return matches(reply) == {("p0", "device", 2)}

            await until(resynced)
            new.blocks.append((CHAIN[2], "device"))
            await new.publish(stored(CHAIN[2:3]))

            async def follows() -> bool:
                reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=CHAIN))
                return matches(reply) == {("p0", "device", 3)}

            await until(follows)
            await bus.close()

    run(body())


def test_a_large_snapshot_arrives_in_chunks(nats_server, cluster):
    subjects = Subjects(cluster)
    many = [BlockKey(10**6 + i) for i in range(300_000)]  # 2.4 MB of keys: several 1 MB chunks

    async def body() -> None:
        async with InProcess(nats_server.url, cluster) as stub:
            bus = await Bus.connect(nats_server.url, "p0")
            p0 = FakeInstance(bus, subjects, "p0")
            await answer_snapshots(bus, subjects, "p0", p0.current)
            await p0.publish(stored(many[:1]))
            p0.blocks = [(k, "host") for k in many]
            await p0.publish(stored(many, "host"), lose=True)
            await p0.publish()

            async def repaired() -> bool:
                return (await stub.Stats(cache_pb2.StatsRequest())).snapshots_applied == 1

            await until(repaired, timeout_s=20)
            reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=many[:1000]))
            assert matches(reply) == {("p0", "host", 1000)}
            assert (await stub.Stats(cache_pb2.StatsRequest())).indexed_blocks == 300_000
            await bus.close()

    run(body(), timeout_s=60)


def test_an_instance_that_does_not_answer_costs_no_wait(nats_server, cluster):
    subjects = Subjects(cluster)

    async def body() -> None:
        async with InProcess(nats_server.url, cluster, snapshot_timeout_s=30.0) as stub:
            bus = await Bus.connect(nats_server.url, "p0")
            p0 = FakeInstance(bus, subjects, "p0")                # no answer_snapshots: nobody listens
            await p0.publish(stored(CHAIN[:1]))
            await p0.publish(stored(CHAIN[1:2]), lose=True)
            await p0.publish(stored(CHAIN[1:3]))

            async def applied() -> bool:
                reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=CHAIN))
                return matches(reply) == {("p0", "device", 3)}

            await until(applied, timeout_s=3.0)                    # far less than snapshot_timeout_s
            stats = await stub.Stats(cache_pb2.StatsRequest())
            assert (stats.snapshots_requested, stats.snapshots_applied) == (1, 0)
            await bus.close()

    run(body())
