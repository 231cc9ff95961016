"""A running stack changes its pool sizes (``Stack.scale``, what ``kvmesh up`` does when ``kvmesh plan --actuator
local`` asks): a new instance serves, and one taken away loses no request. Stopped (SIGTERM), it drains: its beat
says so, the router sends new requests elsewhere at once, and the streams it runs finish there; what still runs
after its ``drain_s`` is cut and its routers migrate it (``services/router/migration.py``). The tiny random model;
no timing luck: the new decode's streams hang after 10 tokens (test-only fault), so they are certainly in flight
when it is stopped (and, with ``fault_resume_on_drain``, go on once it drains)."""

from __future__ import annotations

import threading

import pytest
from kvmesh.client import KvmeshClient

from app.launcher import ask_pools, want_pools
from tests.integration.test_router_bad_input import tiny_model_dir

from .conftest import start_stack
from .test_faults import HANG, router_metric

pytestmark = pytest.mark.slow

PROMPTS = [[(i * 7919 + k * 131) % 250 + 3 for i in range(20)] for k in range(4)]


def stream(stack, prompt: list[int], request_id: str, out: dict) -> None:
    with KvmeshClient(stack.router_grpc, timeout_s=240, retries=0) as client:
        chunks = list(client.generate(prompt, max_tokens=40, temperature=0, ignore_eos=True, request_id=request_id))
    out[request_id] = chunks


def test_a_decode_added_then_removed_with_streams_on_it_loses_none(tmp_path_factory):
    """Its streams stay hung past its drain (2 s): they are cut, and migrated."""
    model = tiny_model_dir(tmp_path_factory.mktemp("model"))
    stack = start_stack(tmp_path_factory, "scale", settings={"engine": {"model": str(model)}},
                        env={"KVMESH_ROUTER_INTER_TOKEN_TIMEOUT_S": "300", "KVMESH_ROUTER_INSTANCE_TIMEOUT_S": "300"},
                        instance_env={"decode-1": {"KVMESH_INSTANCE_FAULT_HANG_AFTER_TOKENS": "10",
                                                   "KVMESH_INSTANCE_DRAIN_S": "2"}})
    try:
        assert stack.scale("decode", 2) == ["started decode-1"]  # returns once the router sees it
        out: dict = {}
        threads = [threading.Thread(target=stream, args=(stack, p, f"req-{k}", out)) for k, p in enumerate(PROMPTS)]
        for t in threads:
            t.start()
        new = stack.service("decode-1")
        while new.log_path.read_text().count(HANG) < 1:  # a stream on the new decode, stuck there
            assert any(t.is_alive() for t in threads), "every stream ended: none reached decode-1"
            threading.Event().wait(0.1)
        assert stack.scale("decode", 1) == ["stopped decode-1"]
        for t in threads:
            t.join(240)
        assert sorted(out) == [f"req-{k}" for k in range(len(PROMPTS))]
        for chunks in out.values():
            assert chunks[-1].finished and chunks[-1].usage.completion_tokens == 40
            assert sum(len(c.token_ids) for c in chunks) == 40
        assert router_metric(stack, 'kvmesh_router_migrations_total{outcome="migrated"}') >= 1
        assert [s.name for s in stack.pool("decode")] == ["decode-0"]
    finally:
        stack.stop()


def test_a_decode_stopped_with_streams_on_it_drains_them_and_takes_no_new_one(tmp_path_factory):
    """SIGTERM with streams in flight there (hung after 10 tokens until the drain starts): they finish on it, none
    migrated; a request sent while it drains goes to the other decode with no failed try; then it exits."""
    model = tiny_model_dir(tmp_path_factory.mktemp("model"))
    stack = start_stack(tmp_path_factory, "drain", settings={"engine": {"model": str(model)}},
                        env={"KVMESH_ROUTER_INTER_TOKEN_TIMEOUT_S": "300", "KVMESH_ROUTER_INSTANCE_TIMEOUT_S": "300"},
                        instance_env={"decode-1": {"KVMESH_INSTANCE_FAULT_HANG_AFTER_TOKENS": "10",
                                                   "KVMESH_INSTANCE_FAULT_RESUME_ON_DRAIN": "true"}})
    try:
        assert stack.scale("decode", 2) == ["started decode-1"]
        out: dict = {}
        threads = [threading.Thread(target=stream, args=(stack, p, f"req-{k}", out)) for k, p in enumerate(PROMPTS)]
        for t in threads:
            t.start()
        new = stack.service("decode-1")
        while new.log_path.read_text().count(HANG) < 1:
            assert any(t.is_alive() for t in threads), "every stream ended: none reached decode-1"
            threading.Event().wait(0.1)
        hung = new.log_path.read_text().count(HANG)
        scaled: list = []
        stopping = threading.Thread(target=lambda: scaled.append(stack.scale("decode", 1)))
        stopping.start()
        router_log = stack.service("router").log_path
        while "instance decode-1 draining" not in router_log.read_text():
            assert stopping.is_alive(), "decode-1 stopped before the router heard it drain"
            threading.Event().wait(0.05)
        stream(stack, PROMPTS[0], "during-drain", out)  # sent while decode-1 drains
        stopping.join(60)
        for t in threads:
            t.join(240)
        assert scaled == [["stopped decode-1"]]
        assert sorted(out) == sorted([f"req-{k}" for k in range(len(PROMPTS))] + ["during-drain"])
        for chunks in out.values():
            assert chunks[-1].finished and chunks[-1].usage.completion_tokens == 40
            assert sum(len(c.token_ids) for c in chunks) == 40
        assert router_metric(stack, 'kvmesh_router_migrations_total{outcome="migrated"}') == 0
        assert "instance decode-1 failed" not in router_log.read_text()  # nothing was sent to it as it drained
        log = new.log_path.read_text()
        assert hung >= 1 and "decode-1 draining" in log and "decode-1 drained in" in log
    finally:
        stack.stop()


def test_kvmesh_up_reconciles_the_pools_the_planner_asks_for(tmp_path_factory):
    model = tiny_model_dir(tmp_path_factory.mktemp("model"))
    stack = start_stack(tmp_path_factory, "reconcile", settings={"engine": {"model": str(model)}})
    try:
        ask_pools(stack.state_dir, {"prefill": 2})
        assert want_pools(stack.state_dir) == {"prefill": 2}
        assert stack.reconcile() == ["started prefill-1"]
        ask_pools(stack.state_dir, {"prefill": 1})
        assert stack.reconcile() == ["stopped prefill-1"]
        assert stack.reconcile() == []
    finally:
        stack.stop()
