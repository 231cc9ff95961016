"""Eviction strategies' orderings, the eviction queue, and the simulator's Belady against a brute-force optimum."""

import itertools

import pytest
from kvmesh.contracts.names import Eviction
from kvmesh.engine.eviction import (
    LFU,
    LRU,
    POLICIES,
    SLRU,
    Belady,
    Duel,
    Ghost,
    PriorityLRU,
    TailFirst,
    make_policy,
    online_policies,
)
from kvmesh.engine.eviction_queue import EvictionQueue

from app.bench.eviction import Block as B
from app.bench.trace import TraceRequest
from app.sim import BlockCache, next_uses


def order(policy, blocks, now=100.0):
    q = EvictionQueue(policy)
    for b in blocks:
        q.push(b, now)
    return [q.pop(now) for _ in blocks]


def test_lru_evicts_the_least_recent_first():
    a, b, c = B(3), B(1), B(2)
    assert order(LRU(), [a, b, c]) == [b, c, a]


def test_lfu_evicts_the_least_hit_first():
    a, b = B(1, hit_count=3), B(2, hit_count=0)
    assert order(LFU(), [a, b]) == [b, a]


def test_slru_protects_blocks_hit_twice():
    a, b = B(1, hit_count=2), B(2, hit_count=1)
    assert order(SLRU(), [a, b]) == [b, a]


def test_tailfirst_evicts_an_unextended_tail_before_older_blocks():
    p = TailFirst()
    p.eviction_age = 10.0
    tail, old_mid = B(5, extended=False), B(1)
    assert order(p, [old_mid, tail]) == [tail, old_mid]


def test_tailfirst_hits_buy_a_longer_but_bounded_stay():
    p = TailFirst()
    p.eviction_age = 10.0
    hit, fresh, ancient_hit = B(5, hit_count=1), B(5), B(-100, hit_count=4)
    assert order(p, [hit, fresh, ancient_hit]) == [ancient_hit, fresh, hit]


def test_tailfirst_learns_the_eviction_age_online():
    p = TailFirst(smoothing=0.5)
    p.on_evict(B(0), 8.0)
    assert p.eviction_age == 4.0


def test_belady_evicts_the_farthest_next_use_and_the_deeper_block_on_ties():
    near, far, head, tail = B(0, next_use=3), B(0, next_use=9), B(0, next_use=5), B(0, depth=2, next_use=5)
    assert order(Belady(), [near, far, head, tail]) == [far, tail, head, near]


def test_belady_is_refused_outside_the_simulator():
    with pytest.raises(ValueError, match="needs the future"):
        make_policy("belady")
    from kvmesh.settings import EngineSettings

    with pytest.raises(ValueError, match="kvmesh sim"):
        EngineSettings(eviction="belady")


def test_the_registry_is_keyed_on_the_contracts_enum_and_takes_its_strings():
    assert set(POLICIES) == set(Eviction)
    assert all(type(name) is Eviction and cls.name is name for name, cls in POLICIES.items())
    assert online_policies() == list(Eviction.online()) and Eviction.BELADY not in online_policies()
    assert isinstance(make_policy("slru"), SLRU) and isinstance(make_policy(Eviction.SLRU), SLRU)
    assert isinstance(make_policy("belady", online=False), Belady)
    with pytest.raises(ValueError, match=r"eviction 'fifo' is unknown; choose one of \['duel', 'ghost', "):
        make_policy("fifo")


def test_queue_skips_ineligible_items_and_forgets_discarded_ones():
    a, b, c = B(1), B(2), B(3)
    q = EvictionQueue(LRU())
    for x in (a, b, c):
        q.push(x, 0)
    q.discard(a)
    assert q.pop(0, eligible=lambda x: x is not b) is c and len(q) == 0


def test_queue_ranks_an_item_again_when_its_priority_ends():
    held, fresh = B(1, priority=5, priority_until=10.0), B(2)  # a system prompt kept 10 s, then a newer block
    q = EvictionQueue(PriorityLRU())
    for x in (held, fresh):
        q.push(x, 0)
    assert q.pop(5) is fresh  # within its retention the old one stays
    q.push(fresh, 5)
    assert q.pop(11) is held  # past it, it is the least recently used again (pushed before its retention ended)


def _replay(trace, cache):
    hits = total = 0
    future = next_uses(trace)
    for n, r in enumerate(trace):
        h = cache.prefix(r.hash_ids)
        hits, total = hits + h, total + len(r.hash_ids)
        cache.touch(r.hash_ids, h, future[n])
    return hits


def _brute_force(trace, capacity):
    """Best total hits over every choice of what to keep after each request (prefix hits)."""
    best = {frozenset(): 0}
    for r in trace:
        nxt = {}
        for kept, score in best.items():
            h = 0
            for i in r.hash_ids:
                if i not in kept:
                    break
                h += 1
            pool = sorted(kept | set(r.hash_ids))
            for k in range(min(capacity, len(pool)) + 1):
                for keep in itertools.combinations(pool, k):
                    s = frozenset(keep)
                    nxt[s] = max(nxt.get(s, -1), score + h)
        best = nxt
    return max(best.values())


def test_ghost_puts_new_blocks_on_probation_behind_reused_ones():
    p = Ghost()
    p.eviction_age = 10.0
    # A block never reused stays 0.1 x the eviction age (its tail: 0), a reused one (1 + r) x.
    tail, new, old_hit = B(5, extended=False, key=1), B(5, key=2), B(1, hit_count=1, key=3)
    assert order(p, [old_hit, new, tail]) == [tail, new, old_hit]


