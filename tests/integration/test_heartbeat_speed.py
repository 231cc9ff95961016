"""An engine instance measures its own prefill speed as it serves and reports it in its heartbeat; the router
prices that instance with it. A real router, prefill and decode instance (tiny random model), nats-server."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from kvmesh.contracts.messages import InstanceLoad
from kvmesh.routing import CostModel

from tests.integration.test_router_bad_input import HI, TinyMesh, tiny_model_dir


@pytest.fixture(scope="module")
def mesh(nats_server, tmp_path_factory) -> Iterator[TinyMesh]:
    with TinyMesh(nats_server.url, tiny_model_dir(tmp_path_factory.mktemp("model"))) as m:
        yield m


def beat_load(mesh: TinyMesh, iid: str) -> InstanceLoad:
    return next(i.beat.load for i in mesh.router.registry.alive() if i.id == iid)


def wait_for_speed(mesh: TinyMesh, iid: str, timeout_s: float = 10) -> InstanceLoad:
    deadline = time.monotonic() + timeout_s
    while (load := beat_load(mesh, iid)).speed.prefill_tok_per_s is None:
        assert time.monotonic() < deadline, f"{iid} never reported a prefill speed: {load}"
        time.sleep(0.1)
    return load


def test_the_heartbeat_carries_the_speed_measured_at_start_before_any_request(mesh):
    """``engine.calibrate``: a few forward passes over dummy rows before serving; the first heartbeat prices the
    instance at its own speed, and the passes left no KV behind (no block cached, none announced)."""
    prefill = next(w for w in mesh.workers if w.cfg.role == "prefill")
    load = wait_for_speed(mesh, "prefill-0")
    assert load.kv_block_bytes == prefill.layout.block_nbytes
    assert load.speed.prefill_tok_per_s > 0 and beat_load(mesh, "decode-0").speed.decode_step_s is not None
    assert CostModel.from_load(load, CostModel()).calibrated
    assert prefill.engine.pacer.speed_fit.fit().samples <= 4  # the calibration's passes, the first one left out
    assert prefill.engine.engine.blocks.num_cached_blocks == 0  # (this module's first test: no request yet)


def test_the_heartbeat_carries_the_measured_speed_once_the_instance_has_served(mesh):
    prefill = next(w for w in mesh.workers if w.cfg.role == "prefill")
    # two prompts, as the router sends a prompt decode already holds to decode
    for messages in (HI, [{"role": "user", "content": "Hello there"}]):
        status, body, _ = mesh.post("/v1/chat/completions", {"messages": messages, "max_tokens": 3})
        assert status == 200, body

    # The engine is idle once both answers are back, so its fit stands still; a heartbeat sent before the second
    # prompt's step can still carry the older line, so wait for one that carries this one (not a tolerance).
    fit = prefill.engine.pacer.speed_fit.fit()
    assert fit is not None and fit.samples >= 1
    deadline = time.monotonic() + 10
    while (load := wait_for_speed(mesh, "prefill-0")).speed.prefill_tok_per_s != round(fit.tok_per_s, 3):
        assert time.monotonic() < deadline, f"no heartbeat carried the fitted {fit.tok_per_s:.3f} tok/s: {load}"
        time.sleep(0.1)
        fit = prefill.engine.pacer.speed_fit.fit()
        assert fit is not None
    assert load.speed.prefill_overhead_s == round(fit.overhead_s, 6)

    cost = CostModel.from_load(load, CostModel())
    assert cost.calibrated and cost.prefill_tok_per_s == load.speed.prefill_tok_per_s
    prefills = mesh.router.registry.alive("prefill")
    chosen, decision = mesh.router.policies.choose("cache_aware", prefills, {}, 100, mesh.cfg.block_size, 0)
    assert chosen.id == "prefill-0" and "configured" not in decision.reason
    assert f"prefill-0={load.speed.prefill_tok_per_s:.0f}" in decision.reason
