"""The cachesvc shard map (kvmesh.contracts.shards) and sharded MatchPrefix: N shards' answers, combined, are what
one unsharded index answers; with a shard gone, never more than it, and exact for the keys the others own."""

import random
from collections import Counter

import pytest
from kvmesh.contracts.events import BlockRemoved, BlockStored
from kvmesh.contracts.messages import KVEventBatch
from kvmesh.contracts.shards import POOL, SLOTS, ShardMap, at, combine, leading_ones

from services.cachesvc.index import BlockIndex


def test_slots_spread_evenly_and_each_key_has_distinct_index_owners():
    smap = ShardMap(3, copies=2)
    first = Counter(smap.rank(slot)[0] for slot in range(SLOTS))
    assert set(first) == {0, 1, 2}
    assert all(abs(n - SLOTS / 3) < 0.1 * SLOTS / 3 for n in first.values()), first
    for slot in range(SLOTS):
        owners = smap.index_owners(slot)
        assert len(owners) == 2 and len(set(owners)) == 2
        assert smap.pool_owners(slot) == owners[:1]
    assert ShardMap(2, copies=5).copies == 2  # never more copies than shards


def test_adding_a_shard_moves_about_one_in_n_plus_one_of_the_keys():
    before, after = ShardMap(4), ShardMap(5)
    moved = [slot for slot in range(SLOTS) if before.pool_owners(slot) != after.pool_owners(slot)]
    assert all(after.pool_owners(slot) == (4,) for slot in moved)  # only to the new shard, never between old ones
    assert abs(len(moved) / SLOTS - 1 / 5) < 0.03


def test_bad_maps_are_refused():
    with pytest.raises(ValueError, match="at least one shard"):
        ShardMap(0)
    with pytest.raises(ValueError, match="at least one copy"):
        ShardMap(2, copies=0)
    with pytest.raises(ValueError, match="at least one copy"):
        ShardMap(2, pool_copies=0)


def test_at_places_a_run_of_own_keys_in_the_whole_list():
    assert at([1, 4, 6], 0, 9) == 1
    assert at([1, 4, 6], 2, 9) == 6
    assert at([1, 4, 6], 3, 9) == 9


def test_leading_ones():
    assert [leading_ones(m) for m in (0, 1, 0b10, 0b111, 0b1011)] == [0, 1, 0, 3, 2]


def test_pool_copies_put_each_block_on_distinct_shards():
    smap = ShardMap(3, pool_copies=2)
    parts = smap.split_pool(list(range(SLOTS)))
    assert sum(len(p) for p in parts.values()) == 2 * SLOTS
    assert all(len(set(smap.pool_owners(k))) == 2 for k in range(SLOTS))
    assert {s: len(p) for s, p in smap.split_pool(list(range(SLOTS)), copy=1).items()}.keys() == {0, 1, 2}


class World:
    """Random prompts (key chains sharing prefixes), instances holding leading runs of them in two tiers, and a
    pool holding leading runs too (its copies on each shard, one copy now and then lost); fed to one unsharded
    index and to each shard's."""

    def __init__(self, seed: int, shards: int, copies: int = 2, pool_copies: int = 1) -> None:
        rng = random.Random(seed)
        self.smap = ShardMap(shards, copies, pool_copies)
        trunks = [[rng.getrandbits(64) for _ in range(rng.randint(1, 12))] for _ in range(4)]
        self.prompts = [trunk + [rng.getrandbits(64) for _ in range(rng.randint(0, 30))]
                        for trunk in trunks for _ in range(3)]
        self.whole = BlockIndex()
        self.shard_index = [BlockIndex(self.smap.index_slots(s)) for s in range(shards)]
        for i in range(6):
            events = []
            for prompt in rng.sample(self.prompts, 4):
                events.append(BlockStored(tuple(prompt[:rng.randint(0, len(prompt))]), None, 16,
                                          rng.choice(["device", "host"])))
            if rng.random() < 0.5:  # some evicted again, from the middle of a run too
                victim = rng.choice(self.prompts)
                events.append(BlockRemoved(tuple(victim[rng.randint(0, len(victim) - 1):]), "device"))
            batch = KVEventBatch(f"i{i}", 1, 0.0, tuple(events))
            for index in (self.whole, *self.shard_index):
                index.apply(batch)
        self.pooled = [set() for _ in range(shards)]  # what each shard's pool holds
        for prompt in rng.sample(self.prompts, 5):
            for key in prompt[:rng.randint(0, len(prompt))]:
                owners = self.smap.pool_owners(key)
                kept = [s for s in owners if rng.random() < 0.8] if len(owners) > 1 else list(owners)
                for s in kept:
                    self.pooled[s].add(key)

    def truth(self, keys: list[int], live: set[int] | None = None) -> set[tuple[str, str, int]]:
        """One index and one pool (the pool: what the ``live`` shards hold)."""
        live = set(range(self.smap.shards)) if live is None else live
        out = {tuple(m) for m in self.whole.match_prefix(keys)}
        n = next((p for p, k in enumerate(keys) if not any(k in self.pooled[s] for s in live)), len(keys))
        return out | ({(POOL, "dram", n)} if n else set())

    def answer(self, shard: int, keys: list[int]) -> tuple[list[tuple[str, str, int]], list[tuple[str, int]]]:
        """What shard ``shard``'s MatchPrefix says (services/cachesvc/server.py does the same)."""
        matches = [tuple(m) for m in self.shard_index[shard].match_own(keys, self.smap.index_positions(shard, keys))]
        mask = sum(1 << p for p in self.smap.pool_positions(shard, keys) if keys[p] in self.pooled[shard])
        return matches, ([("dram", mask)] if mask else [])

    def combined(self, keys: list[int], live: set[int]) -> set[tuple[str, str, int]]:
        answers = {s: self.answer(s, keys) for s in live}
        return set(combine(self.smap, keys, {s: a[0] for s, a in answers.items()},
                           {s: a[1] for s, a in answers.items()}))


