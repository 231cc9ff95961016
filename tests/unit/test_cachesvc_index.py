"""BlockIndex: which (instance, tier) holds how many leading blocks, fed by KV event batches."""

import random
import tracemalloc

from kvmesh.contracts.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvmesh.contracts.ids import BlockKey
from kvmesh.contracts.messages import KVEventBatch

from services.cachesvc.index import BlockIndex, Holder, Order, PrefixMatch

KEYS = [BlockKey(k) for k in (11, 22, 33, 44, 55)]


def stored(keys, tier="device") -> BlockStored:
    return BlockStored(block_keys=tuple(keys), parent_key=None, token_count=16, tier=tier)


def removed(keys, tier="device") -> BlockRemoved:
    return BlockRemoved(block_keys=tuple(keys), tier=tier)


class Feed:
    """Numbers each instance's batches 1, 2, 3, ..."""

    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self.seq: dict[str, int] = {}

    def __call__(self, instance: str, *events: KVEvent) -> bool:
        self.seq[instance] = self.seq.get(instance, 0) + 1
        return self.index.apply(KVEventBatch(instance, self.seq[instance], 0.0, tuple(events)))


def test_match_counts_leading_blocks_per_instance_and_tier():
    index = BlockIndex()
    feed = Feed(index)
    feed("p0", stored(KEYS[:4], "device"), stored(KEYS[:2], "host"))
    feed("d0", stored(KEYS, "host"))
    assert index.match_prefix(KEYS) == [PrefixMatch("d0", "host", 5), PrefixMatch("p0", "device", 4),
                                        PrefixMatch("p0", "host", 2)]


def test_a_holder_stops_counting_at_its_first_missing_key():
    index = BlockIndex()
    Feed(index)("p0", stored([KEYS[0], KEYS[1], KEYS[3], KEYS[4]]))
    assert index.match_prefix(KEYS) == [PrefixMatch("p0", "device", 2)]


def test_holders_missing_the_first_key_do_not_match():
    index = BlockIndex()
    Feed(index)("p0", stored(KEYS[1:]))
    assert index.match_prefix(KEYS) == []
    assert index.match_prefix([]) == []


def test_block_removed_takes_only_that_tier():
    index = BlockIndex()
    feed = Feed(index)
    feed("p0", stored(KEYS, "device"), stored(KEYS, "host"))
    feed("p0", removed([KEYS[2]], "device"))
    assert index.match_prefix(KEYS) == [PrefixMatch("p0", "host", 5), PrefixMatch("p0", "device", 2)]


def test_removing_unknown_blocks_or_tiers_is_harmless():
    index = BlockIndex()
    feed = Feed(index)
    feed("p0", stored(KEYS[:2]))
    feed("p0", removed([999], "device"), removed(KEYS, "disk"))
    assert index.match_prefix(KEYS) == [PrefixMatch("p0", "device", 2)]


def test_all_blocks_cleared_removes_every_tier_of_that_instance_only():
    index = BlockIndex()
    feed = Feed(index)
    feed("p0", stored(KEYS, "device"), stored(KEYS, "host"))
    feed("d0", stored(KEYS[:3]))
    feed("p0", AllBlocksCleared())
    assert index.match_prefix(KEYS) == [PrefixMatch("d0", "device", 3)]
    feed("p0", stored(KEYS[:1], "host"))
    assert PrefixMatch("p0", "host", 1) in index.match_prefix(KEYS)


def test_last_holder_gone_removes_the_key():
    index = BlockIndex()
    feed = Feed(index)
    feed("p0", stored(KEYS))
    feed("p0", removed(KEYS[:2]))
    assert len(index) == 3


def test_duplicate_and_older_batches_are_ignored():
    index = BlockIndex()
    assert index.apply(KVEventBatch("p0", 1, 0.0, (stored(KEYS[:1]),)))
    assert index.apply(KVEventBatch("p0", 2, 0.0, (stored(KEYS[1:2]),)))
    assert not index.apply(KVEventBatch("p0", 2, 0.0, (removed(KEYS[1:2]),)))
    assert not index.apply(KVEventBatch("p0", 1, 0.0, (AllBlocksCleared(),)))
    assert index.match_prefix(KEYS) == [PrefixMatch("p0", "device", 2)]
    assert (index.duplicates, index.event_gaps, index.events_applied) == (2, 0, 2)


def test_a_gap_is_counted_and_the_batch_still_applied():
    index = BlockIndex()
    index.apply(KVEventBatch("p0", 1, 0.0, (stored(KEYS[:1]),)))
    assert index.apply(KVEventBatch("p0", 5, 0.0, (stored(KEYS[1:3]),)))
    assert index.event_gaps == 1
    assert index.match_prefix(KEYS) == [PrefixMatch("p0", "device", 3)]


