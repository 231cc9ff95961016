"""cachesvc against a real nats-server and its real gRPC server, in-process and as a subprocess
(``python -m services.cachesvc``).

Async bodies run under ``asyncio.run`` (no pytest-asyncio).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from kvmesh.bus import Bus, NatsServer, Subjects
from kvmesh.contracts.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.contracts.ids import BlockKey
from kvmesh.contracts.messages import Heartbeat, InstanceLoad, KVEventBatch
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc, common_pb2
from kvmesh.ready import wait_ready
from kvmesh.settings import CacheServiceSettings, SharedSettings

from services.cachesvc.server import SERVICE_NAME, CacheServer

REPO = Path(__file__).resolve().parents[2]
KEYS = [BlockKey(2**64 - 1 - i) for i in range(6)]
LAYOUT = common_pb2.BlockLayout(model_fingerprint="tiny", num_layers=2, num_kv_heads=1, head_dim=4,
                                block_size=2, dtype="fp32", layout="layer-major", tp_rank=0, tp_size=1)
BLOCK_BYTES = 2 * 2 * 2 * 1 * 4 * 4


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 30.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture
def cluster() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def stored(keys, tier="device") -> BlockStored:
    return BlockStored(block_keys=tuple(keys), parent_key=None, token_count=2, tier=tier)


def matches(reply: cache_pb2.MatchPrefixResponse) -> set[tuple[str, str, int]]:
    return {(m.instance_id, m.tier, m.num_blocks) for m in reply.matches}


def blocks(n: int) -> tuple[list[int], list[int], bytes]:
    chunks = [os.urandom(BLOCK_BYTES) for _ in range(n)]
    return KEYS[:n], [xxhash.xxh3_64_intdigest(c) for c in chunks], b"".join(chunks)


async def until(check: Callable[[], Coroutine[Any, Any, bool]], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def publish_history(nats_url: str, subjects: Subjects) -> None:
    bus = await Bus.connect(nats_url, "producer")
    await bus.ensure_events_stream(subjects)
    await bus.publish_event(subjects.kv_events("p0"), KVEventBatch("p0", 1, 0.0, (stored(KEYS, "device"),)))
    await bus.publish_event(subjects.kv_events("p0"), KVEventBatch("p0", 2, 0.0, (stored(KEYS[:3], "host"),)))
    await bus.publish_event(subjects.kv_events("d0"), KVEventBatch("d0", 1, 0.0, (stored(KEYS[:4]),)))
    await bus.publish_event(subjects.kv_events("p0"), KVEventBatch(
        "p0", 3, 0.0, (BlockRemoved(block_keys=(KEYS[4],), tier="device"),)))
    await bus.publish_event(subjects.kv_events("x0"), KVEventBatch("x0", 1, 0.0, (stored(KEYS[:2]),)))
    await bus.publish_event(subjects.kv_events("x0"), KVEventBatch("x0", 2, 0.0, (AllBlocksCleared(),)))
    await bus.close()


EXPECTED = {("p0", "device", 4), ("p0", "host", 3), ("d0", "device", 4)}


async def history_indexed(stub: cache_pb2_grpc.CacheServiceStub, nats_url: str, cluster: str) -> None:
    """``publish_history``, then until MatchPrefix answers ``EXPECTED``."""
    await publish_history(nats_url, Subjects(cluster))

    async def indexed() -> bool:
        return matches(await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=KEYS))) == EXPECTED

    await until(indexed)


class InProcess:
    """A CacheServer on a free port in this event loop, and a client stub to it."""

    def __init__(self, nats_url: str, cluster: str, **settings: Any) -> None:
        settings.setdefault("instance_timeout_s", 60.0)
        self.server = CacheServer(CacheServiceSettings(port=0, durable_name=f"cachesvc-{cluster}", **settings),
                                  SharedSettings(nats_url=nats_url, cluster=cluster))

    async def __aenter__(self) -> cache_pb2_grpc.CacheServiceStub:
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(self.server.address)
        return cache_pb2_grpc.CacheServiceStub(self.channel)

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()
        await self.server.stop()


class Subprocess:
    """``python -m services.cachesvc`` with its log in ``log_path``, on the port it binds (0: any free one, read
    back from its ready file at each start into ``address``)."""

    def __init__(self, nats_url: str, cluster: str, log_path: Path, port: int = 0, **settings: str) -> None:
        self.ready_path = log_path.with_suffix(".ready.json")
        self.args = [sys.executable, "-m", "services.cachesvc", "--port", str(port), "--nats-url", nats_url,
                     "--cluster", cluster, "--ready-file", str(self.ready_path)]
        pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        self.env = {**os.environ, "PYTHONPATH": pythonpath,
                    "KVMESH_CACHESVC_DURABLE_NAME": f"cachesvc-{cluster}", "KVMESH_CACHESVC_INSTANCE_TIMEOUT_S": "60",
                    **{f"KVMESH_CACHESVC_{k.upper()}": v for k, v in settings.items()}}
        self.address = ""
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        self.ready_path.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, cwd=REPO, env=self.env, stdout=log, stderr=log)
        self.endpoints = wait_ready(self.ready_path, self.proc, "cachesvc", self.log_path, timeout_s).endpoints
        self.address = self.endpoints["grpc"]
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + timeout_s
            while True:
                assert self.proc.poll() is None, f"cachesvc exited:\n{self.log_path.read_text()}"
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, f"cachesvc not SERVING:\n{self.log_path.read_text()}"
                time.sleep(0.1)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def cachesvc_process(nats_server: NatsServer, cluster: str, tmp_path: Path) -> Iterator[Subprocess]:
    proc = Subprocess(nats_server.url, cluster, tmp_path / "cachesvc.log")
    yield proc
    if proc.proc is not None and proc.proc.poll() is None:
        proc.stop(signal.SIGKILL)


@pytest.fixture
def cachesvc_with_disk(nats_server: NatsServer, cluster: str, tmp_path: Path) -> Iterator[Subprocess]:
    """cachesvc with a 1 MiB DRAM tier and a disk tier in ``tmp_path / "pool"``."""
    proc = Subprocess(nats_server.url, cluster, tmp_path / "cachesvc.log", pool_capacity_mb="1",
                      disk_dir=str(tmp_path / "pool"), disk_capacity_mb="64", disk_segment_mb="1")
    yield proc
    if proc.proc is not None and proc.proc.poll() is None:
        proc.stop(signal.SIGKILL)


def match_sync(address: str, keys: list[int]) -> tuple[set[tuple[str, str, int]], cache_pb2.StatsResponse]:
    with grpc.insecure_channel(address) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        return (matches(stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=keys), timeout=5)),
                stub.Stats(cache_pb2.StatsRequest(), timeout=5))


def wait_for_match(address: str, expected: set[tuple[str, str, int]], timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got, stats = match_sync(address, KEYS)
        if got == expected or time.monotonic() > deadline:
            return got, stats
        time.sleep(0.05)


# -- tests ---------------------------------------------------------------------------------------------------

def test_published_events_show_up_in_match_prefix(nats_server, cluster):
    async def body() -> None:
        async with InProcess(nats_server.url, cluster) as stub:
            await publish_history(nats_server.url, Subjects(cluster))

            async def indexed() -> bool:
                reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=KEYS))
                return matches(reply) == EXPECTED

            await until(indexed)
            stats = await stub.Stats(cache_pb2.StatsRequest())
            # KEYS[4] lost its only holder; x0's two blocks were cleared
            assert (stats.indexed_blocks, stats.events_applied, stats.event_gaps) == (5, 6, 0)

    run(body())


def test_a_batch_answers_each_prompt_as_its_own_call_would(nats_server, cluster):
    """MatchPrefixBatch: one answer per question, in order, each the answer MatchPrefix gives that question alone
    (packed or not, held or not); more questions than a batch may hold are refused with what to do."""
    async def body() -> None:
        async with InProcess(nats_server.url, cluster) as stub:
            await history_indexed(stub, nats_server.url, cluster)
            epoch = (await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(packed=True))).holders_epoch
            asked = [cache_pb2.MatchPrefixRequest(block_keys=KEYS), cache_pb2.MatchPrefixRequest(block_keys=KEYS[:2]),
                     cache_pb2.MatchPrefixRequest(block_keys=[7, 8], packed=True),
                     cache_pb2.MatchPrefixRequest(block_keys=KEYS[1:], packed=True, holders_epoch=epoch),
                     cache_pb2.MatchPrefixRequest(block_keys=KEYS, packed=True, holders_epoch=epoch + 1)]
            alone = [await stub.MatchPrefix(q) for q in asked]
            batch = await stub.MatchPrefixBatch(cache_pb2.MatchPrefixBatchRequest(requests=asked))
            assert list(batch.responses) == alone
            assert matches(batch.responses[1]) == {("p0", "device", 2), ("p0", "host", 2), ("d0", "device", 2)}
            assert batch.responses[4].holders and not batch.responses[3].holders  # names only to who lacks them
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.MatchPrefixBatch(cache_pb2.MatchPrefixBatchRequest(requests=[asked[0]] * 257))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "send at most 256 a call" in e.value.details()
            assert (await stub.MatchPrefixBatch(cache_pb2.MatchPrefixBatchRequest())).responses == []

    run(body())


def test_packed_answers_name_their_holders_only_when_the_names_changed(nats_server, cluster):
    """MatchPrefix packed: holder ids and counts as little-endian uint32, the id -> name table sent when the
    caller's epoch is not the index's; decoded, the same matches as the unpacked answer, which a caller that
    does not ask for packing still gets."""
    def decode(reply: cache_pb2.MatchPrefixResponse, names: dict[int, tuple[str, str]]) -> set[tuple[str, str, int]]:
        ids = np.frombuffer(reply.holder_ids, "<u4").tolist()
        counts = np.frombuffer(reply.holder_counts, "<u4").tolist()
        return {(*names[i], n) for i, n in zip(ids, counts)}

    async def body() -> None:
        async with InProcess(nats_server.url, cluster) as stub:
            await history_indexed(stub, nats_server.url, cluster)
            first = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=KEYS, packed=True))
            assert first.packed and not first.matches and first.holders_epoch
            names = {h.id: (h.instance_id, h.tier) for h in first.holders}
            assert set(names.values()) == {("p0", "device"), ("p0", "host"), ("d0", "device")}
            assert decode(first, names) == EXPECTED
            again = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(
                block_keys=KEYS, packed=True, holders_epoch=first.holders_epoch))
            assert (again.holders_epoch, list(again.holders)) == (first.holders_epoch, [])
            assert decode(again, names) == EXPECTED
            none = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(
                block_keys=[7, 8], packed=True, holders_epoch=first.holders_epoch))
            assert (none.holder_ids, none.holder_counts) == (b"", b"")
            # a new holder: the epoch moves and the names come again
            bus = await Bus.connect(nats_server.url, "producer")
            await bus.publish_event(Subjects(cluster).kv_events("n0"), KVEventBatch("n0", 1, 0.0, (stored(KEYS[:1]),)))
            await bus.close()

            async def renamed() -> bool:
                reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(
                    block_keys=KEYS, packed=True, holders_epoch=first.holders_epoch))
                if reply.holders_epoch == first.holders_epoch:
                    return False
                assert reply.holders
                return decode(reply, {h.id: (h.instance_id, h.tier) for h in reply.holders}) == \
                    EXPECTED | {("n0", "device", 1)}

            await until(renamed)

    run(body())


def test_a_restarted_cachesvc_rebuilds_the_same_index_from_the_stream(nats_server, cluster, cachesvc_process):
    cachesvc_process.start()
    run(publish_history(nats_server.url, Subjects(cluster)))
    before, stats_before = wait_for_match(cachesvc_process.address, EXPECTED)
    assert before == EXPECTED

    cachesvc_process.stop(signal.SIGKILL)
    cachesvc_process.start()  # same durable name
    after, stats_after = wait_for_match(cachesvc_process.address, EXPECTED)
    assert after == before
    assert (stats_after.indexed_blocks, stats_after.events_applied) == (stats_before.indexed_blocks,
                                                                        stats_before.events_applied)
    assert cachesvc_process.stop(signal.SIGTERM) == 0
    assert "stopped" in cachesvc_process.log_path.read_text()


def test_health_is_serving_and_reflection_lists_the_service(nats_server, cluster, cachesvc_process):
    cachesvc_process.start()
    with grpc.insecure_channel(cachesvc_process.address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("", SERVICE_NAME):
            reply = check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo
        reply = next(reflect(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        assert SERVICE_NAME in {s.name for s in reply.list_services_response.service}


def test_put_get_round_trip_with_checksums(nats_server, cluster):
    async def body() -> None:
        async with InProcess(nats_server.url, cluster) as stub:
            keys, sums, data = blocks(3)
            put = await stub.PutBlocks(cache_pb2.PutBlocksRequest(layout=LAYOUT, block_keys=keys,
                                                                  checksums=sums, data=data))
            assert (put.stored, put.skipped) == (3, 0)
            got = await stub.GetBlocks(cache_pb2.GetBlocksRequest(layout=LAYOUT, block_keys=KEYS))
            assert list(got.block_keys) == keys and list(got.checksums) == sums and got.data == data
            for i, checksum in enumerate(got.checksums):
                assert xxhash.xxh3_64_intdigest(got.data[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES]) == checksum
            reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=KEYS))
            assert matches(reply) == {("pool", "dram", 3)}
            stats = await stub.Stats(cache_pb2.StatsRequest())
            assert (stats.pool_blocks, stats.pool_bytes) == (3, 3 * BLOCK_BYTES)
            again = await stub.PutBlocks(cache_pb2.PutBlocksRequest(layout=LAYOUT, block_keys=keys,
                                                                    checksums=sums, data=data))
            assert (again.stored, again.skipped) == (0, 3)

    run(body())


def test_a_copy_for_a_repair_names_the_sessions_that_hold_each_block(nats_server, cluster):
    """What a shard's repair reads (``GetBlocks`` with ``copy``): with each block, the sessions whose write-backs
    hold it in this pool, so the repaired copy ranks as theirs; a reader's get carries none."""
    async def body() -> None:
        async with InProcess(nats_server.url, cluster, pool_eviction="session") as stub:
            keys, sums, data = blocks(3)
            await stub.PutBlocks(cache_pb2.PutBlocksRequest(layout=LAYOUT, block_keys=keys[:2], checksums=sums[:2],
                                                            data=data[:2 * BLOCK_BYTES], session_key="t/a"))
            await stub.PutBlocks(cache_pb2.PutBlocksRequest(layout=LAYOUT, block_keys=keys[2:], checksums=sums[2:],
                                                            data=data[2 * BLOCK_BYTES:]))
            await stub.PutBlocks(cache_pb2.PutBlocksRequest(layout=LAYOUT, session_key="t/b",
                                                            session_blocks=keys[1:2]))  # t/b's request read it too
            got = await stub.GetBlocks(cache_pb2.GetBlocksRequest(layout=LAYOUT, block_keys=keys, copy=True))
            assert list(got.block_keys) == keys
            assert [sorted(s.keys) for s in got.sessions] == [["t/a"], ["t/a", "t/b"], []]
            plain = await stub.GetBlocks(cache_pb2.GetBlocksRequest(layout=LAYOUT, block_keys=keys))
            assert list(plain.sessions) == [] and list(plain.priorities) == []

    run(body())


