"""The router's instance registry: built from heartbeats, drops the silent, ignores the incompatible."""

import time

from kvmesh.contracts.messages import Heartbeat
from kvmesh.routing import CostModel

from services.router.registry import Registry
from services.router.scheduling import Policies, choose_decode


def beat(iid: str, role: str = "decode", model: str = "fp", block_size: int = 16, waiting: int = 0) -> Heartbeat:
    return Heartbeat(instance_id=iid, role=role, grpc_address="127.0.0.1:1", transfer_address="", ts=time.time(),
                     load={"running": 0, "waiting": waiting}, model=model, block_size=block_size)


def test_an_instance_that_stops_beating_is_dropped():
    reg = Registry(timeout_s=0.05, block_size=16, fingerprint="fp")
    reg.observe(beat("d0"))
    assert [i.id for i in reg.alive("decode")] == ["d0"]
    time.sleep(0.1)
    assert reg.alive("decode") == []


def test_instances_with_another_model_or_block_size_are_ignored():
    reg = Registry(timeout_s=5, block_size=16, fingerprint="fp")
    reg.observe(beat("other-model", model="xx"))
    reg.observe(beat("other-blocks", block_size=32))
    reg.observe(beat("ok"))
    assert [i.id for i in reg.alive()] == ["ok"]


def test_dispatches_count_until_the_next_heartbeat():
    reg = Registry(timeout_s=5, block_size=16, fingerprint="fp")
    reg.observe(beat("d0"))
    reg.observe(beat("d1"))
    first = choose_decode(reg.alive("decode"))
    done = reg.dispatched(first)
    reg.observe(beat(first.id))  # a heartbeat sent before our request reached its engine: still idle there
    second = choose_decode(reg.alive("decode"))
    assert {first.id, second.id} == {"d0", "d1"}
    done()
    done()  # idempotent
    assert all(i.inflight == 0 for i in reg.alive())


def policies(slo: float = 0.0) -> Policies:
    return Policies("cache_aware", CostModel(prefill_tok_per_s=1000, prefill_overhead_s=0), slo)


def test_cache_aware_takes_the_longest_prefix_unless_its_queue_outweighs_it():
    reg = Registry(timeout_s=5, block_size=16, fingerprint="fp")
    reg.observe(beat("p0", role="prefill"))
    reg.observe(beat("p1", role="prefill"))
    prefills = reg.alive("prefill")
    assert policies().choose(None, prefills, {"p0": 40}, 1000, 16, 0)[0].id == "p0"
    reg.dispatched(prefills[0], prompt_tokens=5000)  # p0 is now busy for ~5 s
    assert policies().choose(None, reg.alive("prefill"), {"p0": 40}, 1000, 16, 0)[0].id == "p1"


def test_admission_control_rejects_when_the_slo_is_out_of_reach():
    reg = Registry(timeout_s=5, block_size=16, fingerprint="fp")
    reg.observe(beat("p0", role="prefill"))
    chosen, decision = policies(slo=0.1).choose(None, reg.alive("prefill"), {}, 1000, 16, 0)
    assert chosen is None and "SLO" in decision.reason


def test_a_request_may_name_its_policy_and_an_unknown_one_is_refused():
    import pytest

    assert policies().get("round_robin").name == "round_robin"
    with pytest.raises(ValueError, match="least_loaded"):
        policies().get("fastest")
