"""Hit attribution (kvmesh.routing.hits): every missed prompt token gets exactly one cause, from what the router
knew when it routed and the KV events it heard."""

from __future__ import annotations

import random
from functools import partial

from kvmesh.routing.hits import (
    POOL,
    BlockHistory,
    Cause,
    Explainer,
    Namespaces,
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
    att = _why(RouteView("a", {}, other_namespaces=lambda lo, hi: dict.fromkeys(range(lo, hi), 1)))
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


# -- the per-block rule, written out plainly: the Explainer and attribute (which keep what is constant across a
# prompt's blocks, and the open run in locals) must give its answers exactly ------------------------------------

def _reference_cause(view: RouteView, history: BlockHistory, keys: list[int], i: int) -> tuple[Cause, str]:
    at, key = view.compute, keys[i]
    here_index, here_recent = view.indexed.get(at, 0) > i, view.recent.get(at, 0) > i
    pool = view.indexed.get(POOL, 0) > i

    def when(t: float) -> str:
        d = view.at - t
        return f"{d:.2f} s before the route" if d >= 0 else f"{-d:.2f} s after the route"

    def run_on(inst: str) -> int:
        n = 0
        while n < len(keys) and any(h.instance == inst for h in history.holders(keys[n])):
            n += 1
        return n

    if view.fallback and (here_index or here_recent or pool):
        return Cause.FETCH_FAILED, f"the hand-off to decode failed ({view.fallback}); decode recomputed"
    if here_index or here_recent:
        gone = history.last_removal(key)
        if gone is not None and gone.instance == at:
            return Cause.EVICTED, f"from {at}'s {gone.tier_and_why()} {when(gone.at)}"
        if not here_index:
            return Cause.INDEX_LAG, f"an earlier request sent to {at} had not stored it yet"
        return Cause.STALE_INDEX, f"the index listed it on {at}"
    if pool:
        if view.unconvertible:
            return Cause.LAYOUT, f"in the pool; {at}: {view.unconvertible}"
        if view.pool_outcome.startswith(("local cache suffices", "below pool_fetch_min_blocks")):
            return Cause.FETCH_SKIPPED, f"in the pool; {at}: {view.pool_outcome}"
        return Cause.FETCH_FAILED, f"in the pool; fetch: {view.pool_outcome or 'not attempted'}"
    elsewhere = sorted(x for x in {*view.indexed, *view.recent}
                       if x not in (at, POOL) and max(view.indexed.get(x, 0), view.recent.get(x, 0)) > i)
    if elsewhere:
        return Cause.ROUTED_ELSEWHERE, f"held on {', '.join(elsewhere)}; routed to {at}: {view.reason or 'plan'}"
    holders = [h for h in history.holders(key) if h.instance != at or h.at < view.at]
    lag = [h for h in holders if run_on(h.instance) > i]
    if lag:
        h = min(lag, key=lambda h: h.at)
        return Cause.INDEX_LAG, f"stored on {h.instance} ({h.tier}) {when(h.at)}, not in the index then"
    for h in holders:
        gap = run_on(h.instance)
        gone = history.last_removal(keys[gap])
        if gone is not None and gone.instance == h.instance:
            return Cause.EVICTED, (f"block {gap} of its prefix, from {h.instance}'s {gone.tier_and_why()} "
                                   f"{when(gone.at)}")
    gone = history.last_removal(key)
    if gone is not None:
        return Cause.EVICTED, f"from {gone.instance}'s {gone.tier_and_why()} {when(gone.at)}"
    others = view.other_namespaces(i, i + 1).get(i, 0)
    if others:
        return Cause.NAMESPACE, f"the same tokens are cached under {others} other namespace(s)"
    return Cause.NEVER_COMPUTED, ""


def _reference_runs(prompt: int, bs: int, keys: list[int], delivered: int, cause_of) -> list[tuple]:
    """Each missed token's (cause, words) in order, runs of equal ones merged: (cause, tokens, first, last, words)."""
    delivered = max(0, min(delivered, prompt))
    full = min(len(keys), prompt // bs)
    partial_from = min(full * bs, prompt - 1) if prompt else 0
    per_token = [(cause_of(t // bs), t // bs) if t < partial_from else ((Cause.PARTIAL_BLOCK, ""), full)
                 for t in range(delivered, prompt)]
    runs: list[list] = []
    for (cause, words), block in per_token:
        if runs and runs[-1][0] == cause and runs[-1][4] == words:
            runs[-1][1] += 1
            runs[-1][3] = block
        else:
            runs.append([cause, 1, block, block, words])
    return [tuple(r) for r in runs]


def test_attribution_equals_the_per_block_rule_on_random_fleets_and_histories():
    rng = random.Random(7)
    instances = ["a", "b", "c"]
    for _ in range(2000):
        bs = rng.choice([1, 4, 16])
        keys = [rng.randrange(40) for _ in range(rng.randrange(0, 16))]
        prompt = rng.randrange(0, (len(keys) + 1) * bs + 1)
        history = BlockHistory(max_keys=rng.choice([6, 1000]))
        for _ in range(rng.randrange(0, 30)):
            inst, tier, t = rng.choice(instances), rng.choice(["device", "host"]), rng.uniform(0, 10)
            ks = [rng.choice(keys) if keys and rng.random() < 0.7 else rng.randrange(80)
                  for _ in range(rng.randint(1, 4))]
            if rng.random() < 0.6:
                history.stored(inst, tier, ks, t)
            else:
                history.removed(inst, tier, ks, t, rng.choice(["", "lru"]))
        view = RouteView(
            rng.choice(instances),
            {x: rng.randrange(len(keys) + 2) for x in rng.sample([*instances, POOL], rng.randrange(5))},
            {x: rng.randrange(len(keys) + 2) for x in rng.sample(instances, rng.randrange(4))},
            rng.choice(["", "cheapest"]), rng.uniform(0, 10),
            rng.choice(["", "adopted", "failed: refused", "local cache suffices"]), rng.choice(["", "", "reset"]),
            rng.choice(["", "", "another layout"]),
            rng.choice([lambda lo, hi: {}, lambda lo, hi: {i: i % 3 for i in range(lo, hi) if i % 3}]))
        delivered = rng.randrange(-2, prompt + 3)
        got = attribute(prompt, bs, keys, delivered, Explainer(view, history, keys))
        want = _reference_runs(prompt, bs, keys, delivered, partial(_reference_cause, view, history, keys))
        assert [(m.cause, m.tokens, m.first_block, m.last_block, m.detail) for m in got.misses] == want


def test_namespaces_shared_over_a_range_counts_each_blocks_other_namespaces():
    rng = random.Random(3)
    ns = Namespaces(max_keys=50)
    plain = [rng.randrange(30) for _ in range(40)]
    for _ in range(60):
        ns.saw(rng.sample(plain, 5), rng.randrange(4))
    for seed in range(5):
        for lo, hi in [(0, 40), (7, 19), (35, 60), (10, 10)]:
            others = {i: len(ns.seeds(plain[i]) - {seed}) for i in range(lo, min(hi, len(plain)))}
            want = {i: n for i, n in others.items() if n}
            assert ns.shared(plain, seed, lo, hi) == want


def test_namespaces_keep_what_was_seen_lately_within_their_bound():
    ns = Namespaces(max_keys=10)
    ns.saw(range(5), 1)  # the newer generation full: it becomes the older one
    ns.saw([0], 2)  # seen again: back in the newer one, with both seeds
    ns.saw(range(100, 104), 1)  # full again: 1-4 go, 0 stays
    assert len(ns) <= 10 and ns.seeds(0) == {1, 2} and ns.seeds(1) == set() and ns.seeds(103) == {1}
    for k in range(50):
        ns.saw([k, 1000 + k], k % 3)
        assert len(ns) <= 10 + 1  # the bound, and a prompt's keys more at most
