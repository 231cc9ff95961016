"""A forged ``kv.ready`` (any prefill may publish one: it names a request and a first token; NATS lets prefills
publish to every decode) is never taken by decode, and the request's real hand-off still completes: its KV is
imported, nothing recomputed. A forger knows the client's request id at best; decode knows the request by the
router's dispatch id (tenant hash, client id, nonce), so a forgery naming the client's id meets no request at all;
one naming the right id without the MAC under the push capability is dropped and counted (the receiver's
``forged``: tests/unit/test_transfer_receiver.py; the MAC: tests/unit/test_kv_ready_mac.py)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

from kvmesh.bus import Subjects
from kvmesh.contracts.ids import InstanceId, RequestId, TransferId
from kvmesh.contracts.messages import KVReady
from kvmesh.identity import MeshRole

from tests.security.conftest import auth
from tests.security.conftest import bus as connect

REQUEST_ID = "sec-forged-kv-ready"


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith(name))


async def forge(stack) -> None:
    bus = await connect(stack, MeshRole.PREFILL, "prefill-0")  # a prefill gone bad
    try:
        subject = Subjects(stack.cfg.shared.cluster).kv_ready("decode-0")
        common: dict = {"request_id": RequestId(REQUEST_ID), "decode_instance": InstanceId("decode-0"),
                        "transfer_id": TransferId(f"{REQUEST_ID}@prefill-0"), "block_keys": (), "num_tokens": 1,
                        "first_token": 7, "layout": None, "prefill_instance": InstanceId("prefill-0")}
        await bus.publish(subject, KVReady(**common, ok=False, error="forged: recompute"))  # no MAC
        await bus.publish(subject, KVReady(**common, mac="00" * 32))  # a MAC under a token it does not have
        await bus.publish(subject, KVReady(**common).signed("a guessed token"))
    finally:
        await bus.close()


def test_a_forged_kv_ready_is_dropped_and_the_hand_off_still_completes(stack):
    decode_metrics = stack.service("decode-0").endpoints["metrics"] + "/metrics"
    router_metrics = stack.router_metrics
    fallbacks = metric(router_metrics, "kvmesh_router_kv_fallbacks_total")
    asyncio.run(forge(stack))  # before the request: they wait for its Decode call on decode's board
    body = json.dumps({"messages": [{"role": "user", "content": "a prompt long enough to push " * 4}],
                       "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"{stack.router_http}/v1/chat/completions", data=body, headers={
        "content-type": "application/json", "x-request-id": REQUEST_ID, "x-kvmesh-disaggregate": "always",
        **auth()})
    with urllib.request.urlopen(req, timeout=120) as r:
        reply = json.load(r)
    assert reply["usage"]["completion_tokens"] >= 1
    assert metric(router_metrics, "kvmesh_router_kv_fallbacks_total") == fallbacks  # the real KV was imported
    # decode never knew the request by the id the forger named, so none of the forgeries was even looked at
    assert metric(decode_metrics, "kvmesh_worker_kv_ready_dropped_total") == 0
