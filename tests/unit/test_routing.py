from kvmesh.contracts.names import RoutingPolicy
from kvmesh.routing import POLICIES, CacheAware, Candidate, CostModel, LeastLoaded, RoundRobin, make_policy

COST = CostModel(prefill_tok_per_s=1000.0, prefill_overhead_s=0.0, fetch_gbps=10.0, block_bytes=1_000_000)


def test_cache_aware_prefers_the_longest_local_prefix():
    cands = [Candidate("a", local_blocks=2), Candidate("b", local_blocks=50), Candidate("c")]
    assert CacheAware(COST).choose(cands, prompt_tokens=1000, block_size=16).chosen.id == "b"


def test_cache_aware_avoids_an_instance_whose_queue_costs_more_than_its_hit():
    cands = [Candidate("hot", local_blocks=50, queued_tokens=3000), Candidate("idle")]
    d = CacheAware(COST).choose(cands, prompt_tokens=1000, block_size=16)
    assert d.chosen.id == "idle" and d.scores["hot"] > d.scores["idle"]


def test_the_pool_makes_every_instance_a_hit_at_the_cost_of_a_fetch():
    cands = [Candidate("a", queued_tokens=100), Candidate("b")]
    with_pool = CacheAware(COST).choose(cands, prompt_tokens=1000, block_size=16, pool_blocks=60)
    local_only = CacheAware(COST, use_pool=False).choose(cands, prompt_tokens=1000, block_size=16, pool_blocks=60)
    assert with_pool.scores["b"] < local_only.scores["b"]


def test_imbalance_guard_balances_before_chasing_the_cache():
    cands = [Candidate("hot", local_blocks=60, queued_tokens=20000), Candidate("cold", queued_tokens=10)]
    policy = CacheAware(CostModel(prefill_tok_per_s=1e9, prefill_overhead_s=0), imbalance_abs_tokens=1000)
    assert policy.choose(cands, prompt_tokens=1000, block_size=16).chosen.id == "cold"


def test_admission_rejects_when_no_instance_meets_the_slo():
    d = CacheAware(COST, slo_ttft_s=0.5).choose([Candidate("a", queued_tokens=5000)], 1000, 16)
    assert d.chosen is None and "SLO" in d.reason


def test_round_robin_cycles_and_least_loaded_takes_the_emptiest():
    cands = [Candidate("a", queued_tokens=5), Candidate("b", queued_tokens=1)]
    rr = RoundRobin()
    assert [rr.choose(cands, 10, 16).chosen.id for _ in range(3)] == ["a", "b", "a"]
    assert LeastLoaded().choose(cands, 10, 16).chosen.id == "b"


def test_unknown_policy_names_the_known_ones():
    import pytest

    with pytest.raises(ValueError, match="cache_aware"):
        make_policy("fastest")


def test_the_registry_is_keyed_on_the_contracts_enum_and_takes_its_strings():
    assert set(POLICIES) == set(RoutingPolicy)
    assert all(type(name) is RoutingPolicy and cls.name is name for name, cls in POLICIES.items())
    assert isinstance(make_policy("round_robin"), RoundRobin)
    slo = make_policy(RoutingPolicy.CACHE_AWARE, cost=COST, slo_ttft_s=0.5)
    assert isinstance(slo, CacheAware) and slo.slo_ttft_s == 0.5


def test_a_requests_own_ttft_target_admits_it_where_the_configured_one_would_not_and_the_reverse():
    busy = [Candidate("a", queued_tokens=5000)]
    assert CacheAware(COST, slo_ttft_s=0.5).choose(busy, 1000, 16, ttft_s=3600).chosen is not None
    refused = CacheAware(COST).choose(busy, 1000, 16, ttft_s=0.5)
    assert refused.chosen is None and "TTFT SLO of 0.5s" in refused.reason
