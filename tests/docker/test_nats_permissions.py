"""docker/nats.conf against a real nats-server (no Docker needed): each service's user, with its password in
the URL, can do exactly what that service does on the bus, and a user cannot publish what is not its own."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import subprocess
import time
import uuid
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvmesh.bus import Bus, Subjects, find_nats_server
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

CONF = Path(__file__).resolve().parents[2] / "docker" / "nats.conf"
PASSWORDS = {"router": "r-" + uuid.uuid4().hex, "worker": "w-" + uuid.uuid4().hex,
             "cachesvc": "c-" + uuid.uuid4().hex}


def run(coro: Coroutine[Any, Any, Any], timeout_s: float = 30.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """nats-server with docker/nats.conf, as the compose stack runs it (on 127.0.0.1, a temporary store)."""
    try:
        binary = find_nats_server()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    store = tmp_path_factory.mktemp("nats-conf")
    conf = CONF.read_text()
    assert 'store_dir: "/data/jetstream"' in conf
    (store / "nats.conf").write_text(conf.replace("/data/jetstream", str(store / "jetstream")))
    env = {**os.environ, **{f"NATS_{user.upper()}_PASSWORD": pw for user, pw in PASSWORDS.items()}}
    log = open(store / "nats.log", "wb")  # noqa: SIM115 - the server writes to it for the whole module
    proc = subprocess.Popen([str(binary), "-c", str(store / "nats.conf"), "-a", "127.0.0.1", "-p", "-1",
                             "--ports_file_dir", str(store)],  # any free port, read back: no port picked first
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    port = read_ports_file(store, proc)
    deadline = time.monotonic() + 10
    while not (store / "nats.log").read_text(errors="replace").count("Server is ready"):
        assert proc.poll() is None and time.monotonic() < deadline, (store / "nats.log").read_text()
        time.sleep(0.05)
    yield port
    proc.terminate()
    proc.wait(10)
    log.close()


def url(user: str, port: int, password: str | None = None) -> str:
    return f"nats://{user}:{password or PASSWORDS[user]}@127.0.0.1:{port}"


def beat(instance: str) -> Heartbeat:
    return Heartbeat(instance_id=instance, role="decode", grpc_address="127.0.0.1:1", transfer_address="",
                     ts=time.time(), load=InstanceLoad(), model="m", block_size=16)


def test_each_service_user_can_do_what_its_service_does(port):
    subjects = Subjects(f"t{uuid.uuid4().hex[:8]}")

    async def body() -> None:
        router = await Bus.connect(url("router", port), "router")
        cachesvc = await Bus.connect(url("cachesvc", port), "cachesvc")
        prefill = await Bus.connect(url("worker", port), "prefill-0")
        decode = await Bus.connect(url("worker", port), "decode-0")
        beats_router: asyncio.Queue = asyncio.Queue()
        beats_cache: asyncio.Queue = asyncio.Queue()
        ready: asyncio.Queue = asyncio.Queue()
        events: asyncio.Queue = asyncio.Queue()
        await router.subscribe(subjects.heartbeats_all, lambda m, h: beats_router.put(m))
        await cachesvc.subscribe(subjects.heartbeats_all, lambda m, h: beats_cache.put(m))
        await decode.subscribe(subjects.kv_ready("decode-0"), lambda m, h: ready.put(m))
        for bus in (prefill, cachesvc):
            await bus.ensure_events_stream(subjects)
        await cachesvc.durable_events_consumer(subjects, "cachesvc", lambda b, h: events.put(b))
        await answer_snapshots(prefill, subjects, "prefill-0", _snapshot)

        replica = await Bus.connect(url("router", port), "router-1")
        loads: asyncio.Queue = asyncio.Queue()
        await replica.subscribe(subjects.router_load_all, lambda m, h: loads.put(m))
        await router.publish(subjects.router_load("router-0"), RouterLoad("router-0", 1.0, {"decode-0": 2}, {}))
        assert (await asyncio.wait_for(loads.get(), 5)).inflight == {"decode-0": 2}
        heard: asyncio.Queue = asyncio.Queue()  # replicas share placements and hear each other's signals
        await replica.subscribe(subjects.router_sessions, lambda m, h: heard.put(m))
        await replica.subscribe(subjects.sessions, lambda m, h: heard.put(m))
        await router.publish(subjects.router_sessions, SessionSignal("t/s0", SessionEvent.ROUTED, 1.0, "both-0"))
        await router.publish(subjects.sessions, SessionSignal("t/s0", SessionEvent.PAUSE, 2.0, "both-0", 3.0))
        got = [await asyncio.wait_for(heard.get(), 5) for _ in range(2)]
        assert sorted(m.event for m in got) == [SessionEvent.PAUSE, SessionEvent.ROUTED]
        await replica.close()
        await decode.publish(subjects.heartbeat("decode", "decode-0"), beat("decode-0"))
        assert (await asyncio.wait_for(beats_router.get(), 5)).instance_id == "decode-0"
        assert (await asyncio.wait_for(beats_cache.get(), 5)).instance_id == "decode-0"
        msg = KVReady(request_id="r1", decode_instance="decode-0", transfer_id="t1", block_keys=(),
                      num_tokens=3, first_token=1, layout=None, prefill_instance="prefill-0")
        await prefill.publish(subjects.kv_ready("decode-0"), msg)
        assert (await asyncio.wait_for(ready.get(), 5)).request_id == "r1"
        failed = dataclasses.replace(msg, request_id="r2", ok=False)  # the router: prefill failed, compute it
        await router.publish(subjects.kv_ready("decode-0"), failed)
        assert (await asyncio.wait_for(ready.get(), 5)).request_id == "r2"
        batch = KVEventBatch(instance_id="prefill-0", seq=1, ts=1.0, events=(AllBlocksCleared(),))
        assert await prefill.publish_event(subjects.kv_events("prefill-0"), batch) >= 1
        assert (await asyncio.wait_for(events.get(), 10)).seq == 1
        snap = await request_snapshot(cachesvc, subjects, "prefill-0", timeout_s=5)
        assert snap is not None and snap.seq == 7 and snap.blocks == {"device": [11, 12]}
        await cachesvc.js.consumer_info(subjects.events_stream, "cachesvc")
        signals: asyncio.Queue = asyncio.Queue()
        copies: asyncio.Queue = asyncio.Queue()
        for bus in (cachesvc, decode):
            await bus.subscribe(subjects.sessions, lambda m, h: signals.put(m))
        await decode.subscribe(subjects.kv_copies("decode-0"), lambda m, h: copies.put(m))
        await router.publish(subjects.sessions, SessionSignal("t/s1", SessionEvent.END, 1.0))
        for _ in range(2):
            assert (await asyncio.wait_for(signals.get(), 5)).session == "t/s1"
        await cachesvc.publish(subjects.kv_copies("decode-0"), KVCopies("decode-0", shared=(11,)))
        assert (await asyncio.wait_for(copies.get(), 5)).shared == (11,)
        for bus in (router, cachesvc, prefill, decode):
            await bus.close()

    run(body())


async def _snapshot() -> tuple[int, list[tuple[int, str]]]:
    return 7, [(11, "device"), (12, "device")]


def test_a_user_cannot_publish_what_is_not_its_own(port, caplog):
    subjects = Subjects(f"t{uuid.uuid4().hex[:8]}")

    async def body() -> None:
        router = await Bus.connect(url("router", port), "router")
        decode = await Bus.connect(url("worker", port), "decode-0")
        beats: asyncio.Queue = asyncio.Queue()
        await router.subscribe(subjects.heartbeats_all, lambda m, h: beats.put(m))  # its own would echo back
        # the router publishes its load, session signals and failed prefills' kv.ready, never a heartbeat
        await router.publish(subjects.heartbeat("decode", "decode-0"), beat("x"))
        await router.nc.flush()
        await asyncio.sleep(0.5)
        assert beats.empty()
        for bus in (router, decode):
            await bus.close()

    with caplog.at_level(logging.WARNING, logger="kvmesh.bus.bus"):
        run(body())
    assert "permissions violation for publish" in caplog.text.lower()


def test_a_wrong_password_is_refused_without_echoing_it(port, caplog):
    async def body() -> None:
        with pytest.raises(ConnectionError) as err:
            await Bus.connect(url("worker", port, "not-the-password"), "w", connect_timeout_s=2.0)
        assert "not-the-password" not in str(err.value)

    with caplog.at_level(logging.INFO, logger="kvmesh.bus.bus"):
        run(body())
    assert "not-the-password" not in caplog.text
    assert "authorization violation" in caplog.text.lower()
