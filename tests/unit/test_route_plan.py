"""Route planning as a pure function (kvmesh.routing.plan): the documented cases decided from a fleet snapshot,
with no process, socket or registry."""

from __future__ import annotations

from dataclasses import replace

from kvmesh.contracts.engine import SessionHint
from kvmesh.contracts.layout import KVLayout
from kvmesh.routing import CostModel, make_policy
from kvmesh.routing.plan import PD, POOL, FleetView, InstanceView, Local, Refuse, RouteAsk, plan

COST = CostModel(prefill_tok_per_s=1000.0, prefill_overhead_s=0.01)
FP32 = KVLayout("m", num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)
BF16 = replace(FP32, dtype="bf16")
PROMPT = 1600  # 100 blocks


def fleet(*instances: InstanceView, matched: dict[str, int] | None = None, **kw) -> FleetView:
    return FleetView(tuple(instances), matched or {}, 16, COST, **kw)


def ask(**kw) -> RouteAsk:
    return RouteAsk(kw.pop("prompt_tokens", PROMPT), "cache_aware", **kw)


def route(f: FleetView, a: RouteAsk | None = None, policy: str = "cache_aware"):
    return plan(a or ask(), f, make_policy(policy, COST))


P0, D0, D1 = InstanceView("p0", "prefill"), InstanceView("d0", "decode"), InstanceView("d1", "decode")
B0, B1 = InstanceView("b0", "both"), InstanceView("b1", "both")


def test_a_cold_prompt_goes_through_prefill_and_is_pushed_to_the_least_loaded_decode():
    got = route(fleet(P0, replace(D0, queue_depth=3), D1))
    assert isinstance(got, PD) and (got.prefill, got.decode) == ("p0", "d1") and got.expected_prefill_s > 0
    assert got.attributes["kvmesh.route.path"] == "pd"


def test_a_prompt_decode_mostly_holds_is_computed_there():
    got = route(fleet(P0, D0, matched={"d0": 90}))
    assert isinstance(got, Local) and got.instance == "d0" and got.reason.startswith("local")


def test_a_hit_in_the_pool_goes_to_an_instance_that_can_load_it():
    """Without a pool hit the idler instance wins; with one, the instance whose KV converts (b1) does, though
    it has more queued: the other cannot load pool blocks, so it would compute the whole prompt."""
    unable = replace(B0, kv_unconvertible="CPU attention's 'amx' kernel", waiting_tokens=0)
    able = replace(B1, waiting_tokens=200)
    assert route(fleet(unable, able)).instance == "b0"
    got = route(fleet(unable, able, matched={POOL: 90}))
    assert isinstance(got, Local) and got.instance == "b1"


def test_an_overloaded_instance_loses_its_prefix_hit_to_an_idle_one():
    busy = replace(B0, waiting_tokens=20_000, queue_depth=20)
    got = route(fleet(busy, B1, matched={"b0": 50}))
    assert got.instance == "b1"
    assert route(fleet(replace(busy, waiting_tokens=0, queue_depth=0), B1, matched={"b0": 50})).instance == "b0"


def test_a_ttft_target_no_path_meets_is_refused_with_the_estimates():
    slow = replace(P0, waiting_tokens=50_000)
    got = route(fleet(slow, replace(D0, waiting_tokens=50_000)), ask(ttft_s=0.5))
    assert isinstance(got, Refuse) and "TTFT" in got.reason


def test_a_session_stays_where_its_kv_is_until_that_instance_is_overloaded():
    session = SessionHint("tenant/s1")
    stays = route(fleet(B0, replace(B1, queue_depth=1), session_home="b1"), ask(session=session))
    assert stays.instance == "b1" and stays.session_at == "b1" and not stays.session_moved
    assert "stays on b1" in stays.attributes["kvmesh.route.session"]
    moved = route(fleet(B0, replace(B1, queue_depth=5), session_home="b1"), ask(session=session))
    assert moved.instance == "b0" and moved.session_moved and "overloaded" in moved.attributes["kvmesh.route.session"]


def test_a_session_moves_when_the_policy_expects_another_instance_to_serve_it_sooner_its_kv_counted():
    session = SessionHint("tenant/s1")
    busy = replace(B1, queue_depth=1, waiting_tokens=3000)  # 3 s of prompts ahead of it at home
    moved = route(fleet(B0, busy, session_home="b1"), ask(session=session))
    assert moved.instance == "b0" and moved.session_moved
    assert "b0 serves it sooner" in moved.attributes["kvmesh.route.session"]
    # its KV at home (the prompt but one block) outweighs a shorter queue: it stays
    stays = route(fleet(B0, replace(busy, waiting_tokens=1000), session_home="b1", matched={"b1": 99}),
                  ask(session=session))
    assert stays.instance == "b1" and not stays.session_moved
    # a policy that prices nothing keeps the queue-depth rule alone
    rr = route(fleet(B0, busy, session_home="b1"), ask(session=session), policy="round_robin")
    assert rr.instance == "b1"


def test_mixed_engines_pair_only_where_the_decode_takes_the_prefills_layout():
    native, vllm = replace(P0, kv_layout=BF16), replace(D0, kv_layout=FP32)
    local = route(fleet(native, vllm))
    assert isinstance(local, Local) and local.instance == "d0" and "KV layout" in local.reason
    converts = route(fleet(native, replace(vllm, kv_accepts=("bf16",))))
    assert isinstance(converts, PD) and converts.decode == "d0"
    refused = route(fleet(replace(native, kv_layout=FP32), replace(vllm, kv_unconvertible="MLA")))
    assert isinstance(refused, Local) and "KV layout" in refused.reason


def test_a_request_whose_adapter_only_some_decodes_hold_goes_to_one_of_them():
    got = route(fleet(P0, replace(D0, has_lora=False), replace(D1, queue_depth=2)))
    assert isinstance(got, PD) and got.decode == "d1"


def test_without_a_prefill_instance_a_decode_computes_the_prompt():
    got = route(fleet(D0, replace(D1, queue_depth=1)))
    assert isinstance(got, Local) and got.instance == "d0" and got.reason == "local: no prefill instance is up"


def test_nothing_up_plans_nothing():
    assert route(fleet()) is None


def test_without_nats_no_push_is_planned():
    got = route(fleet(P0, D0, bus_up=False))
    assert isinstance(got, Local) and "NATS" in got.reason
