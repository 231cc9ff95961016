"""Routing a large fleet: the cache-aware estimates computed as arrays are the scalar ones to the bit, the choice
is the same, and a span names a bounded number of candidates (and how many there were)."""

import dataclasses
import random

import pytest
from kvmesh.routing import CostModel
from kvmesh.routing.plan import LISTED, FleetView, InstanceView, RouteAsk, plan
from kvmesh.routing.policies import SPEEDS_LISTED, VECTOR_FROM, CacheAware, Candidate


def fleet_of(n: int, seed: int) -> list[Candidate]:
    rng = random.Random(seed)
    base = CostModel()
    out = []
    for i in range(n):
        cost = None
        if rng.random() < 0.5:  # some calibrated on the instance: their own speed, overhead, block size, lora load
            cost = dataclasses.replace(base, prefill_tok_per_s=rng.uniform(50, 5000), calibrated=True,
                                       prefill_overhead_s=rng.uniform(0, 0.1), block_bytes=rng.randint(1, 10**6),
                                       lora_load_s=rng.uniform(0, 1))
        out.append(Candidate(f"i{i:04d}", queued_tokens=rng.choice([0, 0, rng.randint(0, 20000)]),
                             running=rng.randint(0, 8), local_blocks=rng.choice([0, rng.randint(0, 300)]),
                             cost=cost, lora_missing=rng.random() < 0.1, share=rng.choice([1.0, rng.uniform(0.1, 1)]),
                             pool=rng.random() < 0.8, step_left_s=rng.choice([0.0, rng.uniform(0, 0.1)])))
    return out


@pytest.mark.parametrize("use_pool", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_array_estimates_are_the_scalar_ones(seed, use_pool):
    policy = CacheAware(CostModel(), use_pool=use_pool)
    candidates = fleet_of(VECTOR_FROM * 8, seed)
    for prompt, pool_blocks in ((4096, 0), (4096, 200), (1, 0), (17, 1), (100000, 5000)):
        got = policy.estimates(candidates, prompt, 16, pool_blocks)
        assert got == [policy.estimate(c, prompt, 16, pool_blocks) for c in candidates]


@pytest.mark.parametrize("seed", range(8))
def test_a_large_fleet_is_chosen_as_one_candidate_at_a_time_would_choose(seed):
    policy = CacheAware(CostModel())
    candidates = fleet_of(300, seed)
    if seed % 2:  # ties: several equally good, broken by queue then id
        for c in candidates[::7]:
            c.queued_tokens, c.local_blocks, c.cost, c.share, c.lora_missing = 0, 300, None, 1.0, False
    decision = policy.choose(candidates, 4096, 16, 50)
    scores = {c.id: policy.estimate(c, 4096, 16, 50) for c in candidates}
    loads = [c.queued_tokens for c in candidates]
    if max(loads) - min(loads) > policy.imbalance_abs_tokens and max(loads) > policy.imbalance_rel * max(1, min(loads)):
        expected = min(candidates, key=lambda c: (c.queued_tokens, scores[c.id], c.id))
    else:
        expected = min(candidates, key=lambda c: (scores[c.id], c.queued_tokens, c.id))
    assert decision.chosen is expected and decision.scores == scores
    named = decision.reason.split("prefill tok/s: ")[1]
    assert f"{expected.id}=" in named and named.count("=") == SPEEDS_LISTED
    assert f"({SPEEDS_LISTED} of 300: the chosen, the lowest estimates)" in named


def test_a_small_fleet_names_every_speed():
    policy = CacheAware(CostModel())
    decision = policy.choose(fleet_of(3, 1), 4096, 16, 0)
    assert decision.reason.split("prefill tok/s: ")[1].count("=") == 3 and " of 3" not in decision.reason


def views(n: int) -> tuple[InstanceView, ...]:
    rng = random.Random(n)
    return tuple(InstanceView(f"i{i:04d}", "both", queue_depth=rng.randint(0, 8),
                              waiting_tokens=rng.choice([0, rng.randint(0, 8192)])) for i in range(n))


def test_a_span_names_the_chosen_and_the_best_of_a_large_fleet_and_how_many_there_were():
    fleet = FleetView(views(200), {"i0150": 200, "i0007": 100}, 16, CostModel())
    planned = plan(RouteAsk(4096, "cache_aware"), fleet, CacheAware(CostModel()))
    a = planned.attributes
    assert len(a["kvmesh.route.both.candidates"]) == LISTED == len(a["kvmesh.route.both.scores"])
    assert len(a["kvmesh.route.both.estimates"]) == LISTED
    assert a["kvmesh.route.both.candidates_total"] == 200
    assert a["kvmesh.route.both.choice"] in a["kvmesh.route.both.candidates"]
    small = plan(RouteAsk(4096, "cache_aware"), FleetView(views(5), {}, 16, CostModel()), CacheAware(CostModel()))
    assert len(small.attributes["kvmesh.route.both.candidates"]) == 5
    assert "kvmesh.route.both.candidates_total" not in small.attributes


@pytest.mark.parametrize("n", [5, 200])
def test_without_explaining_the_choice_is_the_same_and_no_candidate_is_listed(n):
    fleet = FleetView(views(n), {"i0003": 50}, 16, CostModel())
    full = plan(RouteAsk(4096, "cache_aware"), fleet, CacheAware(CostModel()))
    bare = plan(RouteAsk(4096, "cache_aware", explain=False), fleet, CacheAware(CostModel()))
    assert (bare.instance, bare.reason) == (full.instance, full.reason)
    assert bare.attributes["kvmesh.route.both.reason"] == full.attributes["kvmesh.route.both.reason"]
    assert not any(k.endswith((".candidates", ".scores", ".estimates")) for k in bare.attributes)
