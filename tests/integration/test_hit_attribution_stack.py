"""Hit attribution on a real stack (two role-both instances with the tiny random model, cachesvc, the router):
each miss cause planted for real, and ``kvmesh trace --why`` names it from the span file."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import pytest
from kvmesh.instance.pool_client import PoolError
from kvmesh.telemetry import tracing
from kvmesh.telemetry.jsonl import JsonlSpanExporter

from app import hits_cli, trace_cli
from tests.integration.test_router_bad_input import TinyMesh, tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def spans(tmp_path_factory) -> Iterator:
    """Every span of this module's stacks, to a JSONL file as ``kvmesh up`` writes them."""
    path = tmp_path_factory.mktemp("spans") / "traces.jsonl"
    provider = tracing.make_provider("router", "r0", 1.0, [(JsonlSpanExporter(path), 10.0)])
    before = tracing._tracer
    tracing._tracer = provider.get_tracer("kvmesh")
    yield path, provider
    tracing._tracer = before
    provider.shutdown()


# two instances, routed in turn; the recent-prefix table off, so what the index says is all the router knows;
# 40 blocks of 16 tokens each, no host tier: a few prompts evict a block
STACK = {"policy": "round_robin", "recent_prefix_ttl_s": 0.0}
ENGINE = {"num_blocks": 40, "host_cache_mb": 0}


@pytest.fixture(scope="module")
def mesh(nats_server, model_dir, spans) -> Iterator[TinyMesh]:
    with TinyMesh(nats_server.url, model_dir, cachesvc=True, roles=("both", "both"), engine=ENGINE,
                  pool={"pool_capacity_mb": 0}, **STACK) as m:  # no pool tier: only the instances hold blocks
        yield m


@pytest.fixture(scope="module")
def pool_mesh(nats_server, model_dir, spans, mesh) -> Iterator[TinyMesh]:
    with TinyMesh(nats_server.url, model_dir, cachesvc=True, roles=("both", "both"), engine=ENGINE,
                  **STACK) as m:
        yield m


@pytest.fixture(scope="module")
def small_pool_mesh(nats_server, model_dir, spans, pool_mesh) -> Iterator[TinyMesh]:
    with TinyMesh(nats_server.url, model_dir, cachesvc=True, roles=("both", "both"), engine=ENGINE,
                  pool={"pool_capacity_mb": 1}, **STACK) as m:  # 128 blocks of the tiny model's 8 KiB
        yield m


def _send(mesh: TinyMesh, text: str, salt: str = "") -> str:
    rid = f"hits-{uuid.uuid4().hex[:12]}"
    status, body, _ = mesh.post("/v1/completions", {"model": mesh.router.model_id, "prompt": text, "max_tokens": 2,
                                                    **({"cache_salt": salt} if salt else {})},
                                {"x-request-id": rid})
    assert status == 200, body
    time.sleep(1.5)  # its blocks' events reach cachesvc's index and the router
    return rid


def _why(spans, rid: str, capsys) -> str:
    path, provider = spans
    provider.force_flush()
    capsys.readouterr()
    assert trace_cli.main(["--why", rid, "--file", str(path), "--wait", "5"]) == 0
    return capsys.readouterr().out


