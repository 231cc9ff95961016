"""The NATS of the compose stack against a real nats-server (no Docker needed): compose's mesh-certs step run here
as compose.yaml writes it (its certificates, then /certs/nats.conf from docker/nats.conf), nats-server started on
that configuration. Each service's certificate is its NATS user and can do what that service does on the bus; a
role cannot publish another role's subjects; a client without a mesh certificate, or with one that names no
user, is refused at connect."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import logging
import os
import shlex
import subprocess
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kvmesh import mesh_ca, tls
from kvmesh.bus import Bus, Subjects, find_nats_server, permissions
from kvmesh.bus.nats_server import read_ports_file
from kvmesh.bus.snapshot import answer_snapshots, request_snapshot
from kvmesh.contracts.events import AllBlocksCleared
from kvmesh.contracts.messages import (
    Heartbeat,
    InstanceLoad,
    KVCopies,
    KVEventBatch,
    KVReady,
    RouterLoad,
    SessionSignal,
)
from kvmesh.contracts.sessions import SessionEvent
from kvmesh.identity import Identity
from kvmesh.settings import SharedSettings

ROOT = Path(__file__).resolve().parents[2]
SUBJECTS = Subjects("default")  # compose's KVMESH_CLUSTER unless .env sets it


# a message a permission lets through arrives within this, however loaded the machine (one that is refused never
# does: those checks look for the server's permission error instead)
HEARD_S = 20.0


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 120.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def mesh_certs_step(certs: Path, settings: Path) -> None:
    """compose.yaml's mesh-certs command, each ``python -m`` in it run here: /certs is ``certs``, the image's
    /etc/kvmesh/nats.conf is ``settings``."""
    script = " ".join(yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["mesh-certs"]["command"])
    script = script.replace("${KVMESH_CLUSTER:-default}", SUBJECTS.cluster)
    mains = {"kvmesh.mesh_ca": mesh_ca.main, "kvmesh.bus.permissions": permissions.main}
    ran = []
    for part in script.split("&&"):
        argv = [a.replace("/etc/kvmesh/nats.conf", str(settings)).replace("/certs", str(certs))
                for a in shlex.split(part)]
        if argv[:2] == ["python", "-m"]:
            mains[argv[2]](argv[3:])
            ran.append(argv[2])
    assert ran == list(mains), f"the mesh-certs step runs {ran}"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    """The mesh-certs volume and nats-server on its nats.conf, as compose's nats service runs it (on 127.0.0.1,
    any free port, a temporary JetStream store)."""
    try:
        binary = find_nats_server()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    d = tmp_path_factory.mktemp("nats-conf")
    conf = (ROOT / "docker" / "nats.conf").read_text()
    assert 'store_dir: "/data/jetstream"' in conf
    (d / "settings.conf").write_text(conf.replace("/data/jetstream", str(d / "jetstream")))
    mesh_certs_step(d / "certs", d / "settings.conf")
    log = open(d / "nats.log", "wb")  # noqa: SIM115 - the server writes to it for the whole module
    proc = subprocess.Popen([str(binary), "-c", str(d / "certs" / "nats.conf"), "-a", "127.0.0.1", "-p", "-1",
                             "--ports_file_dir", str(d)],  # any free port, read back: no port picked first
                            env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT)
    port = read_ports_file(d, proc)
    deadline = time.monotonic() + 10
    while not (d / "nats.log").read_text(errors="replace").count("Server is ready"):
        assert proc.poll() is None and time.monotonic() < deadline, (d / "nats.log").read_text()
        time.sleep(0.05)
    yield d / "certs", port
    proc.terminate()
    proc.wait(10)
    log.close()


async def connect(certs: tuple[Path, int], holder: str | None, name: str, ca: Path | None = None) -> Bus:
    """A service's connection as compose configures it: ``nats://host:port`` without a password, the service's
    certificate (``<role>-<instance>.pem`` of the volume; None: no certificate, the mesh CA only)."""
    d, port = certs
    files = {"tls_ca": str(ca or d / "ca.pem"), "tls_server_name": mesh_ca.MESH_SERVER_NAME}
    if holder:
        stem = d / holder.replace("/", "-")
        files |= {"tls_cert": f"{stem}.pem", "tls_key": f"{stem}.key"}
    return await Bus.connect(f"nats://127.0.0.1:{port}", name, tls=tls.bus_tls(SharedSettings(**files)),
                             connect_timeout_s=3.0)


def beat(role: str, instance: str) -> Heartbeat:
    return Heartbeat(instance_id=instance, role=role, grpc_address="127.0.0.1:1", transfer_address="",
                     ts=time.time(), load=InstanceLoad(), model="m", block_size=16)


def test_each_service_certificate_can_do_what_its_service_does(certs, caplog):
    subjects = SUBJECTS
    # compose's replicas name themselves <role>-<hostname>-<port>, all holding their role's one certificate
    p0, d0 = "prefill-a1-50061", "decode-b2-50062"

    async def body() -> None:
        router = await connect(certs, "router/router", "router")
        cachesvc = await connect(certs, "cachesvc/cachesvc", "cachesvc")
        prefill = await connect(certs, "prefill/prefill", p0)
        decode = await connect(certs, "decode/decode", d0)
        beats_router: asyncio.Queue = asyncio.Queue()
        beats_cache: asyncio.Queue = asyncio.Queue()
        ready: asyncio.Queue = asyncio.Queue()
        events: asyncio.Queue = asyncio.Queue()
        await router.subscribe(subjects.heartbeats_all, lambda m, h: beats_router.put(m))
        await cachesvc.subscribe(subjects.heartbeats_all, lambda m, h: beats_cache.put(m))
        await decode.subscribe(subjects.kv_ready(d0), lambda m, h: ready.put(m))
        for bus in (cachesvc, prefill):
            await bus.ensure_events_stream(subjects)
        await cachesvc.durable_events_consumer(subjects, "cachesvc", lambda b, h: events.put(b))
        await answer_snapshots(prefill, subjects, p0, _snapshot)

        replica = await connect(certs, "router/router", "router-2")
        loads: asyncio.Queue = asyncio.Queue()
        await replica.subscribe(subjects.router_load_all, lambda m, h: loads.put(m))
        await router.publish(subjects.router_load("router-0"), RouterLoad("router-0", 1.0, {d0: 2}, {}))
        assert (await asyncio.wait_for(loads.get(), HEARD_S)).inflight == {d0: 2}
        heard: asyncio.Queue = asyncio.Queue()  # replicas share placements and hear each other's signals
        await replica.subscribe(subjects.router_sessions, lambda m, h: heard.put(m))
        await replica.subscribe(subjects.sessions, lambda m, h: heard.put(m))
        await router.publish(subjects.router_sessions, SessionSignal("t/s0", SessionEvent.ROUTED, 1.0, "both-0"))
        await router.publish(subjects.sessions, SessionSignal("t/s0", SessionEvent.PAUSE, 2.0, "both-0", 3.0))
        got = [await asyncio.wait_for(heard.get(), HEARD_S) for _ in range(2)]
        assert sorted(m.event for m in got) == [SessionEvent.PAUSE, SessionEvent.ROUTED]
        await replica.close()
        await decode.publish(subjects.heartbeat("decode", d0), beat("decode", d0))
        assert (await asyncio.wait_for(beats_router.get(), HEARD_S)).instance_id == d0
        assert (await asyncio.wait_for(beats_cache.get(), HEARD_S)).instance_id == d0
        msg = KVReady(request_id="r1", decode_instance=d0, transfer_id="t1", block_keys=(),
                      num_tokens=3, first_token=1, layout=None, prefill_instance=p0)
        await prefill.publish(subjects.kv_ready(d0), msg)
        assert (await asyncio.wait_for(ready.get(), HEARD_S)).request_id == "r1"
        failed = dataclasses.replace(msg, request_id="r2", ok=False)  # the router: prefill failed, compute it
        await router.publish(subjects.kv_ready(d0), failed)
        assert (await asyncio.wait_for(ready.get(), HEARD_S)).request_id == "r2"
        batch = KVEventBatch(instance_id=p0, seq=1, ts=1.0, events=(AllBlocksCleared(),))
        assert await prefill.publish_event(subjects.kv_events(p0), batch) >= 1
        assert (await asyncio.wait_for(events.get(), HEARD_S)).seq == 1
        snap = await request_snapshot(cachesvc, subjects, p0, timeout_s=5)
        assert snap is not None and snap.seq == 7 and snap.blocks == {"device": [11, 12]}
        await cachesvc.js.consumer_info(subjects.events_stream, "cachesvc")
        signals: asyncio.Queue = asyncio.Queue()
        copies: asyncio.Queue = asyncio.Queue()
        for bus in (cachesvc, decode):
            await bus.subscribe(subjects.sessions, lambda m, h: signals.put(m))
        await decode.subscribe(subjects.kv_copies(d0), lambda m, h: copies.put(m))
        await router.publish(subjects.sessions, SessionSignal("t/s1", SessionEvent.END, 1.0))
        for _ in range(2):
            assert (await asyncio.wait_for(signals.get(), HEARD_S)).session == "t/s1"
        await cachesvc.publish(subjects.kv_copies(d0), KVCopies(d0, shared=(11,)))
        assert (await asyncio.wait_for(copies.get(), HEARD_S)).shared == (11,)
        operator = await connect(certs, "admin/operator", "kvmesh-plan")  # `kvmesh plan`: heartbeats only
        planned: asyncio.Queue = asyncio.Queue()
        await operator.subscribe(subjects.heartbeats_all, lambda m, h: planned.put(m))
        await prefill.publish(subjects.heartbeat("prefill", p0), beat("prefill", p0))
        assert (await asyncio.wait_for(planned.get(), HEARD_S)).instance_id == p0
        for bus in (router, cachesvc, prefill, decode, operator):
            await bus.close()

    with caplog.at_level(logging.WARNING, logger="kvmesh.bus.bus"):
        run(body())
    assert "permissions violation" not in caplog.text.lower()


async def _snapshot() -> tuple[int, list[tuple[int, str]]]:
    return 7, [(11, "device"), (12, "device")]


def test_a_role_cannot_publish_or_read_another_roles_subjects(certs, caplog):
    """The forged heartbeat of issue 38: a prefill certificate cannot beat as a decode instance (nor the router
    as anyone), and a prefill cannot read the kv.ready meant for a decode."""
    async def body() -> None:
        router = await connect(certs, "router/router", "router")
        prefill = await connect(certs, "prefill/prefill", "prefill-a1-50061")
        decode = await connect(certs, "decode/decode", "decode-b2-50062")
        heard: asyncio.Queue = asyncio.Queue()
        await router.subscribe(SUBJECTS.heartbeats_all, lambda m, h: heard.put(m))
        await prefill.publish(SUBJECTS.heartbeat("decode", "decode-b2-50062"), beat("decode", "decode-b2-50062"))
        await router.publish(SUBJECTS.heartbeat("decode", "decode-b2-50062"), beat("decode", "decode-b2-50062"))
        await decode.publish(SUBJECTS.kv_ready("decode-b2-50062"), beat("decode", "x"))  # decode never sends one
        await prefill.subscribe(SUBJECTS.kv_ready("decode-b2-50062"), lambda m, h: heard.put(m))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(heard.get(), 0.5)
        for bus in (router, prefill, decode):
            await bus.close()

    with caplog.at_level(logging.WARNING, logger="kvmesh.bus.bus"):
        run(body())
    text = caplog.text.lower()
    assert text.count("permissions violation for publish") == 3
    assert "permissions violation for subscription" in text


@pytest.mark.parametrize("holder", [None, "client/nats"], ids=["no certificate", "a certificate of no user"])
def test_a_client_without_a_service_certificate_is_refused(certs, holder):
    """No certificate: the TLS handshake fails (verify). The server's own certificate: signed by the mesh CA, but
    no user is named by it."""
    with pytest.raises(ConnectionError):
        run(connect(certs, holder, "intruder"))


def test_a_certificate_of_another_ca_is_refused(certs, tmp_path):
    other = mesh_ca.MeshCA.open(tmp_path / "other")
    files = other.issue(Identity.parse("spiffe://kvmesh/decode/decode"))
    d, port = certs
    cfg = SharedSettings(tls_ca=str(d / "ca.pem"), tls_cert=str(files.cert), tls_key=str(files.key),
                         tls_server_name=mesh_ca.MESH_SERVER_NAME)
    with pytest.raises(ConnectionError):
        run(Bus.connect(f"nats://127.0.0.1:{port}", "forger", tls=tls.bus_tls(cfg), connect_timeout_s=3.0))


def healthcheck() -> Any:
    spec = importlib.util.spec_from_file_location("kvmesh_healthcheck", ROOT / "docker" / "healthcheck.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_healthcheck_completes_the_handshake_with_the_servers_own_certificate(certs):
    """What compose's nats healthcheck does: INFO (JetStream on, TLS asked for), then a TLS handshake with the
    certificate the nats container has, verified as clients verify the server; without one it says what to give."""
    d, port = certs
    env = {"KVMESH_TLS_CERT": str(d / "client-nats.pem"), "KVMESH_TLS_KEY": str(d / "client-nats.key"),
           "KVMESH_TLS_CA": str(d / "ca.pem"), "KVMESH_TLS_SERVER_NAME": mesh_ca.MESH_SERVER_NAME}
    check = healthcheck().check_nats
    assert check("127.0.0.1", port, env) is None
    assert "asks for TLS" in check("127.0.0.1", port, {})
    assert "nats-server on" in check("127.0.0.1", port, {**env, "KVMESH_TLS_SERVER_NAME": "not-the-mesh"})