@pytest.mark.parametrize("mutate, code, message", [
    (lambda r: r.checksums.pop(), grpc.StatusCode.INVALID_ARGUMENT,
     "checksums has 2 entries for 3 block_keys"),
    (lambda r: setattr(r, "data", r.data[:-3]), grpc.StatusCode.INVALID_ARGUMENT,
     f"data has {3 * BLOCK_BYTES - 3} bytes, but 3 blocks of this layout take"),
    (lambda r: r.checksums.__setitem__(1, r.checksums[1] ^ 1), grpc.StatusCode.INVALID_ARGUMENT,
     "block 1 (key 0xfffffffffffffffe) fails its checksum"),
    (lambda r: r.ClearField("layout"), grpc.StatusCode.INVALID_ARGUMENT, "layout is required"),
    (lambda r: setattr(r.layout, "dtype", "int3"), grpc.StatusCode.INVALID_ARGUMENT,
     "unknown KV dtype 'int3'"),
])
def test_bad_put_gets_a_status_that_says_what_to_fix_and_the_server_keeps_serving(
        nats_server, cluster, mutate, code, message):
    async def body() -> None:
        async with InProcess(nats_server.url, cluster) as stub:
            keys, sums, data = blocks(3)
            request = cache_pb2.PutBlocksRequest(layout=LAYOUT, block_keys=keys, checksums=sums, data=data)
            mutate(request)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.PutBlocks(request)
            assert e.value.code() == code
            assert message in (e.value.details() or "")
            stats = await stub.Stats(cache_pb2.StatsRequest())
            assert stats.pool_blocks == 0

    run(body())


