"""NATS by role and instance: each service of the default stack holds a NATS user of its own, mapped from its mesh
certificate, that may publish and subscribe only its own subjects. A forged heartbeat (the attack: copy an
instance's real beat, which is public, and point its ``grpc_address`` at yourself) is refused by NATS or dropped
by its receivers, and requests keep reaching the real instance."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import urllib.request

import pytest
from kvmesh.bus import Subjects
from kvmesh.contracts.messages import Heartbeat, KVReady, Message
from kvmesh.identity import MeshRole

from tests.security.conftest import auth, bus
from tests.security.test_kv_ready import metric

FORGER = "127.0.0.1:1"  # where a forged heartbeat sends prefill-0's requests: nothing listens there


def subjects(stack) -> Subjects:
    return Subjects(stack.cfg.shared.cluster)


async def real_beat(stack, instance: str) -> Heartbeat:
    """The instance's own heartbeat, as anyone allowed to read heartbeats sees it (an operator's tool here)."""
    admin = await bus(stack, MeshRole.ADMIN, "operator")
    beats: asyncio.Queue[Message] = asyncio.Queue()
    try:
        await admin.subscribe(subjects(stack).heartbeats_all, lambda m, h: beats.put(m))
        while True:
            beat = await asyncio.wait_for(beats.get(), 10)
            if isinstance(beat, Heartbeat) and beat.instance_id == instance:
                return beat
    finally:
        await admin.close()


def instances(stack) -> int:
    with urllib.request.urlopen(f"{stack.router_http}/health", timeout=10) as r:
        return int(json.load(r)["instances"])


def disaggregated(stack, request_id: str) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": "a prompt to hand from prefill to decode " * 4}],
                       "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"{stack.router_http}/v1/chat/completions", data=body, headers={
        "content-type": "application/json", "x-request-id": request_id, "x-kvmesh-disaggregate": "always",
        **auth()})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


async def forge_while(stack, role: MeshRole, instance: str, subject: str, beat: Heartbeat, done: asyncio.Event,
                      every_s: float = 0.02) -> None:
    """Publish ``beat`` on ``subject`` with ``role/instance``'s credentials until ``done``, far more often than
    the real instance beats."""
    forger = await bus(stack, role, instance)
    try:
        while not done.is_set():
            await forger.publish(subject, dataclasses.replace(beat, ts=beat.ts + 1e6))
            await asyncio.sleep(every_s)
        await forger.nc.flush()
    finally:
        await forger.close()


def serve_while_forging(stack, role: MeshRole, instance: str, subject: str, beat: Heartbeat,
                        request_id: str) -> dict:
    async def run() -> dict:
        done = asyncio.Event()
        forging = asyncio.create_task(forge_while(stack, role, instance, subject, beat, done))
        await asyncio.sleep(1.5)  # the router and cachesvc would have taken the forged beats by now
        try:
            return await asyncio.to_thread(disaggregated, stack, request_id)
        finally:
            done.set()
            await forging

    return asyncio.run(run())


def test_a_heartbeat_for_another_instance_is_refused_by_nats_and_requests_reach_the_real_one(stack, caplog):
    real = asyncio.run(real_beat(stack, "prefill-0"))
    forged = dataclasses.replace(real, grpc_address=FORGER, transfer_address=FORGER)
    fallbacks = metric(stack.router_metrics, "kvmesh_router_kv_fallbacks_total")
    with caplog.at_level(logging.WARNING, logger="kvmesh.bus.bus"):
        reply = serve_while_forging(stack, MeshRole.DECODE, "decode-0",
                                    subjects(stack).heartbeat("prefill", "prefill-0"), forged, "sec-forged-beat-nats")
    assert reply["usage"]["completion_tokens"] >= 1
    assert metric(stack.router_metrics, "kvmesh_router_kv_fallbacks_total") == fallbacks  # handed off
    assert "permissions violation for publish" in caplog.text.lower()


def test_a_heartbeat_naming_another_instance_on_the_senders_own_subject_is_dropped(stack):
    """Even a publisher NATS lets through (its own subject) cannot speak for another instance: the receivers
    match the beat's instance to the subject it came on."""
    real = asyncio.run(real_beat(stack, "prefill-0"))
    forged = dataclasses.replace(real, grpc_address=FORGER, transfer_address=FORGER)
    fallbacks = metric(stack.router_metrics, "kvmesh_router_kv_fallbacks_total")
    reply = serve_while_forging(stack, MeshRole.PREFILL, "prefill-0",
                                subjects(stack).heartbeat("prefill", "prefill-0"),
                                dataclasses.replace(forged, instance_id="prefill-1"), "sec-forged-beat-own-subject")
    assert reply["usage"]["completion_tokens"] >= 1
    assert metric(stack.router_metrics, "kvmesh_router_kv_fallbacks_total") == fallbacks
    assert instances(stack) == 2  # no prefill-1 appeared
    for log in ("router.log", "cachesvc.log"):
        assert "names another sender" in (stack.log_dir / log).read_text(), log


