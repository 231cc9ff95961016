"""Hit attribution (kvmesh.routing.hits): every missed prompt token gets exactly one cause, from what the router
knew when it routed and the KV events it heard."""

from __future__ import annotations

import random

from kvmesh.routing.hits import (
    POOL,
    BlockHistory,
    Cause,
    Explainer,
    RouteView,
    attribute,
    belady_hits,
    infinite_cache_hits,
)

BS = 4
KEYS = [101, 102, 103, 104]


def _why(view: RouteView, history: BlockHistory | None = None, prompt: int = 18, delivered: int = 0):
    h = history or BlockHistory()
    return attribute(prompt, BS, KEYS, delivered, Explainer(view, h, KEYS),
                     view.predicted_blocks() * BS, view.compute)


def test_causes_add_up_to_the_missed_tokens_for_any_prompt_and_delivered_hit():
    rng = random.Random(0)
    causes = list(Cause)
    for _ in range(500):
        prompt, bs = rng.randint(1, 80), rng.randint(1, 16)
        keys = list(range(prompt // bs))
        delivered = rng.randint(0, prompt)
        att = attribute(prompt, bs, keys, delivered, lambda i, k: (rng.choice(causes), ""))
        assert sum(m.tokens for m in att.misses) == prompt - delivered == att.missed_tokens


def test_the_tail_past_the_last_full_block_and_the_last_token_are_the_partial_block():
    att = _why(RouteView("a", {"a": 4}), prompt=18, delivered=16)
    assert att.by_cause() == {"partial_block": 2}
    aligned = _why(RouteView("a", {"a": 4}), prompt=16, delivered=15)
    assert aligned.by_cause() == {"partial_block": 1}


def test_a_block_no_one_stored_was_never_computed():
    att = _why(RouteView("a", {}))
    assert att.by_cause() == {"never_computed": 16, "partial_block": 2}


def test_a_block_removed_from_an_instance_was_evicted_and_says_where():
    h = BlockHistory(clock=lambda: 100.0)
    h.stored("b", "device", KEYS)
    h.removed("b", "device", KEYS[2:], at=95.0)
    att = _why(RouteView("a", {"b": 2}, at=100.0), h, delivered=0)
    assert att.by_cause()["evicted"] == 8
    assert any("b's device tier 5.00 s before the route" in line for line in att.lines())


def test_a_block_held_on_another_instance_was_routed_elsewhere_with_the_plans_reason():
    att = _why(RouteView("a", {"b": 4}, reason="least estimated TTFT: b is busy"))
    assert att.by_cause()["routed_elsewhere"] == 16
    assert "b is busy" in att.lines()[0]


def test_a_block_stored_after_the_route_is_index_lag():
    h = BlockHistory()
    h.stored("b", "device", KEYS, at=10.5)
    att = _why(RouteView("a", {}, at=10.0), h)
    assert att.by_cause()["index_lag"] == 16


def test_the_chosen_instances_own_stores_after_the_route_are_not_lag():
    h = BlockHistory()
    h.stored("a", "device", KEYS, at=10.5)
    assert _why(RouteView("a", {}, at=10.0), h).by_cause()["never_computed"] == 16


def test_tokens_seen_under_another_namespace_are_the_namespace_cause():
    att = _why(RouteView("a", {}, other_namespaces=lambda i: 1))
    assert att.by_cause()["namespace"] == 16


def test_a_pool_hit_not_fetched_is_a_fetch_failure_skip_or_layout():
    failed = _why(RouteView("a", {POOL: 4}, pool_outcome="failed: refused"))
    assert failed.by_cause()["fetch_failed"] == 16 and "refused" in failed.lines()[0]
    skipped = _why(RouteView("a", {POOL: 4}, pool_outcome="below pool_fetch_min_blocks"))
    assert skipped.by_cause()["fetch_skipped"] == 16
    layout = _why(RouteView("a", {POOL: 4}, unconvertible="fp8 KV"))
    assert layout.by_cause()["layout"] == 16 and layout.predicted_tokens == 0


def test_a_predicted_block_the_instance_no_longer_had_is_a_stale_index():
    att = _why(RouteView("a", {"a": 4}), delivered=8)
    assert att.predicted_tokens == 16 and att.by_cause() == {"stale_index": 8, "partial_block": 2}


def test_a_failed_hand_off_blames_the_blocks_prefill_would_have_reused():
    att = _why(RouteView("p", {"p": 2}, fallback="kv.ready timed out"))
    assert att.by_cause() == {"fetch_failed": 8, "never_computed": 8, "partial_block": 2}


def test_the_infinite_cache_serves_every_block_any_earlier_request_had():
    stream = [([1, 2], 10), ([1, 2, 3], 13), ([9], 4), ([1, 2], 8)]
    assert infinite_cache_hits(stream, 4) == [0, 8, 0, 7]


def test_a_block_held_past_a_gap_in_its_chain_was_evicted_with_the_gap():
    h = BlockHistory()
    h.stored("b", "device", KEYS, at=1.0)
    h.removed("b", "device", KEYS[1:2], at=2.0)
    att = _why(RouteView("a", {"b": 1}, at=3.0), h)
    assert att.by_cause() == {"routed_elsewhere": 4, "evicted": 12, "partial_block": 2}
    assert "block 1 of its prefix, from b's device tier" in att.lines()[2]


def test_beladys_cache_keeps_the_block_used_soonest():
    stream = [([1], 5), ([2], 5), ([1], 5), ([2], 5), ([1], 5)]
    assert belady_hits(stream, 4, 1) == [0, 0, 4, 0, 4]  # 1 is used again sooner than 2 each time
    assert belady_hits(stream, 4, 2) == infinite_cache_hits(stream, 4)
