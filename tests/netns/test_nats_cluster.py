"""The KV events stream on a three-server NATS cluster (JetStream, ``events_replicas`` 3): cachesvc's index, which
is rebuilt from that stream, keeps its source through the loss of any one server. Each nats-server runs on a host of
its own (network namespaces: the cluster's routes need ports known in advance, which only addresses the lab alone
has make safe); cachesvc runs on another and dials all three (``nats_url`` comma-separated), as does the client
that publishes the events."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from kvmesh.bus import Bus, Subjects, find_nats_server
from kvmesh.contracts.events import BlockStored
from kvmesh.contracts.messages import KVEventBatch
from kvmesh.ready import terminate, wait_ready

from app.netlab.hosts import Lab
from app.netlab.mesh import wait_port

pytestmark = [pytest.mark.netns, pytest.mark.slow]
SERVERS = ["nats-a", "nats-b", "nats-c"]
CLIENT_PORT, ROUTE_PORT, CACHESVC_PORT = 4222, 6222, 50060
REPO = Path(__file__).resolve().parents[2]
FIRST = [2**63 + i for i in range(4)]
SECOND = [2**62 + i for i in range(3)]

# asked inside the client host (gRPC opens its sockets on its own threads, so a namespaced thread is not enough)
MATCH = """
import json, sys, grpc
from kvmesh.proto.v1 import cache_pb2, cache_pb2_grpc
with grpc.insecure_channel(sys.argv[1]) as channel:
    reply = cache_pb2_grpc.CacheServiceStub(channel).MatchPrefix(
        cache_pb2.MatchPrefixRequest(block_keys=json.loads(sys.argv[2])), timeout=5)
print(json.dumps(sorted([m.instance_id, m.num_blocks] for m in reply.matches)))
"""


class Cluster:
    def __init__(self, lab: Lab, state: Path) -> None:
        self.lab, self.state = lab, state
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls = ",".join(f"nats://{lab[s].address}:{CLIENT_PORT}" for s in SERVERS)
        self.cluster = f"nc{uuid.uuid4().hex[:6]}"
        self.subjects = Subjects(self.cluster)
        self.cachesvc = f"{lab['cache'].address}:{CACHESVC_PORT}"

    def spawn(self, name: str, host: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(self.state / f"{name}.log", "ab") as log:
            proc = self.lab.popen(host, argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True, env={**os.environ, **(env or {})})
        self.procs[name] = proc
        return proc

    def start_nats(self) -> None:
        for name in SERVERS:
            address = self.lab[name].address
            routes = ",".join(f"nats://{self.lab[o].address}:{ROUTE_PORT}" for o in SERVERS if o != name)
            self.spawn(name, name, [find_nats_server(), "-a", address, "-p", str(CLIENT_PORT), "-js",
                                    "-sd", str(self.state / name), "--server_name", name, "--cluster_name", "kvmesh",
                                    "--cluster", f"nats://{address}:{ROUTE_PORT}", "--routes", routes])
        for name in SERVERS:
            self.lab.call("client", lambda a=self.lab[name].address: wait_port(a, CLIENT_PORT,
                                                                                time.monotonic() + 30))

    def start_cachesvc(self) -> None:
        ready = self.state / "cachesvc.ready.json"
        ready.unlink(missing_ok=True)
        proc = self.spawn("cachesvc", "cache", [sys.executable, "-m", "services.cachesvc"], {
            "PYTHONPATH": os.pathsep.join([str(REPO / "libs"), str(REPO), os.environ.get("PYTHONPATH", "")]),
            "KVMESH_NATS_URL": self.urls, "KVMESH_EVENTS_REPLICAS": "3", "KVMESH_CLUSTER": self.cluster,
            "KVMESH_MESH_TLS": "false", "KVMESH_READY_FILE": str(ready), "KVMESH_STATE_DIR": str(self.state),
            "KVMESH_CACHESVC_HOST": self.lab["cache"].address, "KVMESH_CACHESVC_PORT": str(CACHESVC_PORT),
            "KVMESH_CACHESVC_INSTANCE_TIMEOUT_S": "600", "KVMESH_CACHESVC_POOL_CAPACITY_MB": "0"})
        wait_ready(ready, proc, "cachesvc", self.state / "cachesvc.log", timeout_s=60)

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        for name in list(self.procs):
            terminate(self.procs.pop(name))

    def publish(self, seq: int, keys: list[int], timeout_s: float = 60.0) -> None:
        """One batch of instance p0 into the events stream (created with 3 replicas once the cluster has a
        JetStream leader), from the client host; retried while the cluster elects or the client fails over."""
        async def go() -> None:
            bus = await Bus.connect(self.urls, "publisher")
            try:
                deadline = time.monotonic() + timeout_s
                while True:
                    try:
                        await bus.ensure_events_stream(self.subjects, replicas=3)
                        await bus.publish_event(self.subjects.kv_events("p0"), KVEventBatch(
                            "p0", seq, time.time(), (BlockStored(tuple(keys), None, 16, "device"),)), timeout_s=5)
                        return
                    except Exception:  # no JetStream leader yet, or a server just died
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.5)
            finally:
                await bus.close()

        self.lab.call("client", lambda: asyncio.run(go()))

    def replicas(self) -> int:
        async def go() -> int:
            bus = await Bus.connect(self.urls, "inspector")
            try:
                return (await bus.js.stream_info(self.subjects.events_stream)).config.num_replicas or 1
            finally:
                await bus.close()

        return self.lab.call("client", lambda: asyncio.run(go()))

    def matched(self, keys: list[int]) -> list[list]:
        done = subprocess.run(["ip", "netns", "exec", self.lab["client"].ns, sys.executable, "-c", MATCH,
                               self.cachesvc, json.dumps(keys)], check=False, capture_output=True, text=True,
                              timeout=30, env={**os.environ, "PYTHONPATH": f"{REPO / 'libs'}{os.pathsep}{REPO}"})
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def until_matched(self, keys: list[int], expected: list[list], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (got := self.matched(keys)) != expected:
            assert time.monotonic() < deadline, f"cachesvc answers {got}, not {expected}; see {self.state}"
            time.sleep(0.5)


@pytest.fixture
def cluster(tmp_path):
    with Lab([*SERVERS, "cache", "client"]) as lab:
        c = Cluster(lab, tmp_path)
        try:
            yield c
        finally:
            c.stop()
    assert not lab.namespaces(), "the lab's namespaces outlived it"


def test_the_index_keeps_its_source_through_a_nats_servers_loss(cluster):
    cluster.start_nats()
    cluster.publish(1, FIRST)
    assert cluster.replicas() == 3
    cluster.start_cachesvc()
    cluster.until_matched(FIRST, [["p0", 4]])
    assert cluster.replicas() == 3  # cachesvc, reading events_replicas, left the stream as it was
    # any one server gone: the clients move to the others, the stream keeps its two other copies
    cluster.kill("nats-a")
    cluster.publish(2, SECOND)
    cluster.until_matched(SECOND, [["p0", 3]])
    # cachesvc restarted while that server is still gone: its index comes back whole from the stream
    cluster.kill("cachesvc")
    cluster.start_cachesvc()
    cluster.until_matched(FIRST, [["p0", 4]])
    cluster.until_matched(SECOND, [["p0", 3]])
