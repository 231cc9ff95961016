"""The external tier on a real Mooncake Store: a master (with its built-in HTTP metadata server) on
127.0.0.1, cachesvc as a store client lending it memory, blocks put and got back through cachesvc's gRPC API."""

from __future__ import annotations

import logging
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

store = pytest.importorskip(
    "mooncake.store", reason="Mooncake Store is not installed here: pip install 'kvmesh[mooncake]' "
    "(mooncake-transfer-engine-non-cuda) and apt-get install libibverbs1",
    exc_type=ImportError)  # installed without Debian's libibverbs1 it fails to load: skip, do not error

from kvmesh.contracts.layout import KVLayout
from kvmesh.proto.v1 import cache_pb2
from kvmesh.settings import CacheServiceSettings

from services.cachesvc.pool import Pool
from tests.integration.test_cachesvc import BIG, BIG_BYTES, KEYS, InProcess, big_put, matches, run
from tests.ports import guess_free_port

START_TRIES = 5  # mooncake binaries cannot bind port 0: guessed ports, retried when one is taken


class Master:
    """``mooncake_master`` from the wheel: every listener it lets us choose bound to 127.0.0.1.

    It cannot bind port 0 (``-rpc_port=0`` means 50051) nor report a port, so its ports are guesses: a guess
    another process took makes it exit at start, and ``start()`` tries again with new guesses."""

    def __init__(self, log_path: Path) -> None:
        self.rpc_port = self.http_port = self.metrics_port = 0
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def start(self) -> None:
        for attempt in range(START_TRIES):
            self.rpc_port, self.http_port, self.metrics_port = (guess_free_port() for _ in range(3))
            if self._start_once(last=attempt == START_TRIES - 1):
                return

    def _start_once(self, last: bool) -> bool:
        binary = Path(store.__file__).parent / "mooncake_master"
        args = [str(binary), "-rpc_address=127.0.0.1", f"-rpc_port={self.rpc_port}", "-rpc_thread_num=2",
                "-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1",
                f"-http_metadata_server_port={self.http_port}", "-metrics_host=127.0.0.1",
                f"-metrics_port={self.metrics_port}", "-enable_metric_reporting=false",
                "-default_kv_lease_ttl=200"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log)
        deadline = time.monotonic() + 15
        while "metadata server started" not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None and not last:  # most likely a guessed port was taken: guess again
                return False
            assert self.proc.poll() is None, f"mooncake_master exited:\n{self.log_path.read_text()}"
            assert time.monotonic() < deadline, f"mooncake_master did not start:\n{self.log_path.read_text()}"
            time.sleep(0.1)
        time.sleep(0.5)
        return self.proc.poll() is None or last  # not: a listener bound after the metadata server failed

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    m = Master(tmp_path / "mooncake_master.log")
    m.start()
    yield m
    m.stop()


@pytest.fixture
def cluster() -> str:
    return f"m{uuid.uuid4().hex[:10]}"


def settings(m: Master, **more: object) -> dict[str, object]:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    return {"external": "mooncake", "mooncake_master": m.address, "mooncake_metadata_url": m.metadata_url,
            "mooncake_host": "127.0.0.1", "mooncake_segment_mb": 64, "external_capacity_mb": 32, **more}


def test_blocks_round_trip_through_cachesvc_into_mooncake_store(nats_server, cluster, master):
    async def body() -> None:
        async with InProcess(nats_server.url, cluster, **settings(master, pool_capacity_mb=0)) as stub:
            put = big_put(KEYS[:4])
            assert (await stub.PutBlocks(put)).stored == 4
            reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=KEYS))
            assert matches(reply) == {("pool", "external", 4)}
            got = await stub.GetBlocks(cache_pb2.GetBlocksRequest(layout=BIG, block_keys=KEYS))
            assert (list(got.block_keys), got.data, list(got.tiers)) == (KEYS[:4], put.data, ["external"] * 4)
            stats = await stub.Stats(cache_pb2.StatsRequest())
            assert [(t.tier, t.blocks) for t in stats.tiers] == [("external", 4)]

    run(body(), timeout_s=60)


def test_dram_evictions_spill_into_mooncake_and_come_back(nats_server, cluster, master):
    async def body() -> None:
        async with InProcess(nats_server.url, cluster, **settings(master, pool_capacity_mb=1)) as stub:
            puts = [big_put([key]) for key in KEYS[:4]]
            for put in puts:                       # DRAM holds two; the first two spill
                await stub.PutBlocks(put)
            got = await stub.GetBlocks(cache_pb2.GetBlocksRequest(layout=BIG, block_keys=KEYS[:4]))
            assert got.data == b"".join(p.data for p in puts)
            assert list(got.tiers) == ["external", "external", "dram", "dram"]

    run(body(), timeout_s=60)


def test_keys_lost_by_a_restarted_master_are_misses_not_errors(nats_server, cluster, master):
    """The store forgets everything when its master restarts; cachesvc treats it as a cache."""

    async def body() -> None:
        async with InProcess(nats_server.url, cluster, **settings(master, pool_capacity_mb=0)) as stub:
            await stub.PutBlocks(big_put(KEYS[:2]))
            master.stop()
            master.start()
            got = await stub.GetBlocks(cache_pb2.GetBlocksRequest(layout=BIG, block_keys=KEYS[:2]))
            assert list(got.block_keys) == []
            reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=KEYS))
            assert ("pool", "external", 2) not in matches(reply)

    run(body(), timeout_s=90)


