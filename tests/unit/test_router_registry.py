"""The router's instance registry: built from heartbeats, drops the silent, ignores the incompatible."""

import time

from kvmesh.bus import Heartbeat
from services.router.policy import prefix_then_load
from services.router.registry import Registry


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
    first = prefix_then_load(reg.alive("decode"), {})
    reg.note_dispatch(first)
    second = prefix_then_load(reg.alive("decode"), {})
    assert {first.id, second.id} == {"d0", "d1"}


def test_longest_prefix_wins_then_the_least_loaded():
    reg = Registry(timeout_s=5, block_size=16, fingerprint="fp")
    reg.observe(beat("p0", role="prefill", waiting=3))
    reg.observe(beat("p1", role="prefill"))
    assert prefix_then_load(reg.alive("prefill"), {"p0": 4}).id == "p0"
    assert prefix_then_load(reg.alive("prefill"), {}).id == "p1"