def test_sequence_numbers_are_per_instance():
    index = BlockIndex()
    index.apply(KVEventBatch("p0", 1, 0.0, (stored(KEYS[:1]),)))
    index.apply(KVEventBatch("p0", 2, 0.0, ()))
    assert index.apply(KVEventBatch("d0", 1, 0.0, (stored(KEYS[:2]),)))
    assert index.apply(KVEventBatch("d0", 2, 0.0, ()))
    assert index.event_gaps == 0


def test_an_unknown_instance_starting_past_seq_1_is_a_gap():
    """Its beginning is not in the stream (aged out, or the index dropped it): only a snapshot can tell."""
    index = BlockIndex()
    batch = KVEventBatch("p0", 7, 0.0, (stored(KEYS[:1]),))
    assert index.order(batch) is Order.GAP
    assert index.order(KVEventBatch("p0", 1, 0.0, ())) is Order.NEXT


def test_order_tells_next_stale_and_gap():
    index = BlockIndex()
    index.apply(KVEventBatch("p0", 1, 0.0, ()))
    index.apply(KVEventBatch("p0", 2, 0.0, ()))
    assert [index.order(KVEventBatch("p0", seq, 0.0, ())) for seq in (1, 2, 3, 4)] == [
        Order.STALE, Order.STALE, Order.NEXT, Order.GAP]


def test_replace_instance_installs_a_snapshot_and_its_seq():
    index = BlockIndex()
    feed = Feed(index)
    feed("p0", stored(KEYS, "device"), stored(KEYS, "host"))
    feed("d0", stored(KEYS[:1]))
    index.replace_instance("p0", 9, [("device", KEYS[:2]), ("disk", KEYS[:3])])
    assert index.match_prefix(KEYS) == [PrefixMatch("p0", "disk", 3), PrefixMatch("p0", "device", 2),
                                        PrefixMatch("d0", "device", 1)]
    assert index.order(KVEventBatch("p0", 10, 0.0, ())) is Order.NEXT


def test_drop_instance_forgets_its_blocks_and_its_sequence():
    index = BlockIndex()
    feed = Feed(index)
    feed("p0", stored(KEYS, "device"), stored(KEYS[:2], "host"))
    feed("p0", stored(KEYS[:1], "disk"))
    feed("d0", stored(KEYS[:1]))
    assert index.drop_instance("p0") == 8
    assert index.match_prefix(KEYS) == [PrefixMatch("d0", "device", 1)]
    assert index.instances() == {"d0"}
    assert index.apply(KVEventBatch("p0", 1, 0.0, (stored(KEYS[:2]),)))  # a restarted p0 numbers from 1
    assert PrefixMatch("p0", "device", 2) in index.match_prefix(KEYS)


def test_holder_ids_are_reused_after_drop():
    index = BlockIndex()
    for round_ in range(50):
        index.apply(KVEventBatch(f"i{round_}", 1, 0.0, (stored(KEYS[:1]),)))
        index.drop_instance(f"i{round_}")
    index.apply(KVEventBatch("last", 1, 0.0, (stored(KEYS[:1]),)))
    assert index.match_prefix(KEYS) == [PrefixMatch("last", "device", 1)]
    assert len(index._holders) == 1