def test_a_heartbeat_for_a_new_instance_is_refused_to_an_engine(stack, caplog):
    real = asyncio.run(real_beat(stack, "decode-0"))

    async def forge() -> None:
        forger = await bus(stack, MeshRole.DECODE, "decode-0")
        try:
            await forger.publish(subjects(stack).heartbeat("decode", "decode-9"),
                                 dataclasses.replace(real, instance_id="decode-9", grpc_address=FORGER))
            await forger.nc.flush()
            await asyncio.sleep(1.0)
        finally:
            await forger.close()

    with caplog.at_level(logging.WARNING, logger="kvmesh.bus.bus"):
        asyncio.run(forge())
    assert "permissions violation for publish" in caplog.text.lower()
    assert instances(stack) == 2


@pytest.mark.parametrize("role", [None, MeshRole.ROUTER], ids=["no-certificate", "certificate-of-no-nats-user"])
def test_nats_refuses_a_connection_without_a_mesh_identity_it_knows(stack, role):
    async def connect() -> None:
        await bus(stack, role, "attacker", connect_timeout_s=3.0)

    with pytest.raises(ConnectionError):
        asyncio.run(connect())


def test_an_engine_cannot_subscribe_to_another_decodes_kv_ready(stack, caplog):
    """prefill-0 may publish kv.ready to decode-0, never read it: the first token and the transfer of every hand-off
    stay between the two."""
    heard: list[Message] = []

    async def hear(msg: Message, headers: dict[str, str]) -> None:
        heard.append(msg)

    async def eavesdrop() -> dict:
        spy = await bus(stack, MeshRole.PREFILL, "prefill-0")
        try:
            await spy.subscribe(subjects(stack).kv_ready("decode-0"), hear)
            return await asyncio.to_thread(disaggregated, stack, "sec-kv-ready-spy")
        finally:
            await spy.close()

    with caplog.at_level(logging.WARNING, logger="kvmesh.bus.bus"):
        reply = asyncio.run(eavesdrop())
    assert "permissions violation for subscription" in caplog.text.lower()
    assert reply["usage"]["completion_tokens"] >= 1
    assert not [m for m in heard if isinstance(m, KVReady)]



def test_kvmesh_plan_reads_heartbeats_with_the_operators_certificate_of_the_state_dir(stack):
    from kvmesh import tls
    from kvmesh.bus import Bus

    from app.plan import operator_settings

    async def listen() -> set[str]:
        creds = tls.bus_tls(operator_settings(stack.state_dir))
        plan = await Bus.connect(stack.info().nats_url, "kvmesh-plan", tls=creds)
        seen: set[str] = set()

        async def on_beat(beat: Message, headers: dict[str, str]) -> None:
            if isinstance(beat, Heartbeat):
                seen.add(beat.instance_id)

        try:
            await plan.subscribe(subjects(stack).heartbeats_all, on_beat)
            await asyncio.sleep(2.5)
        finally:
            await plan.close()
        return seen

    assert asyncio.run(listen()) == {"decode-0", "prefill-0"}