def test_get_with_another_layout_fails_its_precondition(nats_server, cluster):
    async def body() -> None:
        async with InProcess(nats_server.url, cluster) as stub:
            keys, sums, data = blocks(2)
            await stub.PutBlocks(cache_pb2.PutBlocksRequest(layout=LAYOUT, block_keys=keys, checksums=sums,
                                                            data=data))
            other = common_pb2.BlockLayout()
            other.CopyFrom(LAYOUT)
            other.dtype = "fp16"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GetBlocks(cache_pb2.GetBlocksRequest(layout=other, block_keys=keys))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "dtype: stored 'fp32', requested 'fp16'" in (e.value.details() or "")
            got = await stub.GetBlocks(cache_pb2.GetBlocksRequest(layout=LAYOUT, block_keys=keys))
            assert got.data == data

    run(body())


def test_an_instance_that_stops_beating_is_dropped(nats_server, cluster):
    subjects = Subjects(cluster)

    async def body() -> None:
        async with InProcess(nats_server.url, cluster, instance_timeout_s=1.0) as stub:
            bus = await Bus.connect(nats_server.url, "producer")
            for inst in ("alive", "dead"):
                await bus.publish_event(subjects.kv_events(inst), KVEventBatch(inst, 1, 0.0, (stored(KEYS),)))

            async def beat() -> None:
                while True:
                    await bus.publish(subjects.heartbeat("prefill", "alive"), Heartbeat(
                        "alive", "prefill", "127.0.0.1:1", "127.0.0.1:2", time.time(), InstanceLoad(), "tiny", 2))
                    await asyncio.sleep(0.2)

            beating = asyncio.create_task(beat())

            async def reply() -> set[tuple[str, str, int]]:
                return matches(await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=KEYS)))

            async def both() -> bool:
                return await reply() == {("alive", "device", 6), ("dead", "device", 6)}

            async def only_alive() -> bool:
                return await reply() == {("alive", "device", 6)}

            await until(both)
            await until(only_alive, timeout_s=5.0)
            await asyncio.sleep(1.5)  # well past the timeout: the beating one stays
            assert await only_alive()
            beating.cancel()
            await bus.close()

    run(body())