@pytest.mark.parametrize("pool_copies", [1, 2])
@pytest.mark.parametrize("seed", range(12))
def test_three_shards_answer_what_one_index_and_pool_answer(seed, pool_copies):
    world = World(seed, shards=3, pool_copies=pool_copies)
    for prompt in world.prompts:
        keys = prompt + [random.Random(seed).getrandbits(64)]  # and a key nobody holds
        assert world.combined(keys, {0, 1, 2}) == world.truth(keys)


@pytest.mark.parametrize("pool_copies", [1, 2])
@pytest.mark.parametrize("seed", range(12))
def test_a_shard_down_loses_no_index_entry_and_only_the_pool_blocks_it_alone_held(seed, pool_copies):
    world = World(seed, shards=3, pool_copies=pool_copies)
    live = {0, 1, 2} - {seed % 3}
    for keys in world.prompts:
        assert world.combined(keys, live) == world.truth(keys, live)


def test_with_one_copy_a_shard_down_cuts_the_instances_runs_too():
    world = World(7, shards=3, copies=1)
    keys = max(world.prompts, key=len)
    dead = world.smap.pool_owners(keys[len(keys) // 2])[0]
    cut = next(p for p, k in enumerate(keys) if world.smap.index_owners(k) == (dead,))
    for inst, tier, n in world.combined(keys, {0, 1, 2} - {dead}):
        if inst != POOL:
            assert n <= cut
            assert (inst, tier) in {(i, t) for i, t, _ in world.truth(keys)}


def test_no_answer_no_match():
    assert combine(ShardMap(3), [1, 2, 3], {}, {}) == []
    assert combine(ShardMap(3), [], {0: [("i0", "device", 1)]}, {}) == []


def test_of_the_shards_indexing_a_key_only_its_first_tells_the_instances_about_its_copies():
    """Two shards index every key; only the one ranked first (which also keeps its first pool copy) says which
    blocks gained or lost another copy, so an instance never hears "sole" from a shard that cannot see the pool's
    copy while the other says "shared"."""
    from services.cachesvc.copies import CopyTracker

    smap = ShardMap(3, copies=2)
    keys = list(range(64))
    both = KVEventBatch("a", 1, 0.0, (BlockStored(tuple(keys), None, 16, "device"),))
    other = KVEventBatch("b", 1, 0.0, (BlockStored(tuple(keys), None, 16, "device"),))
    told: dict[int, set[int]] = {}
    for shard in range(3):
        index = BlockIndex(smap.index_slots(shard))
        tracker = CopyTracker(index, lambda key: False, smap.first_slots(shard))
        index.apply(both)
        index.apply(other)
        told[shard] = set(tracker.after_batch(other).instances["a"].shared)
    assert all(told[s] == {k for k in keys if smap.rank(k)[0] == s} for s in range(3))
    assert set().union(*told.values()) == set(keys) and sum(map(len, told.values())) == len(keys)
