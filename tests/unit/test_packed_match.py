"""Packed MatchPrefix answers: a shard's holder ids and counts (``BlockIndex.match_packed``), named through the
router's ``HolderNames`` and combined by ``combine_packed``, say exactly what the unpacked answers and
``kvmesh.contracts.shards.combine`` say, one index or three shards, all up or one down."""

import random

import numpy as np
import pytest
from kvmesh.contracts.events import BlockStored
from kvmesh.contracts.messages import KVEventBatch
from kvmesh.contracts.shards import POOL, combine
from kvmesh.proto.v1 import cache_pb2

from services.cachesvc.index import BlockIndex
from services.router.holders import MAX_HOLDERS, HolderNames, combine_packed
from tests.unit.test_cachesvc_shards import World


def named(index: BlockIndex, found: tuple[np.ndarray, np.ndarray]) -> set[tuple[str, str, int]]:
    names = {hid: (instance, tier) for hid, instance, tier in index.holder_names()}
    ids, counts = found
    assert ids.dtype == counts.dtype == np.uint32 and len(ids) == len(set(ids.tolist()))
    return {(*names[hid], n) for hid, n in zip(ids.tolist(), counts.tolist())}


@pytest.mark.parametrize("seed", range(12))
def test_match_packed_is_match_prefix_and_match_own(seed):
    world = World(seed, shards=3)
    for prompt in world.prompts:
        keys = prompt + [random.Random(seed).getrandbits(64)]
        for cut in (len(keys), len(keys) // 2, 1, 0):
            assert named(world.whole, world.whole.match_packed(keys[:cut])) == \
                {tuple(m) for m in world.whole.match_prefix(keys[:cut])}
        for shard, index in enumerate(world.shard_index):
            mine = world.smap.index_positions(shard, keys)
            assert named(index, index.match_packed(keys, mine)) == {tuple(m) for m in index.match_own(keys, mine)}


def test_a_mask_of_many_holders_unpacks_the_same():
    index = BlockIndex()
    keys = [11, 12, 13]
    for i in range(300):  # past the few-bits shortcut: numpy unpacks the mask
        index.apply(KVEventBatch(f"i{i}", 1, 0.0, (BlockStored(tuple(keys[:1 + i % 3]), None, 16, "device"),)))
    assert named(index, index.match_packed(keys)) == {tuple(m) for m in index.match_prefix(keys)}
    assert len(index.match_packed(keys)[0]) == 300


def test_holders_epoch_changes_with_the_table_and_between_processes():
    index = BlockIndex()
    first = index.holders_epoch
    index.apply(KVEventBatch("a", 1, 0.0, (BlockStored((1, 2), None, 16, "device"),)))
    after_new = index.holders_epoch
    assert after_new != first
    index.apply(KVEventBatch("a", 2, 0.0, (BlockStored((3,), 2, 16, "device"),)))
    assert index.holders_epoch == after_new  # no new holder: the table is the same
    index.drop_instance("a")
    assert index.holders_epoch != after_new
    assert BlockIndex().holders_epoch != BlockIndex().holders_epoch  # another process never repeats one


def packed_answer(world: World, names: HolderNames, shard: int, keys: list[int]) -> tuple[np.ndarray, np.ndarray]:
    index = world.shard_index[shard]
    ids, counts = index.match_packed(keys, world.smap.index_positions(shard, keys))
    if names.translate(shard, index.holders_epoch, ids.astype(np.int64)) is None:
        names.learn(shard, index.holders_epoch, index.holder_names())
    numbers = names.translate(shard, index.holders_epoch, ids.astype(np.int64))
    assert numbers is not None
    return numbers, counts.astype(np.int64)


@pytest.mark.parametrize("seed", range(12))
def test_combine_packed_is_combine(seed):
    world = World(seed, shards=3)
    names = HolderNames(3)
    for live in ({0, 1, 2}, {0, 1}, {1, 2}, {0, 2}):
        for keys in world.prompts:
            answers = {s: packed_answer(world, names, s, keys) for s in live}
            numbers, counts = combine_packed(world.smap, keys, answers, len(names))
            instances = {(names.instances[names._instance_of[g]], n) for g, n in zip(numbers, counts)}
            unpacked = combine(world.smap, keys, {s: world.answer(s, keys)[0] for s in live}, {})
            assert {(i, n) for i, _, n in unpacked if i != POOL} == instances
            best: dict[str, int] = {}
            for instance, _, n in unpacked:
                best[instance] = max(best.get(instance, 0), n)
            assert names.best(numbers, counts) == best


def test_names_of_an_old_epoch_stay_readable_and_unknown_ones_are_asked_again():
    names = HolderNames(1)
    names.learn(0, 5, [(0, "a", "device"), (1, "b", "device")])
    names.learn(0, 6, [(0, "c", "host"), (1, "b", "device")])  # id 0 freed and given to another holder
    assert names.epoch(0) == 6
    old, new = names.translate(0, 5, np.array([0])), names.translate(0, 6, np.array([0]))
    assert old is not None and new is not None and old[0] != new[0]
    assert names.best(np.concatenate([old, new]), np.array([3, 2])) == {"a": 3, "c": 2}
    assert names.translate(0, 7, np.array([0])) is None       # a table never learned
    assert names.translate(0, 6, np.array([2])) is None       # an id the table does not name
    for epoch in range(10, 20):
        names.learn(0, epoch, [(0, "a", "device")])
    assert names.translate(0, 5, np.array([0])) is None       # only the last few are kept


def test_the_numbering_starts_again_past_its_cap():
    names = HolderNames(2)
    names.learn(1, 9, [(0, "x", "device")])
    names.numbers((f"i{n}", "device") for n in range(MAX_HOLDERS + 1))
    names.maybe_reset()
    assert len(names) == 0 and names.epoch(1) == 0 and names.instances == []


def test_read_takes_packed_and_old_answers_alike():
    names = HolderNames(2)
    old = cache_pb2.MatchPrefixResponse(matches=[cache_pb2.TierMatch(instance_id="a", tier="device", num_blocks=4),
                                                 cache_pb2.TierMatch(instance_id=POOL, tier="dram", num_blocks=9)])
    numbers, counts = names.read(0, old)  # a cachesvc that predates packing: the pool's entry is not a holder
    assert names.best(numbers, counts) == {"a": 4}
    packed = cache_pb2.MatchPrefixResponse(
        packed=True, holder_ids=np.array([3, 0], "<u4").tobytes(), holder_counts=np.array([2, 5], "<u4").tobytes(),
        holders_epoch=77, holders=[cache_pb2.HolderName(id=0, instance_id="a", tier="host"),
                                   cache_pb2.HolderName(id=3, instance_id="b", tier="device")])
    numbers, counts = names.read(1, packed)
    assert names.best(numbers, counts) == {"a": 5, "b": 2}
    assert names.epoch(1) == 77
    del packed.holders[:]
    assert names.read(1, packed) is not None  # the table is known now: no names needed
    packed.holders_epoch = 78
    assert names.read(1, packed) is None      # an epoch never named: ask again
    packed.holders_epoch, packed.holder_counts = 77, b"\0\0\0"
    assert names.read(1, packed) is None      # malformed: left out, not misread


def test_an_answer_naming_no_holder_needs_no_table():
    """An index with no holders sends no names (it has none) and no ids: that answer is read as empty, not asked
    again as one whose names are missing (which doubled every MatchPrefix while the index was empty)."""
    names = HolderNames(1)
    empty = cache_pb2.MatchPrefixResponse(packed=True, holders_epoch=5)
    numbers, counts = names.read(0, empty)
    assert len(numbers) == len(counts) == 0 and names.best(numbers, counts) == {}
    assert names.epoch(0) == 0  # nothing learned: the next answer with names brings its table
    empty.holder_ids, empty.holder_counts = np.array([1], "<u4").tobytes(), np.array([2], "<u4").tobytes()
    assert names.read(0, empty) is None  # an id, and no table to name it: ask again