# -- restarts, disk tier, leases -----------------------------------------------------------------------------

BIG = common_pb2.BlockLayout(model_fingerprint="big", num_layers=4, num_kv_heads=8, head_dim=128, block_size=16,
                             dtype="fp32", layout="layer-major", tp_rank=0, tp_size=1)
BIG_BYTES = 4 * 2 * 16 * 8 * 128 * 4  # 512 KiB: two fit in a 1 MiB DRAM tier


def big_put(keys: list[int]) -> cache_pb2.PutBlocksRequest:
    chunks = [os.urandom(BIG_BYTES) for _ in keys]
    return cache_pb2.PutBlocksRequest(layout=BIG, block_keys=keys, checksums=[xxhash.xxh3_64_intdigest(c)
                                                                                for c in chunks],
                                      data=b"".join(chunks))


def test_a_restart_mid_run_rebuilds_the_index_and_loses_no_disk_block(nats_server, cluster, cachesvc_with_disk):
    """Events keep flowing while cachesvc is killed and started again: the index ends up exact, and every
    block that was on disk is still served, byte for byte."""
    subjects = Subjects(cluster)
    chain = [BlockKey(1000 + i) for i in range(40)]
    on_disk = big_put(KEYS)                       # 3 MiB: more than DRAM holds, so it goes to disk
    in_dram = big_put([BlockKey(7), BlockKey(8)])  # lost on SIGKILL, by design

    async def produce() -> None:
        bus = await Bus.connect(nats_server.url, "producer")
        await bus.ensure_events_stream(subjects)
        for i, key in enumerate(chain, 1):
            events = [stored([key])] + ([stored(chain[:i], "host")] if i % 10 == 0 else [])
            await bus.publish_event(subjects.kv_events("p0"), KVEventBatch("p0", i, 0.0, tuple(events)))
            await asyncio.sleep(0.05)
        await bus.close()

    async def body() -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, cachesvc_with_disk.start)
        async with grpc.aio.insecure_channel(cachesvc_with_disk.address) as channel:
            stub = cache_pb2_grpc.CacheServiceStub(channel)
            assert (await stub.PutBlocks(on_disk)).stored == 6
            assert (await stub.PutBlocks(in_dram)).stored == 2
        producing = asyncio.create_task(produce())
        await asyncio.sleep(0.6)
        await loop.run_in_executor(None, cachesvc_with_disk.stop, signal.SIGKILL)
        await loop.run_in_executor(None, cachesvc_with_disk.start)
        await producing
        async with grpc.aio.insecure_channel(cachesvc_with_disk.address) as channel:
            stub = cache_pb2_grpc.CacheServiceStub(channel)

            async def indexed() -> bool:
                reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=chain))
                return matches(reply) == {("p0", "device", 40), ("p0", "host", 40)}

            await until(indexed)
            stats = await stub.Stats(cache_pb2.StatsRequest())
            assert (stats.indexed_blocks, stats.events_applied, stats.event_gaps) == (40, 44, 0)
            assert stats.caught_up
            reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=KEYS))
            assert matches(reply) == {("pool", "disk", 6)}
            got = await stub.GetBlocks(cache_pb2.GetBlocksRequest(layout=BIG, block_keys=KEYS))
            assert (list(got.block_keys), got.data) == (KEYS, on_disk.data)
            assert list(got.tiers) == ["disk"] * 6

    run(body(), timeout_s=90)


