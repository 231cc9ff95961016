"""The router's instance registry: built from heartbeats, drops the silent, ignores the incompatible."""

import time

import pytest
from kvmesh.contracts.messages import Heartbeat, InstanceLoad, RouterLoad
from kvmesh.routing import CostModel

from services.router.registry import Registry
from services.router.scheduling import Policies, choose_decode


def beat(iid: str, role: str = "decode", model: str = "fp", block_size: int = 16, waiting: int = 0) -> Heartbeat:
    return Heartbeat(instance_id=iid, role=role, grpc_address="127.0.0.1:1", transfer_address="", ts=time.time(),
                     load=InstanceLoad(waiting=waiting), model=model, block_size=block_size)


def test_an_instance_that_stops_beating_is_dropped():
    reg = Registry(timeout_s=0.05, block_size=16, fingerprint="fp")
    reg.observe(beat("d0"))
    assert [i.id for i in reg.alive("decode")] == ["d0"]
    time.sleep(0.1)
    assert reg.alive("decode") == []


def test_a_dropped_instance_is_forgotten_by_the_routers_recent_prefixes():
    from services.router.recent import RecentPrefixes

    reg = Registry(timeout_s=0.05, block_size=16, fingerprint="fp")
    recent = RecentPrefixes(ttl_s=60.0)
    reg.on_drop = recent.forget
    reg.observe(beat("d0"))
    recent.dispatched("d0", [1, 2])
    assert recent.matched([1, 2], ["d0"]) == {"d0": 2}
    time.sleep(0.1)
    assert reg.alive() == [] and recent.matched([1, 2], ["d0"]) == {}


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


def test_a_least_work_engine_keeps_a_mostly_cached_prompt_its_queue_of_cold_ones_would_not_delay():
    """5,000 cold tokens queued at p0, which holds 60 of the prompt's 63 blocks: in arrival order they are all
    ahead (p1, idle and cold, is sooner); served least work first, p0 runs the prompt's last 16 tokens before them
    (~0.02 s of compute, under the first edge), and its heartbeat says what is ahead of such a prompt."""
    for ahead, home in (((), "p1"), ((0, 0, 2000, 5000), "p0")):
        reg = Registry(timeout_s=5, block_size=16, fingerprint="fp")
        busy = Heartbeat(instance_id="p0", role="prefill", grpc_address="127.0.0.1:1", transfer_address="",
                         ts=time.time(), load=InstanceLoad(waiting=3, waiting_tokens=5000, ahead_tokens=ahead),
                         model="fp", block_size=16)
        reg.observe(busy)
        reg.observe(beat("p1", role="prefill"))
        chosen, decision = policies().choose(None, reg.alive("prefill"), {"p0": 60}, 1000, 16, 0)
        assert chosen is not None and chosen.id == home, decision.reason
    # what the routers sent since the beat, which it does not show, is ranked as ahead of the new prompt
    reg.dispatched(reg.alive("prefill")[0], prompt_tokens=6000)
    assert next(i for i in reg.alive("prefill") if i.id == "p0").ahead_tokens == (1000, 1000, 3000, 6000)


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


def two_routers(timeout_s: float = 5) -> tuple[Registry, Registry]:
    """Two router replicas' registries that hear the same two decode instances."""
    regs = Registry(timeout_s, 16, "fp"), Registry(timeout_s, 16, "fp")
    for reg in regs:
        reg.observe(beat("d0"))
        reg.observe(beat("d1"))
    return regs


def share(src: Registry, dst: Registry, name: str) -> None:
    """What ``src``'s router reports over NATS (RouterLoad), as ``dst``'s receives it."""
    inflight, tokens = src.own_load()
    dst.peer_load(RouterLoad(name, time.time(), inflight, tokens))


@pytest.mark.parametrize("shared", [False, True])
def test_replicas_that_share_their_load_spread_a_burst_like_one_router(shared):
    """Each replica gets three requests at once, faster than heartbeats: alone, each spreads its own (2 + 1,
    the tie going to d0 both times: 4 against 2); counting each other's, 3 and 3."""
    a, b = two_routers()
    for reg, other, name in ((a, b, "a"), (b, a, "b"), (a, b, "a"), (b, a, "b"), (a, b, "a"), (b, a, "b")):
        reg.dispatched(choose_decode(reg.alive("decode")))
        if shared:
            share(reg, other, name)
    total = {iid: a.own_load()[0].get(iid, 0) + b.own_load()[0].get(iid, 0) for iid in ("d0", "d1")}
    assert total == ({"d0": 3, "d1": 3} if shared else {"d0": 4, "d1": 2})


def test_a_silent_replicas_counts_are_dropped():
    a, b = two_routers(timeout_s=0.05)
    b.dispatched(b.alive("decode")[0])
    share(b, a, "b")
    assert sum(i.routed for i in a.alive("decode")) == 1
    time.sleep(0.1)
    for iid in ("d0", "d1"):
        a.observe(beat(iid))  # the instances beat on; router b does not report any more
    a.expire()
    assert sum(i.routed for i in a.alive("decode")) == 0


def test_a_watched_instance_dropped_for_silence_tells_its_watcher_once():
    reg = Registry(timeout_s=0.05, block_size=16, fingerprint="fp")
    reg.observe(beat("d0"))
    told: list[str] = []
    reg.watch("d0", told.append)
    time.sleep(0.1)
    reg.expire()
    reg.expire()
    assert len(told) == 1 and "d0 stopped answering" in told[0]


