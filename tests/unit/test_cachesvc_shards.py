"""The cachesvc shard map (kvmesh.contracts.shards) and sharded MatchPrefix: N shards' answers, combined, are what
one unsharded index answers; with a shard gone, never more than it, and exact for the keys the others own."""

import random
from collections import Counter

import pytest
from kvmesh.contracts.events import BlockRemoved, BlockStored
from kvmesh.contracts.messages import KVEventBatch
from kvmesh.contracts.shards import POOL, SLOTS, ShardMap, at, combine

from services.cachesvc.index import BlockIndex


def test_slots_spread_evenly_and_each_key_has_distinct_index_owners():
    smap = ShardMap(3, copies=2)
    first = Counter(smap.rank(slot)[0] for slot in range(SLOTS))
    assert set(first) == {0, 1, 2}
    assert all(abs(n - SLOTS / 3) < 0.1 * SLOTS / 3 for n in first.values()), first
    for slot in range(SLOTS):
        owners = smap.index_owners(slot)
        assert len(owners) == 2 and len(set(owners)) == 2
        assert owners[0] == smap.pool_owner(slot)
    assert ShardMap(2, copies=5).copies == 2  # never more copies than shards


def test_adding_a_shard_moves_about_one_in_n_plus_one_of_the_keys():
    before, after = ShardMap(4), ShardMap(5)
    moved = [slot for slot in range(SLOTS) if before.pool_owner(slot) != after.pool_owner(slot)]
    assert all(after.pool_owner(slot) == 4 for slot in moved)  # only to the new shard, never between old ones
    assert abs(len(moved) / SLOTS - 1 / 5) < 0.03


def test_bad_maps_are_refused():
    with pytest.raises(ValueError, match="at least one shard"):
        ShardMap(0)
    with pytest.raises(ValueError, match="at least one copy"):
        ShardMap(2, copies=0)


def test_at_places_a_run_of_own_keys_in_the_whole_list():
    assert at([1, 4, 6], 0, 9) == 1
    assert at([1, 4, 6], 2, 9) == 6
    assert at([1, 4, 6], 3, 9) == 9


class World:
    """Random prompts (key chains sharing prefixes), instances holding leading runs of them in two tiers, and a
    pool holding leading runs too; fed to one unsharded index and to each shard's."""

    def __init__(self, seed: int, shards: int, copies: int = 2) -> None:
        rng = random.Random(seed)
        self.smap = ShardMap(shards, copies)
        trunks = [[rng.getrandbits(64) for _ in range(rng.randint(1, 12))] for _ in range(4)]
        self.prompts = [trunk + [rng.getrandbits(64) for _ in range(rng.randint(0, 30))]
                        for trunk in trunks for _ in range(3)]
        self.whole = BlockIndex()
        self.shard_index = [BlockIndex(self.smap.index_slots(s)) for s in range(shards)]
        self.pool: set[int] = set()
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
        for prompt in rng.sample(self.prompts, 5):
            self.pool.update(prompt[:rng.randint(0, len(prompt))])

    def truth(self, keys: list[int]) -> set[tuple[str, str, int]]:
        out = {tuple(m) for m in self.whole.match_prefix(keys)}
        n = next((p for p, k in enumerate(keys) if k not in self.pool), len(keys))
        return out | ({(POOL, "dram", n)} if n else set())

    def answer(self, shard: int, keys: list[int]) -> list[tuple[str, str, int]]:
        """What shard ``shard``'s MatchPrefix says (services/cachesvc/server.py does the same)."""
        out = [tuple(m) for m in self.shard_index[shard].match_own(keys, self.smap.index_positions(shard, keys))]
        pooled = self.smap.pool_positions(shard, keys)
        run = next((j for j, p in enumerate(pooled) if keys[p] not in self.pool), len(pooled))
        if pooled and run:
            out.append((POOL, "dram", at(pooled, run, len(keys))))
        return out


@pytest.mark.parametrize("seed", range(20))
def test_three_shards_answer_what_one_index_answers(seed):
    world = World(seed, shards=3)
    for prompt in world.prompts:
        keys = prompt + [random.Random(seed).getrandbits(64)]  # and a key nobody holds
        answers = {s: world.answer(s, keys) for s in range(3)}
        assert set(combine(world.smap, keys, answers)) == world.truth(keys)


@pytest.mark.parametrize("seed", range(20))
def test_a_shard_down_loses_no_index_entry_and_cuts_the_pool_at_its_first_key(seed):
    world = World(seed, shards=3)
    dead = seed % 3
    for keys in world.prompts:
        answers = {s: world.answer(s, keys) for s in range(3) if s != dead}
        got = {(inst, tier): n for inst, tier, n in combine(world.smap, keys, answers)}
        cut = next((p for p, k in enumerate(keys) if world.smap.pool_owner(k) == dead), len(keys))
        for inst, tier, n in world.truth(keys):
            want = min(n, cut) if inst == POOL else n  # every key keeps an index owner; the pool loses 1/3
            assert got.pop((inst, tier), 0) == want
        assert not got


def test_with_one_copy_a_shard_down_cuts_the_instances_runs_too():
    world = World(7, shards=3, copies=1)
    keys = max(world.prompts, key=len)
    dead = world.smap.pool_owner(keys[len(keys) // 2])
    cut = next(p for p, k in enumerate(keys) if world.smap.pool_owner(k) == dead)
    answers = {s: world.answer(s, keys) for s in range(3) if s != dead}
    for inst, tier, n in combine(world.smap, keys, answers):
        assert n <= cut
        assert (inst, tier) in {(i, t) for i, t, _ in world.truth(keys)}


def test_no_answer_no_match():
    assert combine(ShardMap(3), [1, 2, 3], {}) == []
    assert combine(ShardMap(3), [], {0: [("i0", "device", 1)]}) == []
