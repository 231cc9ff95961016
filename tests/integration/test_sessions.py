"""Sessions through a real stack (router, an engine instance serving both roles, cachesvc and its pool, real
nats-server, the tiny model): the session id and its end reach the engine's and the pool's session tables, a
close and a tool-call pause reach every cache, retention hints pin blocks in the engine, each tenant's sessions
and pins are its own, and bad values are 400s naming the field. With two instances: affinity, sub-agents, a
second router replica that keeps the first one's sessions, and a paused session's instance warming its KV when
the session is back at either router."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import time
import uuid
from collections.abc import Callable, Iterator

import grpc
import pytest
from aiohttp import web
from kvmesh.client import KvmeshClient
from kvmesh.proto.v1 import api_pb2, common_pb2

from services.router.core import Router
from services.router.http_api import OpenAIApi
from services.router.intake import Intake

from .test_router_bad_input import CHAT, TinyMesh, model_dir  # noqa: F401 - model_dir is a fixture

KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
TOOL_CALL = '<tool_call>{"name": "search", "arguments": {}}</tool_call>'


@pytest.fixture(scope="module")
def mesh(nats_server, model_dir) -> Iterator[TinyMesh]:  # noqa: F811
    with TinyMesh(nats_server.url, model_dir, cachesvc=True, roles=("both",), api_keys=KEYS,
                  engine={"eviction": "session_duel"}, pool={"pool_eviction": "session"}) as m:
        yield m


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def chat(mesh: TinyMesh, key: str, content: str, headers: dict | None = None, **extra) -> tuple[int, dict]:
    status, body, _ = mesh.post(CHAT, {"messages": [{"role": "user", "content": content}], "max_tokens": 2,
                                       "temperature": 0, **extra}, {**auth(key), **(headers or {})})
    return status, body


def engine_sessions(mesh: TinyMesh):
    return mesh.workers[0].engine.engine.blocks.sessions  # type: ignore[attr-defined]


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def sid() -> str:
    return f"s-{uuid.uuid4().hex[:8]}"


def test_a_session_reaches_the_engine_and_the_pool_namespaced_by_tenant(mesh):
    s = sid()
    assert chat(mesh, "sk-alice", "hello " * 20, session_id=s)[0] == 200
    assert chat(mesh, "sk-bob", "hello " * 20, headers={"x-session-id": s})[0] == 200
    assert eventually(lambda: f"alice/{s}" in engine_sessions(mesh) and f"bob/{s}" in engine_sessions(mesh))
    assert eventually(lambda: f"alice/{s}" in mesh.cache.pool.sessions)  # by the write-back


def test_a_close_ends_only_the_callers_session_everywhere(mesh):
    s = sid()
    for key in ("sk-alice", "sk-bob"):
        assert chat(mesh, key, "tell me a story " * 8, session_id=s)[0] == 200
    assert eventually(lambda: f"bob/{s}" in mesh.cache.pool.sessions and f"alice/{s}" in mesh.cache.pool.sessions)
    status, body, _ = mesh.http("DELETE", f"/v1/sessions/{s}", headers=auth("sk-bob"))
    assert status == 200 and body == {"id": s, "object": "session", "closed": True}
    assert eventually(lambda: f"bob/{s}" not in engine_sessions(mesh) and f"bob/{s}" not in mesh.cache.pool.sessions)
    assert f"alice/{s}" in engine_sessions(mesh) and f"alice/{s}" in mesh.cache.pool.sessions
    with KvmeshClient(mesh.grpc_target, api_key="sk-alice") as client:
        client.close_session(s)
    assert eventually(lambda: f"alice/{s}" not in engine_sessions(mesh))


def test_the_last_request_ends_its_session(mesh):
    s = sid()
    assert chat(mesh, "sk-alice", "first turn " * 10, session_id=s)[0] == 200
    assert eventually(lambda: f"alice/{s}" in engine_sessions(mesh))
    assert chat(mesh, "sk-alice", "last turn " * 10, session_id=s, session_end=True)[0] == 200
    assert eventually(lambda: f"alice/{s}" not in engine_sessions(mesh) and f"alice/{s}" not in
                      mesh.cache.pool.sessions)


def test_a_response_that_ends_in_a_tool_call_pauses_the_session(mesh):
    s = sid()
    status, body = chat(mesh, "sk-alice", "find it " * 10, session_id=s, max_tokens=80,
                        guided_choice=[TOOL_CALL])
    assert status == 200 and body["choices"][0]["message"]["content"] == TOOL_CALL
    assert eventually(lambda: (e := engine_sessions(mesh).get(f"alice/{s}")) is not None and e.paused)
    assert eventually(lambda: (p := mesh.cache.pool.sessions.get(f"alice/{s}")) is not None and p.paused)
    assert chat(mesh, "sk-alice", "the tool said 42 " * 5, session_id=s)[0] == 200  # back: no longer paused
    assert eventually(lambda: not engine_sessions(mesh).get(f"alice/{s}").paused)


def test_a_paused_sessions_context_comes_back_from_the_pool_before_its_next_request(mesh):
    """Its blocks gone from the instance (evicted), the session's context comes back from the pool with no request
    in sight: when the session's next request reached a router (``RESUME`` for this instance, on the bus) and when
    the engine finds it due (an announced pause whose end is within ``session_prefetch_lead_s``)."""
    from kvmesh.contracts.messages import SessionSignal
    from kvmesh.contracts.sessions import SessionEvent

    s, w = sid(), mesh.workers[0]
    key = f"alice/{s}"
    assert chat(mesh, "sk-alice", f"{s} the context an agent has built so far " * 8, session_id=s)[0] == 200
    assert eventually(lambda: key in mesh.cache.pool.sessions and w.session_contexts.get(key) is not None)
    ctx = w.session_contexts.get(key)
    full = len(ctx.tokens) // mesh.engine_cfg.block_size

    def local() -> int:
        return mesh.call(w.engine.match_prefix(w.engine.namespace(ctx.cache_salt, ctx.lora), list(ctx.tokens),
                                               len(ctx.tokens)))

    def warmed(trigger: str) -> float:
        return w.metrics.session_warm_blocks.labels(trigger)._value.get()

    assert full > 4 and local() == full
    for trigger, event, expected_s in (("resume", SessionEvent.RESUME, 0.0), ("due", SessionEvent.PAUSE, 0.5)):
        mesh.call(w.engine.call(lambda e: e.blocks.evict(10**6)))  # every unreferenced block leaves the device
        assert local() == 0
        before = warmed(trigger)
        mesh.call(w.bus.publish(w.subjects.sessions, SessionSignal(key, event, time.time(), w.instance_id,
                                                                   expected_s)))
        assert eventually(lambda t=trigger, b=before: warmed(t) >= b + full)
        assert local() == full


def test_a_retention_hint_pins_the_callers_blocks_only(mesh):
    prompt = f"{uuid.uuid4().hex} " + "a system prompt worth keeping " * 4
    assert chat(mesh, "sk-alice", prompt)[0] == 200
    assert chat(mesh, "sk-bob", prompt, cache_control={"ttl": 600, "priority": 90})[0] == 200
    bm = mesh.workers[0].engine.engine.blocks  # type: ignore[attr-defined]
    engine = mesh.workers[0].engine

    def priorities(salt: str) -> set[int]:
        tokens = mesh.router.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        seed = engine.namespace(salt)
        return {n.priority for n in bm.match(seed, tokens).nodes}

    from services.router.access import cache_salt

    assert eventually(lambda: priorities(cache_salt("bob", "")) == {90})
    assert priorities(cache_salt("alice", "")) == {0}  # bob's pin never touches alice's blocks


@pytest.mark.parametrize("extra,headers,words", [
    ({"session_id": "a/b"}, {}, "session_id must be 1 to 128 printable ASCII characters without '/'"),
    ({"session_id": "a"}, {"x-session-id": "b"}, "differ"),
    ({"session_end": True}, {}, "session_end needs a session_id"),
    ({"cache_control": {"ttl": -5}}, {}, "cache_control.ttl must be a number of seconds in (0, 604800]"),
    ({"cache_control": {"ttl": "forever"}}, {}, "cache_control.ttl must be a number of seconds or a duration"),
    ({"cache_control": {"priority": 101}}, {}, "cache_control.priority must be an integer in [0, 100]"),
    ({"cache_control": {"priority": "max"}}, {}, "cache_control.priority must be an integer"),
])
def test_http_bad_session_fields_are_400s_naming_the_field(mesh, extra, headers, words):
    status, body = chat(mesh, "sk-alice", "hi", headers, **extra)
    assert status == 400 and words in body["error"]["message"]


def test_http_bad_message_cache_control_names_the_message(mesh):
    status, body, _ = mesh.post(CHAT, {"messages": [{"role": "system", "content": "be brief",
                                                     "cache_control": {"ttl": 0}},
                                                    {"role": "user", "content": "hi"}], "max_tokens": 1},
                                auth("sk-alice"))
    assert status == 400 and "messages[0].cache_control.ttl" in body["error"]["message"]


def test_closing_a_malformed_session_id_is_a_400(mesh):
    status, body, _ = mesh.http("DELETE", "/v1/sessions/" + "x" * 200, headers=auth("sk-alice"))
    assert status == 400 and "session_id must be 1 to 128" in body["error"]["message"]
    assert mesh.http("DELETE", "/v1/sessions/abc")[0] == 401  # no key, no tenant: refused


def test_grpc_bad_ttl_is_invalid_argument_naming_the_field(mesh):
    with grpc.insecure_channel(mesh.grpc_target) as channel:
        stub = mesh.stub(channel)
        request = api_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="user", content="hi")],
                                      sampling=common_pb2.SamplingParams(max_tokens=1), session_id="g1",
                                      cache_control=common_pb2.CacheControl(ttl_s=-1))
        with pytest.raises(grpc.RpcError) as e:
            stub.Chat(request, metadata=(("authorization", "Bearer sk-alice"),))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cache_control.ttl" in e.value.details()
        request.cache_control.CopyFrom(common_pb2.CacheControl(ttl_s=30, priority=200))
        with pytest.raises(grpc.RpcError) as e:
            stub.Chat(request, metadata=(("authorization", "Bearer sk-alice"),))
        assert "cache_control.priority" in e.value.details()


# ---- two instances: placement and the cluster's copies ---------------------------------------------------------

@pytest.fixture(scope="module")
def pair(nats_server, model_dir) -> Iterator[TinyMesh]:  # noqa: F811
    with TinyMesh(nats_server.url, model_dir, cachesvc=True, roles=("both", "both"),
                  engine={"eviction": "session_duel"}, pool={"pool_eviction": "session"}) as m:
        yield m


def holders(mesh: TinyMesh, key: str) -> list[str]:
    return [w.instance_id for w in mesh.workers if key in w.engine.engine.blocks.sessions]  # type: ignore


def test_a_session_stays_on_its_instance_where_round_robin_would_move_it(pair):
    s, rr = sid(), {"x-kvmesh-policy": "round_robin"}
    for turn in range(3):
        status, _, _ = pair.post(CHAT, {"messages": [{"role": "user", "content": f"turn {turn} " * 10}],
                                        "max_tokens": 2, "session_id": s}, rr)
        assert status == 200
    assert len(holders(pair, f"/{s}")) == 1  # every turn ran where the first did
    other = sid()
    for turn in range(2):  # without a session id the same policy alternates
        pair.post(CHAT, {"messages": [{"role": "user", "content": f"{other} {turn} " * 10}], "max_tokens": 2}, rr)
    assert pair.router.sessions.instance_of(f"/{s}") in {w.instance_id for w in pair.workers}


def test_blocks_with_another_copy_in_the_cluster_are_marked_on_the_instance(pair):
    prompt = f"{uuid.uuid4().hex} " + "a prompt both instances compute " * 4
    for _ in range(2):  # round robin: once on each instance
        status, _, _ = pair.post("/v1/completions", {"prompt": prompt, "max_tokens": 2},
                                 {"x-kvmesh-policy": "round_robin"})
        assert status == 200
    tokens = pair.router.tokenizer.encode(prompt)

    def replicated(worker) -> list[bool]:
        engine = worker.engine
        return [n.replicated for n in engine.engine.blocks.match(engine.namespace(""), tokens).nodes]

    assert eventually(lambda: all(replicated(w) and all(replicated(w)) for w in pair.workers))


@contextlib.contextmanager
def replica(mesh: TinyMesh) -> Iterator[Callable[..., tuple[int, dict]]]:
    """A second router replica over the same instances and bus (its own id and HTTP port); yields a POST."""
    async def start() -> tuple[Router, web.AppRunner]:
        router = Router(mesh.cfg.model_copy(update={"id": f"replica-{uuid.uuid4().hex[:6]}"}), mesh.shared)
        await router.start()
        runner = web.AppRunner(OpenAIApi(router, Intake(router)).app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        while len(router.registry.alive()) < len(mesh.workers):
            await asyncio.sleep(0.05)
        return router, runner

    async def stop() -> None:
        await runner.cleanup()
        await router.stop()

    router, runner = mesh.call(start(), timeout=60)
    port = runner.addresses[0][1]

    def post(body: dict, headers: dict | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request("POST", CHAT, body=json.dumps(body), headers={"content-type": "application/json",
                                                                        **(headers or {})})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    post.router = router  # type: ignore[attr-defined]
    try:
        yield post
    finally:
        mesh.call(stop(), timeout=30)


def test_a_session_alternating_between_two_routers_keeps_its_instance(pair):
    """Round robin would move every request; the session stays where its first request ran whichever replica
    takes it, and a tool-call pause seen by one replica is a resume at the other (its instance warms its KV)."""
    rr = {"x-kvmesh-policy": "round_robin"}
    with replica(pair) as other:
        s = sid()
        history = f"{s} an agent's task " * 6
        resumed_before = pair.router.sessions.resumed + other.router.sessions.resumed
        for turn in range(4):
            body = {"messages": [{"role": "user", "content": f"{history} step {turn}"}], "max_tokens": 2,
                    "temperature": 0, "session_id": s, "session_pause_s": 30}
            sent = time.time()
            if turn % 2 == 0:
                status, _, _ = pair.post(CHAT, body, rr)
            else:
                status, _ = other(body, rr)
            assert status == 200
            # the next request goes to the other replica: wait until it heard of this request's pause
            there = other.router if turn % 2 == 0 else pair.router
            assert eventually(lambda r=there, t=sent: (r.sessions.paused_at(f"/{s}") or 0.0) >= t)
        assert len(holders(pair, f"/{s}")) == 1  # every step ran on one instance
        home = holders(pair, f"/{s}")[0]
        assert pair.router.sessions.instance_of(f"/{s}") == home == other.router.sessions.instance_of(f"/{s}")
        assert pair.router.sessions.resumed + other.router.sessions.resumed == resumed_before + 3


def test_a_sub_agent_starts_on_its_parents_instance(pair):
    rr = {"x-kvmesh-policy": "round_robin"}
    parent, children = sid(), [sid() for _ in range(3)]
    prefix = f"{parent} shared context of the task " * 6
    assert pair.post(CHAT, {"messages": [{"role": "user", "content": prefix}], "max_tokens": 2,
                            "session_id": parent}, rr)[0] == 200
    home = holders(pair, f"/{parent}")
    for child in children:  # round robin alone would spread them over both instances
        status, _, _ = pair.post(CHAT, {"messages": [{"role": "user", "content": f"{prefix} subtask {child}"}],
                                        "max_tokens": 2}, {**rr, "x-dynamo-session-id": child,
                                                           "x-dynamo-parent-session-id": parent})
        assert status == 200
        assert holders(pair, f"/{child}") == home