def test_a_graceful_stop_spills_dram_to_disk(nats_server, cluster, cachesvc_with_disk):
    cachesvc_with_disk.start()
    put = big_put(KEYS[:2])
    with grpc.insecure_channel(cachesvc_with_disk.address) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        stub.PutBlocks(put, timeout=10)
        assert matches(stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=KEYS), timeout=5)) == {
            ("pool", "dram", 2), ("pool", "disk", 2)}
    assert cachesvc_with_disk.stop(signal.SIGTERM) == 0
    cachesvc_with_disk.start()
    with grpc.insecure_channel(cachesvc_with_disk.address) as channel:
        stub = cache_pb2_grpc.CacheServiceStub(channel)
        got = stub.GetBlocks(cache_pb2.GetBlocksRequest(layout=BIG, block_keys=KEYS), timeout=10)
        assert (list(got.block_keys), got.data, list(got.tiers)) == (KEYS[:2], put.data, ["disk", "disk"])


def test_a_leased_block_survives_eviction_pressure(nats_server, cluster):
    async def body() -> None:
        async with InProcess(nats_server.url, cluster, pool_capacity_mb=1) as stub:
            await stub.PutBlocks(big_put(KEYS[:1]))
            got = await stub.GetBlocks(cache_pb2.GetBlocksRequest(layout=BIG, block_keys=KEYS[:1], lease_s=30))
            assert (got.leased_blocks, got.lease_id > 0) == (1, True)
            for key in range(100, 110):                    # DRAM holds two blocks: one is leased
                await stub.PutBlocks(big_put([BlockKey(key)]))
            reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=KEYS[:1]))
            assert matches(reply) == {("pool", "dram", 1)}
            stats = await stub.Stats(cache_pb2.StatsRequest())
            assert (stats.leases, stats.leased_blocks, stats.tiers[0].evicted) == (1, 1, 9)

            released = await stub.ReleaseLease(cache_pb2.ReleaseLeaseRequest(lease_id=got.lease_id))
            assert released.released
            for key in range(200, 202):
                await stub.PutBlocks(big_put([BlockKey(key)]))
            reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=KEYS[:1]))
            assert matches(reply) == set()

    run(body())


