"""Routing that knows LoRA adapters: an instance that holds the request's adapter (and its KV) wins; loading the
adapter where it is missing is priced, so a much shorter queue elsewhere can still win; the router's view of who
holds what comes from heartbeats (name, generation, path)."""

from kvmesh.contracts.messages import Heartbeat, InstanceLoad
from kvmesh.proto.v1 import worker_pb2
from kvmesh.routing import CacheAware, Candidate, CostModel

from services.router.loras import Adapters
from services.router.registry import Registry
from services.router.scheduling import Policies

COST = CostModel(prefill_tok_per_s=1000.0, prefill_overhead_s=0.0, lora_load_s=0.3)


def test_cache_aware_prices_loading_a_missing_adapter():
    cands = [Candidate("holder", queued_tokens=100), Candidate("bare", lora_missing=True)]
    d = CacheAware(COST).choose(cands, prompt_tokens=200, block_size=16)
    assert d.chosen.id == "holder"
    assert abs(d.scores["bare"] - d.scores["holder"] - (0.3 - 0.1)) < 1e-9
    busy = [Candidate("holder", queued_tokens=2000), Candidate("bare", lora_missing=True)]
    assert CacheAware(COST).choose(busy, prompt_tokens=200, block_size=16).chosen.id == "bare"


def test_the_measured_load_time_from_heartbeats_overrides_the_configured_one():
    assert CostModel.from_load(InstanceLoad(lora_load_s=0.02), COST).lora_load_s == 0.02


def beat(iid: str, loras=(), ts: float = 0.0) -> Heartbeat:
    return Heartbeat(instance_id=iid, role="both", grpc_address=f"{iid}:1", transfer_address="", ts=ts,
                     load=InstanceLoad(), model="fp", block_size=16, loras=tuple(loras))


def test_heartbeats_carry_adapters_and_round_trip():
    b = beat("a", [("sql", "abc", "/x/sql")])
    assert Heartbeat.decode(b.encode()).loras == (("sql", "abc", "/x/sql"),)
    old = Heartbeat.decode(beat("a").encode().replace(b',"loras":[]', b""))  # an engine from before adapters
    assert old.loras == ()


def test_router_view_of_adapters_and_policies_prefer_holders():
    reg = Registry(30.0, 16, "fp")
    reg.observe(beat("a", [("sql", "g1", "/p")]))
    reg.observe(beat("b"))
    reg.observe(beat("c", [("sql", "g1", "/p"), ("chat", "g7", "/q")]))
    view = Adapters(lambda: reg, lambda addr: None)
    assert view.served() == {"chat": ("g7", "/q"), "sql": ("g1", "/p")}
    assert view.lora_id("sql") == "sql@g1"
    insts = {i.id: i for i in reg.alive()}
    assert [view.holds(insts[i], "sql") for i in "abc"] == [True, False, True]
    missing = {i for i in "abc" if not view.holds(insts[i], "sql")}
    policies = Policies("least_loaded", COST, 0.0)
    for _ in range(5):  # least-loaded never sends an adapter's request to the instance lacking it
        chosen, _ = policies.choose(None, list(insts.values()), {}, 100, 16, 0, missing)
        assert chosen.id in ("a", "c")
    chosen, d = policies.choose("cache_aware", list(insts.values()), {"c": 5}, 100, 16, 0, missing)
    assert chosen.id == "c" and d.scores["b"] > d.scores["a"]


def test_a_heartbeat_built_before_an_unload_reply_does_not_bring_the_adapter_back():
    reg = Registry(30.0, 16, "fp")
    reg.observe(beat("a", [("tmp", "g1", "/t")], ts=10.0))
    view = Adapters(lambda: reg, lambda addr: None)
    stale = reg.alive()[0]
    reg.observe(beat("a", [("tmp", "g1", "/t")], ts=11.0))  # arrived while the unload call was out
    view._update(stale, worker_pb2.LoRAAdapters(ts=11.5))  # the reply: nothing served, listed at 11.5
    assert view.served() == {}
    reg.observe(beat("a", [("tmp", "g1", "/t")], ts=11.2))  # built before the unload, delivered after
    assert view.served() == {}
    reg.observe(beat("a", [("sql", "g2", "/s")], ts=12.0))  # newer heartbeats are the truth again
    assert view.served() == {"sql": ("g2", "/s")}