def test_bytes_per_block_at_100k_blocks():
    n = 100_000
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    keys = [BlockKey((0x9E3779B97F4A7C15 * (i + 1)) % (1 << 64)) for i in range(n)]  # as decoded off the bus
    index = BlockIndex()
    for inst in ("p0", "p1", "d0"):
        for start in range(0, n, 1000):
            chunk = keys[start:start + 1000]
            index.apply(KVEventBatch(inst, start // 1000 + 1, 0.0, (stored(chunk), stored(chunk, "host"))))
    del keys  # the index now owns the key objects, and they count
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_block = (after - before) / n
    print(f"\nBlockIndex: {per_block:.0f} bytes per block at {n} blocks, 6 holders each")
    assert len(index) == n
    assert per_block < 200


def held_runs(stores: dict[Holder, set[int]], keys: list[int]) -> list[PrefixMatch]:
    """The answer by definition: each holder's run of leading keys, most first, then by instance and tier."""
    runs = []
    for holder, held in stores.items():
        n = next((i for i, k in enumerate(keys) if k not in held), len(keys))
        if n:
            runs.append(PrefixMatch(holder.instance_id, holder.tier, n))
    return sorted(runs, key=lambda m: (-m.num_blocks, m.instance_id, m.tier))


def test_match_on_a_large_fleet_is_every_holders_run_in_order():
    rng = random.Random(7)
    chain = [BlockKey(rng.getrandbits(64)) for _ in range(64)]
    index, stores = BlockIndex(), {}
    feed = Feed(index)
    for i in range(300):  # 600 holders: their masks are unpacked whole, not bit by bit
        for tier in ("device", "host"):
            held = chain[:rng.randint(0, len(chain))] + chain[rng.randint(0, 63):][:rng.randint(0, 8)]
            feed(f"i{i:03d}", stored(held, tier))
            stores[Holder(f"i{i:03d}", tier)] = set(held)
    for keys in (chain, chain[:1], chain[:10] + [BlockKey(1)], chain[5:]):
        assert index.match_prefix(keys) == held_runs(stores, keys)


def test_one_or_two_wide_holders_are_packed_and_unpack_to_the_same_mask():
    from services.cachesvc.index import _pack, _unpack

    top = (1 << 24) - 1  # the highest id a packed value holds alone; with another, one less
    cases = [(0, False), (1, False), (0b1011, False), (1 << 239, False), (1 << 240, True), (1 << 2000, True),
             (1 << 3 | 1 << 900, True), (1 << 241 | 1 << 242, True), (1 << 1 | 1 << 2 | 1 << 700, False),
             (1 << top, True), (1 << 5 | 1 << top - 1, True), (1 << 5 | 1 << top, False), (1 << top + 1, False)]
    for mask, packed in cases:
        value = _pack(mask)
        assert _unpack(value) == mask
        assert (value < 0) == packed, mask.bit_length()


def test_a_fleet_with_hundreds_of_holders_answers_as_the_sets_it_was_told(monkeypatch):
    """Stores, removals, clears, drops and snapshots over 400 instances in two tiers (most keys with one or two
    holders of high ids: packed), against a plain set per holder: every answer the same."""
    rng = random.Random(11)
    keys = [BlockKey(rng.getrandbits(64)) for _ in range(120)]
    index, feed = BlockIndex(), None
    feed = Feed(index)
    stores: dict[Holder, set[int]] = {}
    names = [f"i{i:03d}" for i in range(400)]

    def forget(instance: str) -> None:
        for holder in [h for h in stores if h.instance_id == instance]:
            del stores[holder]

    for step in range(3000):
        instance, tier = rng.choice(names), rng.choice(("device", "host"))
        op = rng.random()
        start = rng.randrange(len(keys))
        some = keys[start:start + rng.randint(1, 12)]
        if op < 0.6:
            feed(instance, stored(some, tier))
            stores.setdefault(Holder(instance, tier), set()).update(some)
        elif op < 0.9:
            feed(instance, removed(some, tier))
            stores.get(Holder(instance, tier), set()).difference_update(some)
        elif op < 0.95:
            feed(instance, AllBlocksCleared())
            forget(instance)
        elif op < 0.98:
            index.drop_instance(instance)
            feed.seq.pop(instance, None)
            forget(instance)
        else:
            feed.seq[instance] = feed.seq.get(instance, 0) + 1
            index.replace_instance(instance, feed.seq[instance], [("device", some)])
            forget(instance)
            stores[Holder(instance, "device")] = set(some)
        if step % 100 == 99:
            held = {k for s in stores.values() for k in s}
            assert len(index) == len(held)
            for k in rng.sample(keys, 10):
                assert index.instances_holding(k) == {h.instance_id for h, s in stores.items() if k in s}
            for _ in range(5):
                first = rng.randrange(len(keys))
                prompt = keys[first:first + rng.randint(1, 40)]
                assert index.match_prefix(prompt) == held_runs(stores, prompt)
    assert max(index._ids.values()) > 500  # the ids went wide


def test_a_block_one_wide_holder_holds_costs_what_a_narrow_one_does():
    """Holder 1,500's block in 20,000 keys: no 1,500-bit int per key."""
    n = 20_000
    index = BlockIndex()
    for i in range(1500):  # give out ids 0 .. 1,499
        index._intern(Holder(f"i{i}", "device"))
    keys = [BlockKey((0x9E3779B97F4A7C15 * (i + 1)) % (1 << 64)) for i in range(n)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index.apply(KVEventBatch("i1499", 1, 0.0, (stored(keys),)))
    index.apply(KVEventBatch("i1498", 1, 0.0, (stored(keys[: n // 2]),)))  # half of them two holders
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_block = (after - before) / n
    assert index.match_prefix(keys[:3]) == [PrefixMatch("i1498", "device", 3), PrefixMatch("i1499", "device", 3)]
    assert per_block < 100, per_block  # a packed value and the dict's slot; an unpacked mask alone is ~215 B