def test_ghost_remembers_evicted_blocks_and_promotes_them_when_they_return():
    p = Ghost(smoothing=0.0)
    p.eviction_age = 10.0
    p.on_evict(B(0, hit_count=1, key=7), 20.0)   # used twice before it went
    assert p.ghost[7] == 2
    back, stranger = B(5, key=7), B(8, key=8)     # both just re-inserted, neither hit in this life
    assert order(p, [back, stranger]) == [stranger, back]
    assert p.sort_key(back, 5)[0] == 5 + 3 * 10.0
    p.on_evict(B(0, key=7), 30.0)                # counts accumulate over lives
    assert p.ghost[7] == 3


def test_ghost_list_is_bounded_fifo_and_keyless_blocks_rank_on_hits():
    p = Ghost(ghost_blocks=2)
    for k in (1, 2, 3):
        p.on_evict(B(0, key=k), 1.0)
    assert list(p.ghost) == [2, 3]
    p.on_evict(B(0), 1.0)                        # no key (cachesvc): nothing to remember
    assert list(p.ghost) == [2, 3]
    p.eviction_age = 10.0
    assert order(p, [B(1, hit_count=1), B(5)])[0].hit_count == 0


def test_simulator_belady_matches_the_brute_force_optimum_on_a_tiny_trace():
    ids = [(0, 1, 2), (0, 3), (0, 1, 4), (0, 3, 5), (0, 1, 2), (0, 3, 5), (0, 1, 4)]
    trace = [TraceRequest(n, 512 * len(x), 1, x) for n, x in enumerate(ids)]
    for capacity in (2, 3, 4):
        assert _replay(trace, BlockCache(capacity, "belady")) == _brute_force(trace, capacity)


def _sampled_key(duel):
    """A key that ``duel`` replays into its shadow caches."""
    return next(k for k in itertools.count() if not (hash(k) * 2654435761) >> 7 & duel.mask)


def test_duel_ranks_by_the_baseline_until_the_candidate_proves_better():
    duel = Duel()
    old, tail = B(1, key=1), B(5, extended=False, key=2)
    assert duel.experts[duel.winner].name == "lru"
    assert order(duel, [old, tail]) == [old, tail]  # lru: the least recent first (ghost: the tail first)


def test_duel_switches_to_the_candidate_when_its_shadow_catches_more_hits():
    # One chain [0, 1, 2] asked again and again, each time with a fresh tail, in a cache of 3 blocks: LRU's
    # shadow evicts the chain's head for the tail (then misses it all), ghost's evicts the tail.
    cache = BlockCache(3, "duel")
    duel = cache.strategy
    duel.mask = 0  # sample every block: the shadows are as large as the cache
    for n in range(40):
        ids = (0, 1, 2, 100 + n)
        cache.touch(ids, cache.prefix(ids))
    ghost, lru = duel.shadows
    assert ghost.score > lru.score
    assert duel.experts[duel.winner].name == "ghost" and duel.epoch == 1
    assert cache.prefix((0, 1, 2, 999)) == 3  # the real cache now keeps the chain


def test_duel_forgets_evicted_blocks_and_skips_keyless_ones():
    duel = Duel()
    k = _sampled_key(duel)
    b = B(1, key=k)
    duel.sort_key(b, 1)
    assert k in duel.sampled
    duel.on_evict(b, 2)
    assert k not in duel.sampled
    duel.sort_key(B(3), 3)       # no key (cachesvc): ranked, not sampled
    assert not duel.sampled


def test_queue_reranks_everything_when_the_strategy_bumps_its_epoch():
    class Flip(LRU):
        dynamic, epoch, newest_first = True, 0, False

        def sort_key(self, item, now):
            return (-item.last_access,) if self.newest_first else (item.last_access,)

    p = Flip()
    q = EvictionQueue(p)
    a, b, c = B(1), B(2), B(3)
    for x in (a, b, c):
        q.push(x, 0)
    p.newest_first, p.epoch = True, 1
    assert [q.pop(0) for _ in range(3)] == [c, b, a]


def test_queue_reranks_a_few_items_per_pop_after_an_epoch_change(monkeypatch):
    import kvmesh.engine.eviction_queue as eq

    monkeypatch.setattr(eq, "RERANK_PER_POP", 2)
    q = EvictionQueue(LRU())
    blocks = [B(float(i)) for i in range(10)]
    for x in blocks:
        q.push(x, 0)
    q.policy.epoch = 1
    assert q.pop(0) is blocks[0] and len(q._stale) == 8  # 2 of the 10 re-ranked


def test_fluid_bound_of_one_block_used_every_request_is_every_reuse():
    from app.bench.eviction_bound import accesses, bound

    trace = [TraceRequest(n, 512, 1, (0,)) for n in range(10)]
    gaps, seen = accesses(trace)
    assert bound(gaps, seen, "-", capacity=1)[0] == pytest.approx(0.9)


def test_fluid_bound_grows_with_what_a_feature_tells_and_stays_under_the_infinite_cache():
    from app.bench.eviction_bound import accesses, bound

    # Chains 1..6 each asked twice, far apart, among one-off chains: a small cache keeps them only if it knows.
    ids = [(0, 100 + n, 200 + n) for n in range(40)]
    ids = ids[:20] + [(0, 1, 2), (0, 3, 4), (0, 5, 6)] + ids[20:] + [(0, 1, 2), (0, 3, 4), (0, 5, 6)]
    trace = [TraceRequest(n, 512 * len(x), 1, x) for n, x in enumerate(ids)]
    gaps, seen = accesses(trace)
    blind, oracle = bound(gaps, seen, "-", 8)[0], bound(gaps, seen, "R", 8)[0]
    infinite = sum(g < float("inf") for g in gaps) / len(gaps)
    assert blind < oracle <= infinite + 1e-9
