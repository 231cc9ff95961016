"""The nats-server configuration ``kvmesh up`` writes (``kvmesh.bus.permissions``) against a real nats-server:
each service's certificate maps to its own user, which can do what that service does on the bus and no more.

Every test that takes the ``mesh`` fixture runs twice: with each identity listed as a user (``listed``: ``kvmesh
up``, compose) and with none listed but the auth callout service's, a real ``python -m kvmesh.bus.auth_callout
serve`` process that gives each certificate its own instance's permissions (``callout``: Kubernetes pools)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvmesh import tls
from kvmesh.bus import Bus, NatsServer, Subjects, permissions
from kvmesh.bus.bus import from_its_sender
from kvmesh.bus.snapshot import answer_snapshots, request_snapshot
from kvmesh.contracts.events import AllBlocksCleared
from kvmesh.contracts.messages import (
    CacheShardBeat,
    Heartbeat,
    InstanceLoad,
    KVCopies,
    KVEventBatch,
    KVReady,
    RouterLoad,
)
from kvmesh.identity import Identity, MeshRole
from kvmesh.mesh_ca import MeshCA
from kvmesh.ready import terminate
from kvmesh.settings import SharedSettings

from tests.docker.test_nats_permissions import _snapshot, run

SUBJECTS = Subjects("perm")
IDENTITIES = [Identity(MeshRole.ROUTER, "router-0"), Identity(MeshRole.CACHESVC, "cachesvc"),
              Identity(MeshRole.PREFILL, "prefill-0"), Identity(MeshRole.DECODE, "decode-0"),
              Identity(MeshRole.DECODE, "decode-1"), Identity(MeshRole.ADMIN, "operator")]


@pytest.fixture(scope="module", params=["listed", "callout"])
def mesh(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MeshCA, NatsServer]]:
    d = tmp_path_factory.mktemp(f"nats-perm-{request.param}")
    ca = MeshCA.open(d / "tls")
    server = ca.issue(Identity(MeshRole.CLIENT, "nats"))
    if request.param == "listed":
        config = permissions.write_config(d / "nats.conf", IDENTITIES, SUBJECTS, str(server.cert),
                                          str(server.key), str(server.ca))
        with NatsServer(d / "nats", config=config) as nats:
            yield ca, nats
        return
    with callout_mesh(d, ca) as nats:
        yield ca, nats


@contextlib.contextmanager
def callout_mesh(d: Path, ca: MeshCA) -> Iterator[NatsServer]:
    """A nats-server that lists no identity but the auth callout service's, and that service as a process of its
    own, as ``deploy/k8s/components/nats-auth-callout`` runs them; yields once a member's connection is
    authorised (the service is subscribed)."""
    server = ca.issue(Identity(MeshRole.CLIENT, "nats"))
    seed = d / "issuer.nk"
    keygen = subprocess.run([sys.executable, "-m", "kvmesh.bus.auth_callout", "keygen", str(seed)],
                            capture_output=True, text=True, check=True, env=child_env({}))
    # the issuer by reference, as components/nats-auth-callout's nats.conf has it
    config = permissions.write_config(d / "nats.conf", [], SUBJECTS, str(server.cert), str(server.key),
                                      str(server.ca), auth_callout="$AUTH_CALLOUT_ISSUER")
    with NatsServer(d / "nats", config=config, env={"AUTH_CALLOUT_ISSUER": keygen.stdout.strip()}) as nats, \
            open(d / "callout.log", "wb") as out:
        ready = d / "callout.ready"
        proc = subprocess.Popen([sys.executable, "-m", "kvmesh.bus.auth_callout", "serve", "--nats", nats.url,
                                 "--issuer-seed", str(seed), "--cluster", SUBJECTS.cluster, "--ready-file",
                                 str(ready)],
                                env=child_env(ca.issue(permissions.CALLOUT_IDENTITY).env()), stdout=out,
                                stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():  # written once it has subscribed
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the auth callout service did not start: "
                                       f"{(d / 'callout.log').read_text()[-2000:]}")
                time.sleep(0.05)
            run(connect_and_close((ca, nats), MeshRole.PREFILL, "probe"))
            yield nats
        finally:
            terminate(proc)
        assert not ready.exists(), "the ready file outlived the service"


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root / "libs"), str(root), env.get("PYTHONPATH", "")])
    return {**env, **extra}


async def connect_and_close(mesh: tuple[MeshCA, NatsServer], role: MeshRole, instance: str) -> None:
    bus = await connect(mesh, role, instance, timeout_s=1.0)
    await bus.close()


async def connect(mesh: tuple[MeshCA, NatsServer], role: MeshRole, instance: str, timeout_s: float = 3.0) -> Bus:
    ca, nats = mesh
    files = ca.issue(Identity(role, instance))
    cfg = SharedSettings(**{k.removeprefix("KVMESH_").lower(): v for k, v in files.env().items()})
    return await Bus.connect(nats.url, instance, tls=tls.bus_tls(cfg), connect_timeout_s=timeout_s)


def beat(role: str, instance: str) -> Heartbeat:
    return Heartbeat(instance_id=instance, role=role, grpc_address="127.0.0.1:1", transfer_address="",
                     ts=time.time(), load=InstanceLoad(), model="m", block_size=16)


def test_each_identity_can_do_what_its_service_does(mesh, caplog):
    async def body() -> None:
        router = await connect(mesh, MeshRole.ROUTER, "router-0")
        cachesvc = await connect(mesh, MeshRole.CACHESVC, "cachesvc")
        prefill = await connect(mesh, MeshRole.PREFILL, "prefill-0")
        decode = await connect(mesh, MeshRole.DECODE, "decode-0")
        beats: asyncio.Queue = asyncio.Queue()
        ready: asyncio.Queue = asyncio.Queue()
        events: asyncio.Queue = asyncio.Queue()
        copies: asyncio.Queue = asyncio.Queue()
        loads: asyncio.Queue = asyncio.Queue()
        await router.subscribe(SUBJECTS.heartbeats_all, lambda m, h: beats.put(m))
        await router.subscribe(SUBJECTS.router_load_all, lambda m, h: loads.put(m))
        await decode.subscribe(SUBJECTS.kv_ready("decode-0"), lambda m, h: ready.put(m))
        await decode.subscribe(SUBJECTS.kv_copies("decode-0"), lambda m, h: copies.put(m))
        await cachesvc.ensure_events_stream(SUBJECTS)
        await prefill.ensure_events_stream(SUBJECTS)  # finds it as it is: no update needed, none allowed
        # an engine whose settings differ (another replica count, other limits) uses the stream as cachesvc made it
        await prefill.ensure_events_stream(SUBJECTS, max_bytes=1 << 20, update=False)
        assert (await cachesvc.js.stream_info(SUBJECTS.events_stream)).config.max_bytes == 1 << 30
        await cachesvc.durable_events_consumer(SUBJECTS, "cachesvc", lambda b, h: events.put(b))
        await answer_snapshots(prefill, SUBJECTS, "prefill-0", _snapshot)

        await decode.publish(SUBJECTS.heartbeat("decode", "decode-0"), beat("decode", "decode-0"))
        assert (await asyncio.wait_for(beats.get(), 5)).instance_id == "decode-0"
        load = RouterLoad("router-vm-4242", 1.0, {"decode-0": 1}, {})  # a router id is host and pid by default
        await router.publish(SUBJECTS.router_load(load.router_id), load)
        assert (await asyncio.wait_for(loads.get(), 5)).inflight == {"decode-0": 1}
        msg = KVReady(request_id="r1", decode_instance="decode-0", transfer_id="t1", block_keys=(), num_tokens=3,
                      first_token=1, layout=None, prefill_instance="prefill-0")
        await prefill.publish(SUBJECTS.kv_ready("decode-0"), msg)
        assert (await asyncio.wait_for(ready.get(), 5)).request_id == "r1"
        batch = KVEventBatch(instance_id="prefill-0", seq=1, ts=1.0, events=(AllBlocksCleared(),))
        assert await prefill.publish_event(SUBJECTS.kv_events("prefill-0"), batch) >= 1
        assert (await asyncio.wait_for(events.get(), 10)).seq == 1
        snap = await request_snapshot(cachesvc, SUBJECTS, "prefill-0", timeout_s=5)
        assert snap is not None and snap.seq == 7 and snap.blocks == {"device": [11, 12]}
        await cachesvc.publish(SUBJECTS.kv_copies("decode-0"), KVCopies("decode-0", shared=(11,)))
        assert (await asyncio.wait_for(copies.get(), 5)).shared == (11,)
        for bus in (router, cachesvc, prefill, decode):
            await bus.close()

    with caplog.at_level(logging.WARNING, logger="kvmesh.bus.bus"):
        run(body())
    assert "permissions violation" not in caplog.text.lower()


def test_an_engine_can_neither_beat_as_another_nor_read_anothers_kv_ready(mesh, caplog):
    async def body() -> None:
        router = await connect(mesh, MeshRole.ROUTER, "router-0")
        decode = await connect(mesh, MeshRole.DECODE, "decode-0")
        beats: asyncio.Queue = asyncio.Queue()
        await router.subscribe(SUBJECTS.heartbeats_all, lambda m, h: beats.put(m))
        await decode.publish(SUBJECTS.heartbeat("decode", "decode-1"), beat("decode", "decode-1"))
        await decode.publish(SUBJECTS.heartbeat("prefill", "prefill-0"), beat("prefill", "prefill-0"))
        await decode.subscribe(SUBJECTS.kv_ready("decode-1"), lambda m, h: beats.put(m))
        await router.publish(SUBJECTS.kv_ready("decode-1"), beat("decode", "decode-1"))  # would reach the spy
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(beats.get(), 0.5)
        await router.close()
        await decode.close()

    with caplog.at_level(logging.WARNING, logger="kvmesh.bus.bus"):
        run(body())
    text = caplog.text.lower()
    assert text.count("permissions violation for publish") == 2
    assert "permissions violation for subscription" in text


def test_only_cachesvc_beats_as_a_shard_and_routers_and_engines_hear_it(mesh, caplog):
    async def body() -> None:
        cachesvc = await connect(mesh, MeshRole.CACHESVC, "cachesvc")
        router = await connect(mesh, MeshRole.ROUTER, "router-0")
        decode = await connect(mesh, MeshRole.DECODE, "decode-0")
        heard: asyncio.Queue = asyncio.Queue()
        for name, bus in (("router", router), ("decode", decode)):
            await bus.subscribe(SUBJECTS.cachesvc_shards_all, lambda m, h, n=name: heard.put((n, m)))
        # a shard beats every second: beat until both have heard one (a message is not retried by NATS)
        got: dict[str, CacheShardBeat] = {}
        deadline = time.monotonic() + 20
        while len(got) < 2:
            assert time.monotonic() < deadline, f"heard by {sorted(got)} only"
            await cachesvc.publish(SUBJECTS.cachesvc_shard(1), CacheShardBeat(1, 2, "10.0.0.1:50060", time.time()))
            with contextlib.suppress(TimeoutError):
                while True:
                    who, beat_ = await asyncio.wait_for(heard.get(), 0.5)
                    got[who] = beat_
        assert {(b.shard, b.address) for b in got.values()} == {(1, "10.0.0.1:50060")}
        await decode.publish(SUBJECTS.cachesvc_shard(0), CacheShardBeat(0, 2, "10.6.6.6:1", time.time()))
        with pytest.raises(TimeoutError):  # nothing but the late copies of shard 1's beats
            while True:
                _, beat_ = await asyncio.wait_for(heard.get(), 0.5)
                assert beat_.shard == 1, beat_
        for bus in (cachesvc, router, decode):
            await bus.close()

    with caplog.at_level(logging.WARNING, logger="kvmesh.bus.bus"):
        run(body())
    assert caplog.text.lower().count("permissions violation for publish") == 1


@pytest.mark.parametrize("who", [None, Identity(MeshRole.DECODE, "decode-7"), Identity(MeshRole.CLIENT, "hc")],
                         ids=["no-certificate", "no-user", "nothing-to-do"])
def test_a_connection_without_a_known_identity_is_refused(mesh, who, request):
    """No certificate; a certificate no user is listed for (the callout gives any mesh identity its own user:
    it must connect there); a role with nothing to do on the bus (a health check's)."""
    callout = request.node.callspec.params["mesh"] == "callout"

    async def body() -> None:
        if who is None:
            await Bus.connect(mesh[1].url, "anonymous", connect_timeout_s=2.0)
        else:
            await connect_and_close(mesh, who.role, who.instance)

    if callout and who == Identity(MeshRole.DECODE, "decode-7"):
        run(body())
        return
    with pytest.raises(ConnectionError):
        run(body())


def test_the_callout_gives_an_instance_no_listed_user_its_own_subjects_only(tmp_path, caplog):
    """Two decode instances that no configuration names (pods of a Deployment): each may beat and read kv.ready
    as itself and as no one else; a certificate of another CA is refused at the handshake."""
    ca = MeshCA.open(tmp_path / "tls")
    with callout_mesh(tmp_path, ca) as nats:
        async def body() -> None:
            router = await connect((ca, nats), MeshRole.ROUTER, "router-a")
            one = await connect((ca, nats), MeshRole.DECODE, "decode-5f7c9-x2k4q")
            beats: asyncio.Queue = asyncio.Queue()
            await router.subscribe(SUBJECTS.heartbeats_all, lambda m, h: beats.put(m))
            await one.publish(SUBJECTS.heartbeat("decode", "decode-5f7c9-x2k4q"), beat("decode", "decode-5f7c9-x2k4q"))
            assert (await asyncio.wait_for(beats.get(), 5)).instance_id == "decode-5f7c9-x2k4q"
            await one.publish(SUBJECTS.heartbeat("decode", "decode-5f7c9-zz9"), beat("decode", "decode-5f7c9-zz9"))
            await one.subscribe(SUBJECTS.kv_ready("decode-5f7c9-zz9"), lambda m, h: beats.put(m))
            await router.publish(SUBJECTS.kv_ready("decode-5f7c9-zz9"), beat("decode", "x"))
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(beats.get(), 0.5)
            for bus in (router, one):
                await bus.close()
            other = MeshCA.open(tmp_path / "other-ca").issue(Identity(MeshRole.DECODE, "decode-5f7c9-zz9"))
            env = {k.removeprefix("KVMESH_").lower(): v for k, v in other.env().items()}
            cfg = SharedSettings(**{**env, "tls_ca": str(ca.ca_path)})  # it trusts the server, not vice versa
            with pytest.raises(ConnectionError):
                await Bus.connect(nats.url, "forger", tls=tls.bus_tls(cfg), connect_timeout_s=2.0)

        with caplog.at_level(logging.WARNING, logger="kvmesh.bus.bus"):
            run(body())
    text = caplog.text.lower()
    assert text.count("permissions violation for publish") == 1
    assert "permissions violation for subscription" in text


@pytest.mark.parametrize(("subject", "msg", "ok"), [
    ("kvmesh.c.heartbeat.decode.decode-0", beat("decode", "decode-0"), True),
    ("kvmesh.c.heartbeat.decode.decode-0", beat("decode", "decode-1"), False),
    ("kvmesh.c.heartbeat.decode.decode-0", beat("prefill", "decode-0"), False),
    ("kvmesh.c.kv.events.p0", KVEventBatch(instance_id="p1", seq=1, ts=1.0, events=()), False),
    ("kvmesh.c.router.load.r0", RouterLoad("r1", 1.0, {}, {}), False),
    ("kvmesh.c.router.load.r0", beat("decode", "r0"), False),
    ("kvmesh.c.kv.ready.decode-0", beat("decode", "x"), True),  # names no sender: the handler decides
])
def test_a_message_must_come_from_the_sender_its_subject_names(subject, msg, ok):
    assert from_its_sender(subject, msg) is ok


def test_a_role_certificate_held_by_every_replica_speaks_for_any_instance_of_its_role_only():
    perms = permissions.permissions(Identity(MeshRole.DECODE, "decode"), SUBJECTS, any_instance=True)
    assert {"kvmesh.perm.heartbeat.decode.*", "kvmesh.perm.kv.events.*"} <= set(perms.publish)
    assert {"kvmesh.perm.kv.ready.*", "_INBOX.decode.decode.>"} <= set(perms.subscribe)
    assert not [s for s in perms.publish if "prefill" in s or "ready" in s]


def test_the_permissions_of_one_instance_name_no_other_instance():
    for who in IDENTITIES:
        perms = permissions.permissions(who, SUBJECTS)
        for other in IDENTITIES:
            if other.instance != who.instance:
                assert not [s for s in perms.publish + perms.subscribe if other.instance in s.split(".")], (who, other)



def test_a_member_configured_for_tls_sends_nothing_to_a_server_that_does_not_ask_for_it(mesh, nats_server):
    """A plain-text server on the mesh's address (a misconfiguration or an impostor): the member's CONNECT, and
    any message, would go in clear; it is refused before anything is sent, saying why."""
    ca, _ = mesh
    files = ca.issue(Identity(MeshRole.DECODE, "decode-0"))
    cfg = SharedSettings(**{k.removeprefix("KVMESH_").lower(): v for k, v in files.env().items()})
    with pytest.raises(ConnectionError, match="did not ask for TLS"):
        run(Bus.connect(nats_server.url, "decode-0", tls=tls.bus_tls(cfg), connect_timeout_s=2.0))


def test_nothing_reaches_a_listener_that_answers_with_a_plain_text_info(mesh):
    """What the refusal leaves unsent: a listener that speaks NATS's INFO without ``tls_required`` and records
    every byte the member sends after it."""
    import json
    import socket
    import threading

    ca, _ = mesh
    files = ca.issue(Identity(MeshRole.DECODE, "decode-0"))
    cfg = SharedSettings(**{k.removeprefix("KVMESH_").lower(): v for k, v in files.env().items()})
    listener = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def serve() -> None:
        listener.settimeout(5)
        try:
            while True:
                conn, _ = listener.accept()
                with conn:
                    info = {"server_id": "x", "version": "2.10.0", "max_payload": 1048576, "auth_required": True}
                    conn.sendall(b"INFO " + json.dumps(info).encode() + b"\r\n")
                    conn.settimeout(0.5)
                    try:
                        while chunk := conn.recv(4096):
                            received.append(chunk)
                    except OSError:
                        pass
        except OSError:
            return

    threading.Thread(target=serve, daemon=True).start()
    url = f"nats://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with pytest.raises(ConnectionError, match="did not ask for TLS"):
            run(Bus.connect(url, "decode-0", tls=tls.bus_tls(cfg), connect_timeout_s=2.0))
    finally:
        listener.close()
    assert received == []


def test_tls_is_required_of_a_certificate_members_server_not_of_a_password_one():
    from kvmesh.bus.bus import tls_required

    assert tls_required("nats://127.0.0.1:4222") and tls_required(["nats://a:4222", "nats://b:4222"])
    assert tls_required("tls://worker:pw@nats:4222")
    assert not tls_required("nats://worker:pw@nats:4222")  # compose / Kubernetes: password users
