"""The inter-token watchdog (``services.router.stalls``): a stream whose instance sends no token and shows no engine
step for the limit is given up on; one that waits while its engine steps is not; the first token is never timed."""

import time

import pytest
from kvmesh.contracts.messages import Heartbeat, InstanceLoad

from services.router.registry import Registry
from services.router.stalls import StallWatch


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(time, "monotonic", c)
    return c


def beat(steps: int) -> Heartbeat:
    return Heartbeat(instance_id="d0", role="decode", grpc_address="127.0.0.1:1", transfer_address="", ts=0.0,
                     load=InstanceLoad(running=1, steps=steps), model="fp", block_size=16)


def watch(clock: Clock, limit_s: float = 10.0) -> tuple[Registry, StallWatch, list[str]]:
    reg = Registry(timeout_s=600, block_size=16, fingerprint="fp")
    reg.observe(beat(steps=1))
    lost: list[str] = []
    stalls = StallWatch(lambda: reg, limit_s)
    stalls.arm("d0", lost.append)
    return reg, stalls, lost


def test_a_stream_whose_engine_stopped_stepping_is_given_up_after_the_limit(clock):
    reg, stalls, lost = watch(clock)
    for _ in range(11):  # heartbeats go on (the process is alive), its engine's step count stands still
        clock.now += 1
        reg.observe(beat(steps=1))
        stalls.check()
    assert len(lost) == 1 and "d0 stalled" in lost[0] and "inter_token_timeout_s" in lost[0]
    stalls.check()
    assert len(lost) == 1  # given up once


def test_a_stream_that_waits_while_its_engine_steps_is_left_alone(clock):
    """Preempted or queued behind other streams: no token for a while, but the engine is working."""
    reg, stalls, lost = watch(clock)
    for steps in range(2, 40):
        clock.now += 1
        reg.observe(beat(steps))
        stalls.check()
    assert lost == []


def test_a_token_resets_the_stream_and_a_disarmed_stream_is_not_watched(clock):
    reg = Registry(timeout_s=600, block_size=16, fingerprint="fp")
    reg.observe(beat(steps=1))
    lost: list[str] = []
    stalls = StallWatch(lambda: reg, 10.0)
    watched = stalls.arm("d0", lost.append)
    assert watched is not None
    clock.now += 8
    watched.tick()
    clock.now += 8
    stalls.check()
    assert lost == []
    stalls.disarm(watched)
    clock.now += 100
    stalls.check()
    assert lost == []


def test_the_watchdog_is_off_at_zero(clock):
    assert StallWatch(lambda: Registry(600, 16, "fp"), 0.0).arm("d0", print) is None
