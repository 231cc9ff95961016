"""The external tier on a real Mooncake Store: a master (with its built-in HTTP metadata server) on
127.0.0.1, cachesvc as a store client lending it memory, blocks put and got back through cachesvc's gRPC API."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

store = pytest.importorskip(
    "mooncake.store", reason="Mooncake Store is not installed here: pip install 'kvmesh[mooncake]' "
    "(mooncake-transfer-engine-non-cuda) and apt-get install libibverbs1")

from kvmesh.bus.nats_server import free_port
from kvmesh.proto.v1 import cache_pb2

from tests.integration.test_cachesvc import BIG, KEYS, InProcess, big_put, matches, run


class Master:
    """``mooncake_master`` from the wheel: every listener it lets us choose bound to 127.0.0.1."""

    def __init__(self, log_path: Path) -> None:
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def start(self) -> None:
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
            assert self.proc.poll() is None, f"mooncake_master exited:\n{self.log_path.read_text()}"
            assert time.monotonic() < deadline, f"mooncake_master did not start:\n{self.log_path.read_text()}"
            time.sleep(0.1)
        time.sleep(0.5)

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
