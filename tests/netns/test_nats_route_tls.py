"""A NATS cluster's routes under the mesh's mutual TLS (``kvmesh.bus.permissions --route-tls``, as
``deploy/k8s/components/tls/nats.conf`` has them): three servers, each on a host of its own (network namespaces:
route ports are known in advance only where the lab alone has the addresses), form the cluster over TLS routes; a
server whose certificate another CA signed and one without TLS try to route into it and are refused, and the
cluster stays three. With routes by identity (``--route-identity``), a server holding a certificate the mesh CA
gave another identity (a decode instance's) is refused too, and so it is where every server runs the very files
Kubernetes gives a node of ``deploy/k8s/components/nats-cluster`` (its ``cluster.conf``, which includes the
one-node ``nats.conf`` of ``components/tls`` or ``components/nats-auth-callout``): the three form the cluster, its
JetStream meta group and a stream with three copies (with the auth callout, its members authorised by the callout
service, which answers all three servers)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from kvmesh import tls
from kvmesh.bus import Bus, Subjects, auth_callout, find_nats_server, permissions
from kvmesh.contracts.events import BlockStored
from kvmesh.contracts.messages import KVEventBatch
from kvmesh.identity import Identity, MeshRole
from kvmesh.mesh_ca import CertFiles, MeshCA
from kvmesh.ready import terminate
from kvmesh.settings import SharedSettings

from app.netlab.hosts import Lab
from app.netlab.mesh import wait_port

pytestmark = [pytest.mark.netns, pytest.mark.slow]
SERVERS = ["nats-a", "nats-b", "nats-c"]
CLIENT_PORT, ROUTE_PORT, MONITOR_PORT = 4222, 6222, 8222
SERVER_IDENTITY = Identity(MeshRole.CLIENT, "nats")
ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ROOT / "deploy" / "k8s" / "components"
POD = re.compile(r"\bnats-(\d+)\.nats-headless\b")  # node i's name in cluster.conf's routes


def routed_to(lab: Lab, name: str) -> set[str]:
    """The servers ``name`` has a route with (``/routez``'s remote names), asked from the client host."""
    return {r.get("remote_name", "") for r in monitor(lab, name, "routez").get("routes") or []}


def monitor(lab: Lab, name: str, endpoint: str) -> dict:
    """``name``'s monitoring endpoint, asked from the client host."""
    url = f"http://{lab[name].address}:{MONITOR_PORT}/{endpoint}"
    return json.loads(lab.call("client", lambda: urllib.request.urlopen(url, timeout=5).read()))


def wait_for_the_cluster(lab: Lab) -> None:
    """Until every server routes to every other one (60 s at most)."""
    deadline = time.monotonic() + 60
    while any(routed_to(lab, h) != set(SERVERS) - {h} for h in SERVERS):
        assert time.monotonic() < deadline, {h: routed_to(lab, h) for h in SERVERS}
        time.sleep(0.5)


def serve(lab: Lab, host: str, config: Path | None, tmp_path: Path, procs: list[subprocess.Popen],
          listen_flag: bool) -> Path:
    """nats-server on ``host`` routing to the other servers (its log's path); ``listen_flag``: its route listen
    address from ``--cluster`` (which clears a route user), else from ``config``."""
    address = lab[host].address
    routes = ",".join(f"nats://{lab[o].address}:{ROUTE_PORT}" for o in SERVERS if o != host)
    log = tmp_path / f"{host}.log"
    with open(log, "ab") as out:
        procs.append(lab.popen(host, [
            find_nats_server(), "-a", address, "-p", str(CLIENT_PORT), "-m", str(MONITOR_PORT), "-js",
            "-sd", str(tmp_path / host), "--server_name", host, "--cluster_name", "kvmesh",
            *(["--cluster", f"nats://{address}:{ROUTE_PORT}"] if listen_flag else []), "--routes", routes,
            *(["-c", str(config)] if config else [])],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env=dict(os.environ)))
    lab.call("client", lambda: wait_port(address, MONITOR_PORT, time.monotonic() + 30))
    return log


def test_routes_are_mutual_tls_and_only_the_servers_certificate_joins(tmp_path: Path) -> None:
    with Lab([*SERVERS, "intruder", "plain", "client"]) as lab:
        ca = MeshCA.open(tmp_path / "tls")
        addresses = tuple(lab[h].address for h in [*SERVERS, "intruder", "plain"])
        server = ca.issue(SERVER_IDENTITY, addresses)
        other = MeshCA.open(tmp_path / "other-ca").issue(SERVER_IDENTITY, addresses)  # the right name, another CA
        subjects = Subjects("routes")
        good = permissions.write_config(tmp_path / "nats.conf", [Identity(MeshRole.ADMIN, "op")], subjects,
                                        str(server.cert), str(server.key), str(server.ca), route_tls=True)
        forged = permissions.write_config(tmp_path / "intruder.conf", [Identity(MeshRole.ADMIN, "op")], subjects,
                                          str(other.cert), str(other.key), str(server.ca), route_tls=True)
        procs: list[subprocess.Popen] = []

        def start(host: str, config: Path | None) -> Path:
            return serve(lab, host, config, tmp_path, procs, listen_flag=True)

        try:
            for host in SERVERS:
                start(host, good)
            wait_for_the_cluster(lab)
            assert "TLS" in (tmp_path / "nats-a.log").read_text()  # the routes' handshakes

            logs = {"intruder": start("intruder", forged), "plain": start("plain", None)}
            # each is refused by the servers it dials (and they by it), as each server's log says
            deadline = time.monotonic() + 60
            while True:
                texts = [(tmp_path / f"{h}.log").read_text() for h in SERVERS]
                refused_other = any(f"{lab['intruder'].address}:" in line and "tls" in line.lower()
                                    and "error" in line.lower() for t in texts for line in t.splitlines())
                refused_plain = any(f"{lab['plain'].address}:" in line and "error" in line.lower()
                                    for t in texts for line in t.splitlines())
                if refused_other and refused_plain:
                    break
                assert time.monotonic() < deadline, (f"not refused: {refused_other=} {refused_plain=}; "
                                                     f"{logs['intruder'].read_text()[-1500:]}")
                time.sleep(0.5)
            for host in SERVERS:
                assert routed_to(lab, host) == set(SERVERS) - {host}, host
            assert routed_to(lab, "intruder") == set() and routed_to(lab, "plain") == set()
        finally:
            for proc in procs:
                terminate(proc)
    assert sys.platform.startswith("linux")


def test_routes_by_identity_refuse_a_mesh_certificate_that_names_another_identity(tmp_path: Path) -> None:
    """Each server's route listen in its file, not a --cluster flag (which clears the route user); the intruder's
    certificate is the mesh CA's own, for a decode instance."""
    with Lab([*SERVERS, "intruder", "client"]) as lab:
        ca = MeshCA.open(tmp_path / "tls")
        addresses = tuple(lab[h].address for h in [*SERVERS, "intruder"])
        server = ca.issue(SERVER_IDENTITY, addresses)
        decode = ca.issue(Identity(MeshRole.DECODE, "decode-0"), addresses)
        procs: list[subprocess.Popen] = []

        def start(host: str, files: CertFiles) -> Path:
            config = permissions.write_config(
                tmp_path / f"{host}.conf", [Identity(MeshRole.ADMIN, "op")], Subjects("routes"), str(files.cert),
                str(files.key), str(files.ca), route_identity=SERVER_IDENTITY,
                route_listen=f"{lab[host].address}:{ROUTE_PORT}")
            return serve(lab, host, config, tmp_path, procs, listen_flag=False)

        try:
            for host in SERVERS:
                start(host, server)
            wait_for_the_cluster(lab)
            refused_by_identity(lab, tmp_path, start("intruder", decode))
        finally:
            for proc in procs:
                terminate(proc)


def refused_by_identity(lab: Lab, tmp_path: Path, intruder_log: Path) -> None:
    """Until a server's log has refused the intruder's route for its certificate (60 s at most); then the
    cluster is still the three, and the intruder routes to none."""
    deadline = time.monotonic() + 60
    while not any(f"{lab['intruder'].address}:" in line and "authentication error" in line
                  for h in SERVERS for line in (tmp_path / f"{h}.log").read_text().splitlines()):
        assert time.monotonic() < deadline, intruder_log.read_text()[-1500:]
        time.sleep(0.5)
    for host in SERVERS:
        assert routed_to(lab, host) == set(SERVERS) - {host}, host
    assert routed_to(lab, "intruder") == set()


def kubernetes_node(lab: Lab, host: str, tmp_path: Path, files: CertFiles, nats_conf: Path) -> Path:
    """``host``'s copy of what a node of components/nats-cluster mounts, under ``tmp_path/host`` in place of
    ``/``: the certificate Secret at etc/kvmesh/tls, ``nats_conf`` (the one-node file of components/tls or
    nats-auth-callout) at etc/kvmesh/nats, components/nats-cluster/cluster.conf at etc/kvmesh/nats-cluster. In
    each the absolute paths move under that root (JetStream's /data too) and the pod names the routes dial,
    nats-<i>.nats-headless, become the lab addresses of SERVERS[i]; the include stays as it is. Its
    cluster.conf's path."""
    root = tmp_path / host
    (root / "etc/kvmesh/tls").mkdir(parents=True)
    for src, name in ((files.cert, "tls.crt"), (files.key, "tls.key"), (files.ca, "ca.crt")):
        shutil.copy(src, root / "etc/kvmesh/tls" / name)
    cluster = (COMPONENTS / "nats-cluster" / "cluster.conf").read_text()
    assert sorted(int(i) for i in POD.findall(cluster)) == list(range(len(SERVERS))), cluster
    for text, dst in ((nats_conf.read_text(), root / "etc/kvmesh/nats/nats.conf"),
                      (cluster, root / "etc/kvmesh/nats-cluster/cluster.conf")):
        text = text.replace('"/etc/kvmesh/', f'"{root}/etc/kvmesh/').replace('"/data/', f'"{root}/data/')
        dst.parent.mkdir(parents=True)
        dst.write_text(POD.sub(lambda m: lab[SERVERS[int(m.group(1))]].address, text))
    return root / "etc/kvmesh/nats-cluster/cluster.conf"


def wait_for_jetstream(lab: Lab) -> None:
    """Until every server reports the JetStream meta group of the three with a leader (60 s at most)."""
    deadline = time.monotonic() + 60
    while True:
        metas = {h: monitor(lab, h, "jsz").get("meta_cluster") or {} for h in SERVERS}
        if all(m.get("cluster_size") == len(SERVERS) and m.get("leader") in SERVERS for m in metas.values()):
            return
        assert time.monotonic() < deadline, metas
        time.sleep(0.5)


def three_copies(lab: Lab, ca: MeshCA, prefill_id: str = "prefill") -> None:
    """The KV events stream of cluster default created with 3 replicas (as cachesvc, whose user may create it) and
    an event stored in it (as prefill ``prefill_id``: components/tls's users name one identity per role, the auth
    callout each pod's own), from the client host; until its leader and both replicas are the three servers,
    current, with the event (60 s at most: JetStream elects the stream's leader first)."""
    subjects = Subjects("default")  # the cluster components/tls/nats.conf's users are for
    urls = ",".join(f"nats://{lab[s].address}:{CLIENT_PORT}" for s in SERVERS)

    async def connect(identity: Identity) -> Bus:
        cfg = SharedSettings(**{k.removeprefix("KVMESH_").lower(): v for k, v in ca.issue(identity).env().items()})
        return await Bus.connect(urls, identity.instance, tls=tls.bus_tls(cfg))

    async def go() -> None:
        cachesvc = await connect(Identity(MeshRole.CACHESVC, "cachesvc"))
        prefill = await connect(Identity(MeshRole.PREFILL, prefill_id))
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    await cachesvc.ensure_events_stream(subjects, replicas=3)
                    await prefill.publish_event(subjects.kv_events(prefill_id), KVEventBatch(
                        prefill_id, 1, time.time(), (BlockStored((1, 2), None, 16, "device"),)))
                    break
                except Exception:  # no stream leader yet
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
            while True:
                info = await cachesvc.js.stream_info(subjects.events_stream)
                replicas = (info.cluster.replicas if info.cluster else None) or []
                peers = {info.cluster.leader if info.cluster else None, *(r.name for r in replicas)}
                if (info.config.num_replicas, info.state.messages, peers) == (3, 1, set(SERVERS)) and all(
                        r.current for r in replicas):
                    return
                assert time.monotonic() < deadline, info
                await asyncio.sleep(0.5)
        finally:
            await cachesvc.close()
            await prefill.close()

    lab.call("client", lambda: asyncio.run(go()))


def callout_service(lab: Lab, ca: MeshCA, tmp_path: Path) -> subprocess.Popen:
    """``python -m kvmesh.bus.auth_callout serve`` on the client host, as the nats-auth sidecar runs it (its
    certificate names client/nats-auth, the callout's ``auth_users``; the issuer seed under ``tmp_path``), dialing
    every server; returned once it answers (its ready file)."""
    ready = tmp_path / "callout.ready"
    urls = ",".join(f"nats://{lab[s].address}:{CLIENT_PORT}" for s in SERVERS)
    env = {**os.environ, **ca.issue(Identity(MeshRole.CLIENT, "nats-auth")).env(), "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "libs"), str(ROOT)])}
    with open(tmp_path / "callout.log", "ab") as out:
        proc = lab.popen("client", [sys.executable, "-m", "kvmesh.bus.auth_callout", "serve", "--nats", urls,
                                    "--issuer-seed", str(tmp_path / "issuer.seed"), "--cluster", "default",
                                    "--ready-file", str(ready)],
                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                         env=env)
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "callout.log").read_text()[-1500:]
        time.sleep(0.2)
    return proc


@pytest.mark.parametrize("one_node", ["tls", "nats-auth-callout"])
def test_kubernetes_nats_cluster_nodes_route_by_identity_and_keep_three_copies(one_node: str, tmp_path: Path) -> None:
    """Three servers, each started as Kubernetes starts a node of components/nats-cluster (``-c`` its
    cluster.conf, ``-m 8222``, ``--server_name`` its pod's name; no route flag), over the one-node nats.conf of
    ``one_node``, form the cluster and JetStream's meta group; a member creates the events stream with 3 copies,
    one on each server (with nats-auth-callout's file, the members as its service authorises them: the
    ``kvmesh.bus.auth_callout`` service runs on the client host with the nats-auth certificate, as the sidecar
    does, and answers the authorization requests of all three servers through the cluster). A server holding the
    mesh CA's certificate of a decode instance, on the same files, is refused."""
    with Lab([*SERVERS, "intruder", "client"]) as lab:
        ca = MeshCA.open(tmp_path / "tls")
        addresses = tuple(lab[h].address for h in [*SERVERS, "intruder"])
        server = ca.issue(SERVER_IDENTITY, addresses)
        decode = ca.issue(Identity(MeshRole.DECODE, "decode"), addresses)
        seed = auth_callout.new_issuer_seed()
        (tmp_path / "issuer.seed").write_bytes(seed + b"\n")
        issuer = auth_callout.public_key(auth_callout.issuer_from_seed(seed))
        procs: list[subprocess.Popen] = []

        def start(host: str, files: CertFiles) -> Path:
            config = kubernetes_node(lab, host, tmp_path, files, COMPONENTS / one_node / "nats.conf")
            log = tmp_path / f"{host}.log"
            with open(log, "ab") as out:
                procs.append(lab.popen(host, [
                    find_nats_server(), "-c", str(config), "-m", str(MONITOR_PORT), "--server_name", host],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                    env={**os.environ, "AUTH_CALLOUT_ISSUER": issuer}))  # nats-auth-callout's nats.conf reads it
            lab.call("client", lambda: wait_port(lab[host].address, MONITOR_PORT, time.monotonic() + 30))
            return log

        try:
            for host in SERVERS:
                start(host, server)
            wait_for_the_cluster(lab)
            wait_for_jetstream(lab)
            if one_node == "nats-auth-callout":
                procs.append(callout_service(lab, ca, tmp_path))
            three_copies(lab, ca, "prefill" if one_node == "tls" else "prefill-7d9f-abcde")
            refused_by_identity(lab, tmp_path, start("intruder", decode))
        finally:
            for proc in procs:
                terminate(proc)