def _prompt(n: int = 120) -> str:
    return uuid.uuid4().hex * (n // 32) + "."


def _instance(spans, rid: str) -> str:
    from kvmesh.telemetry.spans import find, read_spans

    root, _ = find(read_spans(spans[0]), rid)
    assert root is not None
    return str(root.attributes["kvmesh.hit.instance"])


def test_a_new_prompt_was_never_computed(mesh, spans, capsys):
    out = _why(spans, _send(mesh, _prompt()), capsys)
    assert "delivered hit: 0 tokens" in out and "never computed in the cluster" in out


def test_a_prompt_another_instance_holds_was_routed_elsewhere_with_the_plans_reason(mesh, spans, capsys):
    text = _prompt()
    first = _send(mesh, text)
    again = _send(mesh, text)  # round robin: the other instance
    out = _why(spans, again, capsys)
    assert "held on another instance, routed elsewhere" in out
    assert f"held on {_instance(spans, first)}" in out and "round robin" in out


def test_the_same_tokens_under_another_tenant_are_a_namespace_miss(mesh, spans, capsys):
    text = _prompt()
    _send(mesh, text, salt="tenant-a")
    out = _why(spans, _send(mesh, text, salt="tenant-b"), capsys)
    assert "cached under another namespace" in out


def test_blocks_stored_where_the_index_did_not_yet_say_are_index_lag(mesh, spans, capsys, monkeypatch):
    text = _prompt()
    _send(mesh, text)

    async def lagging(*args, **kwargs):  # the index has not applied the first request's events yet
        return {}

    monkeypatch.setattr(mesh.router, "matched_blocks", lagging)
    out = _why(spans, _send(mesh, text), capsys)
    assert "index lag" in out and "not in the index then" in out


def test_a_prompt_whose_blocks_were_evicted_says_evicted_and_where(mesh, spans, capsys):
    text = _prompt()
    first = _send(mesh, text)
    for _ in range(4):  # two prompts of 24 blocks on each instance of 40 blocks
        _send(mesh, _prompt(400))
    out = _why(spans, _send(mesh, text), capsys)
    assert "evicted — from " in out and "device tier (lru)" in out, out  # where, and by which policy
    assert _instance(spans, first) in out


def test_a_prompt_whose_blocks_the_pool_evicted_says_evicted_from_the_pool(small_pool_mesh, spans, capsys):
    """The instances evict the prompt's blocks first (40 blocks each), the pool later (128): its removal, heard on
    pool.events, is the last, and the explanation names the pool's tier."""
    text = _prompt()
    _send(small_pool_mesh, text)
    for _ in range(8):  # 8 prompts of ~25 blocks written back: more than the pool holds
        _send(small_pool_mesh, _prompt(400))
    out = _why(spans, _send(small_pool_mesh, text), capsys)
    assert "evicted — from pool's dram tier (" in out, out  # and the pool's eviction policy


def test_a_pool_fetch_that_fails_is_named(pool_mesh, spans, capsys, monkeypatch):
    text = _prompt()
    _send(pool_mesh, text)  # its blocks go back to the pool as it ends
    time.sleep(1.5)  # the write-back runs after the request ended

    async def refused(*args, **kwargs):
        raise PoolError("the pool refused the fetch")

    for w in pool_mesh.workers:
        monkeypatch.setattr(w.pool, "fetch", refused)
    out = _why(spans, _send(pool_mesh, text), capsys)  # the other instance: only the pool has it
    assert "pool fetch or PD hand-off failed" in out and "refused" in out, out


def test_a_pool_fetch_that_succeeds_delivers_the_predicted_hit(pool_mesh, spans, capsys):
    text = _prompt()
    _send(pool_mesh, text)
    out = _why(spans, _send(pool_mesh, text), capsys)
    assert "predicted hit: 96 tokens" in out and "delivered hit: 96 tokens" in out, out  # 97 tokens: 6 blocks


def test_the_report_adds_the_causes_up_to_the_missed_tokens(mesh, spans, capsys):
    path, provider = spans
    provider.force_flush()
    capsys.readouterr()
    assert hits_cli.main(["--file", str(path), "--capacity-blocks", "80", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["requests"] >= 5 and r["causes_add_up"]
    assert sum(r["missed_by_cause"].values()) == r["missed_tokens"] == r["prompt_tokens"] - r["delivered_hit_tokens"]
    assert r["delivered_hit_tokens"] <= r["optimum_infinite_hit_tokens"]
    assert r["optimum_belady_hit_tokens"] <= r["optimum_infinite_hit_tokens"]