def test_nothing_is_dropped_while_the_routers_own_bus_is_down():
    reg = Registry(timeout_s=0.05, block_size=16, fingerprint="fp")
    reg.observe(beat("d0"))
    up = False
    reg.bus_up = lambda: up
    time.sleep(0.1)
    assert [i.id for i in reg.alive()] == ["d0"]  # its silence is the bus's
    up = True
    assert [i.id for i in reg.alive()] == ["d0"]  # and once the bus is back it has timeout_s to be heard
    time.sleep(0.1)
    assert reg.alive() == []


def test_unwatching_stops_the_notice():
    reg = Registry(timeout_s=0.05, block_size=16, fingerprint="fp")
    reg.observe(beat("d0"))
    told: list[str] = []
    unwatch = reg.watch("d0", told.append)
    unwatch()
    time.sleep(0.1)
    reg.expire()
    assert told == []


def test_replicas_break_ties_towards_different_instances():
    """Two replicas deciding at once, neither having heard of the other's choice yet: not the same instance."""
    a, b = two_routers()
    share(a, b, "router-0")  # each knows the other exists (their reports carry nothing in flight yet)
    share(b, a, "router-1")
    first = choose_decode(a.alive("decode"), a.replica_rank("router-0"))
    second = choose_decode(b.alive("decode"), b.replica_rank("router-1"))
    assert {first.id, second.id} == {"d0", "d1"}
    assert a.replica_rank("router-0") == 0 and Registry(5, 16, "fp").replica_rank("alone") == 0


def test_a_request_queues_its_prompt_until_its_first_token_and_counts_until_it_ends():
    reg = Registry(timeout_s=5, block_size=16, fingerprint="fp")
    reg.observe(beat("b0"))
    (inst,) = reg.alive()
    done = reg.dispatched(inst, prompt_tokens=700)
    assert inst.waiting_tokens == 700 and inst.inflight == 1
    done(prefilled=True)  # its first token came: decoding, no prefill left to queue
    assert inst.waiting_tokens == 0 and inst.inflight == 1
    done(prefilled=True)
    done()
    done()
    assert inst.waiting_tokens == 0 and inst.inflight == 0


def test_an_instances_measured_cost_is_worked_out_once_per_heartbeat():
    import dataclasses

    from kvmesh.contracts.engine import Speed

    reg = Registry(timeout_s=5, block_size=16, fingerprint="fp")
    configured = CostModel()
    measured = dataclasses.replace(beat("p0", "prefill"), load=InstanceLoad(speed=Speed(prefill_tok_per_s=900.0)))
    reg.observe(measured)
    inst = reg.get("p0")
    first = inst.cost_model(configured)
    assert first is not None and first.prefill_tok_per_s == 900.0 and first.calibrated
    assert inst.cost_model(configured) is first                     # the same heartbeat: not priced again
    assert inst.cost_model(CostModel(fetch_gbps=5.0)).fetch_gbps == 5.0  # another configured model: priced again
    reg.observe(dataclasses.replace(measured, load=InstanceLoad(speed=Speed(prefill_tok_per_s=300.0))))
    assert reg.get("p0").cost_model(configured).prefill_tok_per_s == 300.0  # a new heartbeat: its own speed
    reg.observe(beat("p1", "prefill"))
    assert reg.get("p1").cost_model(configured) is None            # nothing measured: the configured model prices it


def test_an_instances_view_is_rebuilt_when_what_it_shows_changed_and_only_then():
    import dataclasses

    from services.router.scheduling import view

    reg = Registry(timeout_s=5, block_size=16, fingerprint="fp")
    reg.observe(beat("b0", "both", waiting=3))
    inst, cost = reg.get("b0"), CostModel()
    first = view(inst, cost)
    assert view(inst, cost) is first                    # nothing changed: the same view
    done = reg.dispatched(inst, prompt_tokens=100)       # this router sends it a request
    busy = view(inst, cost)
    assert busy is not first and (busy.routed, busy.waiting_tokens) == (1, 100)
    done()
    assert view(inst, cost).routed == 0
    assert view(inst, cost, has_lora=False).has_lora is False  # another adapter: another view
    assert view(inst, CostModel(prefill_tok_per_s=1.0)) is not view(inst, cost)
    reg.observe(dataclasses.replace(beat("b0", "both", waiting=7)))  # a new heartbeat
    assert view(reg.get("b0"), cost).queue_depth == 7
    # every field as a record with nothing cached would give it
    kept = view(reg.get("b0"), cost)
    assert view(dataclasses.replace(reg.get("b0"), view_of=None, _cost=None), cost) == kept


def test_a_draining_instance_takes_no_new_request_but_stays_known_until_it_goes():
    """Its beat says it is stopping: no routing choice lists it, its record stays for the streams it still runs,
    and its beats stopping drop it as any other."""
    import dataclasses

    reg = Registry(timeout_s=0.05, block_size=16, fingerprint="fp")
    reg.observe(beat("d0"))
    reg.observe(beat("d1"))
    reg.observe(dataclasses.replace(beat("d1"), draining=True))
    assert [i.id for i in reg.alive("decode")] == ["d0"] and [i.id for i in reg.alive()] == ["d0"]
    assert reg.get("d1").beat.draining
    time.sleep(0.1)
    assert reg.alive() == []
