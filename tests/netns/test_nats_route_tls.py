"""A NATS cluster's routes under the mesh's mutual TLS (``kvmesh.bus.permissions --route-tls``, as
``deploy/k8s/components/tls/nats.conf`` has them): three servers, each on a host of its own (network namespaces:
route ports are known in advance only where the lab alone has the addresses), form the cluster over TLS routes; a
server whose certificate another CA signed and one without TLS try to route into it and are refused, and the
cluster stays three. With routes by identity (``--route-identity``), a server holding a certificate the mesh CA
gave another identity (a decode instance's) is refused too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from kvmesh.bus import Subjects, find_nats_server, permissions
from kvmesh.identity import Identity, MeshRole
from kvmesh.mesh_ca import CertFiles, MeshCA
from kvmesh.ready import terminate

from app.netlab.hosts import Lab
from app.netlab.mesh import wait_port

pytestmark = [pytest.mark.netns, pytest.mark.slow]
SERVERS = ["nats-a", "nats-b", "nats-c"]
CLIENT_PORT, ROUTE_PORT, MONITOR_PORT = 4222, 6222, 8222
SERVER_IDENTITY = Identity(MeshRole.CLIENT, "nats")


def routed_to(lab: Lab, name: str) -> set[str]:
    """The servers ``name`` has a route with (``/routez``'s remote names), asked from the client host."""
    url = f"http://{lab[name].address}:{MONITOR_PORT}/routez"
    body = lab.call("client", lambda: urllib.request.urlopen(url, timeout=5).read())
    return {r.get("remote_name", "") for r in json.loads(body).get("routes") or []}


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
            intruder = start("intruder", decode)
            deadline = time.monotonic() + 60
            while not any(f"{lab['intruder'].address}:" in line and "authentication error" in line
                          for h in SERVERS for line in (tmp_path / f"{h}.log").read_text().splitlines()):
                assert time.monotonic() < deadline, intruder.read_text()[-1500:]
                time.sleep(0.5)
            for host in SERVERS:
                assert routed_to(lab, host) == set(SERVERS) - {host}, host
            assert routed_to(lab, "intruder") == set()
        finally:
            for proc in procs:
                terminate(proc)