class StoreNode:
    """``mooncake_client`` from the wheel: a store node lending memory, so blocks live outside cachesvc's own
    process (cachesvc lends none with ``mooncake_segment_mb = 0``) and outlive its restarts."""

    def __init__(self, m: Master, log_path: Path) -> None:
        binary = Path(store.__file__).parent / "mooncake_client"
        client = raw_client(m)
        for attempt in range(START_TRIES):  # its port is a guess too (see Master): a taken one, guess again
            with open(log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [str(binary), "-host=127.0.0.1", f"-port={guess_free_port()}", "-global_segment_size=128MB",
                     f"-master_server_address={m.address}", f"-metadata_server={m.metadata_url}"],
                    stdout=log, stderr=log, env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"})
            if self._joined(client, log_path, last=attempt == START_TRIES - 1):
                break
        client.remove("probe")
        client.close()

    def _joined(self, client: Any, log_path: Path, last: bool) -> bool:
        deadline = time.monotonic() + 15
        while client.put("probe", b"x") != 0:  # fails until the node's memory is mounted
            if self.proc.poll() is not None and not last:
                return False
            assert self.proc.poll() is None, f"mooncake_client exited:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"mooncake_client did not join:\n{log_path.read_text()}"
            time.sleep(0.2)
        return True

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def raw_client(m: Master) -> Any:
    """A store client of the test itself, lending no memory."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    client = store.MooncakeDistributedStore()
    assert client.setup("127.0.0.1", m.metadata_url, 0, 16 << 20, "tcp", "", m.address) == 0
    return client


@pytest.fixture
def node(master: Master, tmp_path: Path) -> Iterator[StoreNode]:
    n = StoreNode(master, tmp_path / "mooncake_client.log")
    yield n
    n.stop()


def open_pool(m: Master, cluster: str, **more: object) -> Pool:
    cfg = CacheServiceSettings(durable_name=f"cachesvc-{cluster}",
                             **settings(m, pool_capacity_mb=0, mooncake_segment_mb=0, **more))
    return Pool.from_config(cfg, cluster=cluster)


def object_name(cluster: str, key: int) -> str:
    return f"kvmesh/{cluster}/{xxhash.xxh3_64_hexdigest(KVLayout.from_proto(BIG).to_json())}/{key:016x}"


def test_a_restarted_cachesvc_serves_the_blocks_it_had_put_in_mooncake(nats_server, cluster, master, node):
    lends_none = settings(master, pool_capacity_mb=0, mooncake_segment_mb=0)
    put = big_put(KEYS[:4])

    async def before() -> None:
        async with InProcess(nats_server.url, cluster, **lends_none) as stub:
            assert (await stub.PutBlocks(put)).stored == 4

    async def after() -> None:
        async with InProcess(nats_server.url, cluster, **lends_none) as stub:
            reply = await stub.MatchPrefix(cache_pb2.MatchPrefixRequest(block_keys=KEYS))
            assert matches(reply) == {("pool", "external", 4)}
            got = await stub.GetBlocks(cache_pb2.GetBlocksRequest(layout=BIG, block_keys=KEYS))
            assert (list(got.block_keys), got.data, list(got.tiers)) == (KEYS[:4], put.data, ["external"] * 4)
            stats = await stub.Stats(cache_pb2.StatsRequest())
            assert [(t.tier, t.blocks, t.bytes) for t in stats.tiers] == [("external", 4, 4 * BIG_BYTES)]
            assert (await stub.PutBlocks(put)).skipped == 4

    run(before(), timeout_s=60)
    run(after(), timeout_s=60)


def test_the_manifest_is_written_on_a_timer_so_a_crashed_cachesvc_loses_at_most_one_interval(
        cluster, master, node):
    first = open_pool(master, cluster, mooncake_manifest_s=0.2)
    put = big_put(KEYS[:3])
    first.put(KVLayout.from_proto(BIG), put.block_keys, put.checksums, put.data)
    first.maintain()                                    # too soon: nothing written yet
    assert len(open_pool(master, cluster).tiers[0]) == 0
    time.sleep(0.3)
    first.maintain()
    second = open_pool(master, cluster)                 # the first one never closed, as after a SIGKILL
    got = second.get(KVLayout.from_proto(BIG), KEYS)
    assert ([b.key for b in got.blocks], b"".join(bytes(b.data) for b in got.blocks)) == (KEYS[:3], put.data)
    second.close()
    first.close()


def test_entries_whose_objects_left_the_store_are_dropped_on_restart(cluster, master, node):
    first = open_pool(master, cluster)
    put = big_put(KEYS[:4])
    first.put(KVLayout.from_proto(BIG), put.block_keys, put.checksums, put.data)
    client = raw_client(master)
    assert client.batch_remove([object_name(cluster, k) for k in KEYS[2:4]], True) == [0, 0]
    client.close()
    first.close()                                       # its manifest still lists all four
    second = open_pool(master, cluster)
    tier = second.tiers[0]
    assert ([k for k in KEYS if tier.has(k)], len(tier), tier.used_bytes) == (KEYS[:2], 2, 2 * BIG_BYTES)
    assert second.leading(KEYS) == [("external", 2)]
    second.close()


def test_a_garbage_manifest_starts_the_tier_empty_with_a_warning(cluster, master, node, caplog):
    first = open_pool(master, cluster)
    put = big_put(KEYS[:2])
    first.put(KVLayout.from_proto(BIG), put.block_keys, put.checksums, put.data)
    first.close()
    client = raw_client(master)
    assert client.upsert(f"kvmesh/{cluster}/manifest/cachesvc-{cluster}", b"\x00not a manifest") == 0
    client.close()
    with caplog.at_level(logging.WARNING, logger="services.cachesvc.mooncake"):
        second = open_pool(master, cluster)
    assert len(second.tiers[0]) == 0
    assert "manifest" in caplog.text and "unreadable" in caplog.text and "starting empty" in caplog.text
    assert second.put(KVLayout.from_proto(BIG), put.block_keys, put.checksums, put.data).stored == 2
    second.close()