def test_puts_when_everything_is_leased_are_refused_with_a_reason(nats_server, cluster):
    async def body() -> None:
        async with InProcess(nats_server.url, cluster, pool_capacity_mb=1) as stub:
            await stub.PutBlocks(big_put(KEYS[:2]))
            lease = await stub.LeaseBlocks(cache_pb2.LeaseBlocksRequest(block_keys=KEYS, lease_s=30))
            assert lease.num_blocks == 2
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.PutBlocks(big_put(KEYS[2:3]))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "not leased; retry when leases end" in (e.value.details() or "")

    run(body())


@pytest.mark.parametrize("request_, message", [
    (cache_pb2.GetBlocksRequest(layout=LAYOUT, block_keys=KEYS, lease_s=-1), "lease_s must be in [0, 300.0]"),
    (cache_pb2.GetBlocksRequest(layout=LAYOUT, block_keys=KEYS, lease_s=301), "lease_s must be in [0, 300.0]"),
    (cache_pb2.LeaseBlocksRequest(block_keys=KEYS), "lease_s must be in (0, 300.0]"),
])
def test_bad_lease_requests_say_what_to_fix(nats_server, cluster, request_, message):
    async def body() -> None:
        async with InProcess(nats_server.url, cluster) as stub:
            call = stub.GetBlocks if isinstance(request_, cache_pb2.GetBlocksRequest) else stub.LeaseBlocks
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call(request_)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in (e.value.details() or "")

    run(body())
